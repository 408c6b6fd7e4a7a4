"""README.md as a new user reads it: every snippet runs, every command it names exists, every link resolves.

The snippets run in document order in one empty folder, as a reader would type them: Python blocks as
scripts in a subprocess, `colibri` command lines with the installed CLI, the C program compiled against
the host library and run on the model the Python snippet exported. Install and build commands (`pip`,
`make`) are not run (they set up a machine); their extras and targets must exist. The same link check
covers CONTRIBUTING.md and docs/."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from helpers.build import CORE, ROOT, make

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
RUNNABLE = {"python", "c", "sh"}


def blocks(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in FENCE.finditer(text)]


def commands(script: str) -> list[str]:
    """A shell block's command lines: comments dropped, backslash continuations joined."""
    lines = re.sub(r"\\\n\s*", " ", script).splitlines()
    return [line.split(" #", 1)[0].strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):(?!=)", (ROOT / "Makefile").read_text(), re.M))


def extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def check_setup_command(command: str) -> None:
    """`pip install colibri-moe[extra]` with extras pyproject.toml defines; `make TARGET` with a Makefile target."""
    words = command.replace('"', "").split()
    if words[:2] == ["pip", "install"]:
        (spec,) = words[2:]
        name, _, extra = spec.partition("[")
        assert name == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"], command
        assert not extra or set(extra.rstrip("]").split(",")) <= extras(), command
    elif words[0] == "make":
        assert words[1:] and set(words[1:]) <= makefile_targets(), f"{command}: no such Makefile target"
    else:
        raise AssertionError(f"README.md shell line neither runs here nor sets up a machine: {command!r}")


def test_every_block_is_runnable_or_the_diagram() -> None:
    kinds = [kind for kind, _ in blocks(README.read_text())]
    assert kinds.count("text") == 1 and set(kinds) <= RUNNABLE | {"text"}, kinds
    assert {"python", "c", "sh"} <= set(kinds)


@pytest.fixture(scope="module")
def host_library() -> Path:
    r = make("-C", str(CORE), "host")
    assert r.returncode == 0, r.stdout + r.stderr
    return CORE / "build" / "host" / "libcolibri.a"


@pytest.mark.slow
def test_readme_snippets_run(tmp_path: Path, host_library: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    ran = {"python": 0, "c": 0, "sh": 0}

    def run(cmd, what: str, **kw) -> str:
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, **kw)
        assert r.returncode == 0, f"README.md {what} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    for n, (kind, body) in enumerate(blocks(README.read_text())):
        if kind == "python":
            script = tmp_path / f"snippet{n}.py"
            script.write_text(body)
            run([sys.executable, str(script)], f"Python snippet {n}")
        elif kind == "c":
            source, exe = tmp_path / f"snippet{n}.c", tmp_path / f"snippet{n}"
            source.write_text(body)
            cc = shutil.which("gcc") or "cc"
            run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", f"-I{CORE / 'include'}", str(source), str(host_library),
                 "-lm", "-o", str(exe)], f"C snippet {n} (compile)")
            out = run([str(exe)], f"C snippet {n}")
            assert out.startswith("ok"), out
        elif kind == "sh":
            for command in commands(body):
                if command.startswith("colibri "):
                    run(command.split(), f"command {command!r}")
                    ran["sh"] += 1
                else:
                    check_setup_command(command)
            continue
        else:
            continue
        ran[kind] += 1
    assert all(ran.values()), ran


def test_setup_commands_name_what_exists() -> None:
    """The pip and make lines a reader is told to type name real extras and targets (and the check
    refuses what does not exist)."""
    for kind, body in blocks(README.read_text()):
        if kind == "sh":
            for command in commands(body):
                if not command.startswith("colibri "):
                    check_setup_command(command)
    for wrong in ("make chek", 'pip install "colibri-moe[tpu]"', "pip install colibri", "curl example.org | sh"):
        with pytest.raises(AssertionError):
            check_setup_command(wrong)


LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"\w+://|#|mailto:", target):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
