"""The tests stand alone: a test module imports helpers (tests/helpers) and the package, never another test
module or conftest, and each lives in the folder of the room it tests with its room in its name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.build import ROOT

TESTS = ROOT / "tests"
TEST_FILES = sorted(p for p in TESTS.rglob("test_*.py") if "helpers" not in p.parts and "c" not in p.parts)
# folder -> the prefix its test files' names carry (after "test_")
ROOMS = {"engine": "engine", "kernels": "kernels", "image": "image", "export": "export", "quant": "quant",
         "lm": "lm", "target": "target", "micropython": "micropython", "edge": "edge", "bindings": "bindings",
         "cli": "cli", "package": "package", "docs": "docs", "examples": "example", "benchmarks": "bench"}


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module the file imports, at any depth of the code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_imports_no_test_module(path: Path) -> None:
    bad = {name for name in imported_modules(path) if name.startswith("test_") or name == "conftest"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: shared code belongs in tests/helpers"


def test_helpers_import_no_test_module() -> None:
    for path in sorted((TESTS / "helpers").glob("*.py")):
        bad = {name for name in imported_modules(path) if name.startswith("test_") or name == "conftest"}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_every_test_is_in_a_room() -> None:
    misplaced = [str(p.relative_to(TESTS)) for p in TEST_FILES
                 if p.parent.parent != TESTS or p.parent.name not in ROOMS
                 or not p.name.startswith(f"test_{ROOMS[p.parent.name]}")]
    assert not misplaced, f"test files outside a room folder, or without its prefix: {misplaced}"
    names = [p.name for p in TEST_FILES]
    assert len(names) == len(set(names)), "two test files share a name (pytest imports them by basename)"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The import walk sees a test import hidden in a function, and a conftest import."""
    sneaky = tmp_path / "test_sneaky.py"
    sneaky.write_text("def test_x():\n    from test_other import thing\n    import conftest\n")
    assert {"test_other", "conftest"} <= imported_modules(sneaky)
