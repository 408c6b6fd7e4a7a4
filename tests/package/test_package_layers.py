"""The package's layers: what each subpackage of colibri may import, checked on the source.

LAYERS is the one definition of the table. A module
imports a module of its own subpackage, or of a subpackage its layer lists; deferred
imports (inside a function) count as much as top-level ones, so a cycle cannot hide in a
function body. A `_private` name is used only inside the subpackage that defines it.
torch and transformers are imported only by the front ends, where a PyTorch or Hugging Face
module is read, and by the commands that read one (cli.export).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "host_tools" / "colibri"

# subpackage -> the subpackages it may import (besides itself). "" is the package's own
# top-level modules: colibri/__init__.py (the public names), colibri/nn.py and colibri/pytest_plugin.py (aliases).
LAYERS: dict[str, set[str]] = {
    "model": set(),  # the standard library and numpy only
    "image": {"model"},
    "reference": {"model"},
    "quant": {"model", "image", "reference"},
    "runtime": {"model", "image"},
    "frontends": {"model", "image", "reference", "quant", "runtime"},
    "target": {"model", "image", "quant", "runtime", "checkpoints"},  # the board budget plans checkpoints too
    # checkpoint files streamed to an image, without torch; runtime for the tokenizer files' section builder
    "checkpoints": {"model", "image", "quant", "runtime"},
    "": {"model", "image", "reference", "runtime", "frontends", "target", "checkpoints"},
    "cli": {"model", "image", "reference", "quant", "runtime", "frontends", "target", "checkpoints"},
}
# Third-party packages some layers must not import at all (the image-to-image commands run without them).
HEAVY = {"torch", "transformers"}
# runtime.tokenizer_build: transformers' GPT-2 byte table, imported only when a byte-level BPE section is
# built or rebuilt as a library tokenizer (the tokenizer extra).
# checkpoints.gguf_tokenizer: transformers' GGUF tokenizer conversion, only when a GGUF's byte-level BPE goes into
# a section; checkpoints.chat_template: transformers' chat-template rendering, only for generate --chat.
MAY_IMPORT_HEAVY = {"frontends", "cli.export", "runtime.tokenizer_build", "checkpoints.gguf_tokenizer",
                    "checkpoints.chat_template"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """colibri.quant.calibrate -> quant; colibri and colibri.nn -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and f"colibri.{parts[1]}" in MODULES and \
        MODULES[f"colibri.{parts[1]}"].name == "__init__.py" else ""


def resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


class Imports:
    """Every colibri module a module imports (deferred too), the private names it takes from one,
    and the third-party top-level packages it imports."""

    def __init__(self) -> None:
        self.arrows: dict[str, set[str]] = defaultdict(set)
        self.private: list[tuple[str, int, str, str]] = []  # (module, line, from module, name)
        self.third_party: dict[str, set[str]] = defaultdict(set)
        for module, path in MODULES.items():
            self._scan(module, ast.parse(path.read_text("utf-8"), str(path)))

    def _scan(self, module: str, tree: ast.AST) -> None:
        aliases: dict[str, str] = {}  # local name -> colibri module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "colibri":
                        self.arrows[module].add(alias.name)
                        if alias.asname:
                            aliases[alias.asname] = alias.name
                    else:
                        self.third_party[module].add(alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                source = resolve(module, node)
                if source.split(".")[0] != "colibri":
                    self.third_party[module].add(source.split(".")[0])
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in MODULES:  # `from . import format`: the module itself
                        self.arrows[module].add(sub)
                        aliases[alias.asname or alias.name] = sub
                    else:
                        self.arrows[module].add(source)
                        if alias.name.startswith("_"):
                            self.private.append((module, node.lineno, source, alias.name))
        for node in ast.walk(tree):  # module._name, where module is another colibri module
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                self.private.append((module, node.lineno, aliases[node.value.id], node.attr))
        self.arrows[module].discard(module)


IMPORTS = Imports()


def test_every_module_is_in_a_layer() -> None:
    assert set(layer_of(m) for m in MODULES) == set(LAYERS)


def test_imports_follow_the_layers() -> None:
    wrong = sorted(f"{m} imports {t}" for m, targets in IMPORTS.arrows.items() for t in targets
                   if t in MODULES and layer_of(t) != layer_of(m) and layer_of(t) not in LAYERS[layer_of(m)])
    assert wrong == []


def test_nothing_imports_the_cli() -> None:
    assert sorted(m for m, targets in IMPORTS.arrows.items()
                  if layer_of(m) != "cli" and any(layer_of(t) == "cli" for t in targets if t in MODULES)) == []


def test_no_import_cycle() -> None:
    """Between modules, deferred imports included (a package's __init__ re-exporting its own modules
    is no cycle: it is the package's face, and its modules import each other, not it)."""
    graph = {m: {t for t in ts if t in MODULES and not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
             for m, ts in IMPORTS.arrows.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_private_name_crosses_a_subpackage() -> None:
    crossing = sorted(f"{m}:{line} uses {source}.{name}" for m, line, source, name in IMPORTS.private
                      if layer_of(source) != layer_of(m))
    assert crossing == []


def test_torch_and_transformers_only_where_a_pytorch_module_is_read() -> None:
    heavy = sorted(f"{m} imports {sorted(IMPORTS.third_party[m] & HEAVY)}" for m in MODULES
                   if IMPORTS.third_party[m] & HEAVY
                   and not any(m == f"colibri.{allowed}" or layer_of(m) == allowed for allowed in MAY_IMPORT_HEAVY))
    assert heavy == []


@pytest.mark.parametrize("source, expected", [
    ("from ..image import reader\n", "image imports a layer below it"),
    ("def f():\n    from ..quant import quantize\n", "a deferred import counts"),
])
def test_the_check_sees_a_wrong_import(source: str, expected: str) -> None:
    """The walk itself: a model module importing image or quant is caught, at top level or deferred."""
    probe = Imports.__new__(Imports)
    probe.arrows, probe.private, probe.third_party = defaultdict(set), [], defaultdict(set)
    MODULES["colibri.model.probe"] = PACKAGE / "model" / "probe.py"
    try:
        probe._scan("colibri.model.probe", ast.parse(source))
    finally:
        del MODULES["colibri.model.probe"]
    targets = probe.arrows["colibri.model.probe"]
    assert targets and all(layer_of(t) not in LAYERS["model"] | {"model"} for t in targets), expected


def test_the_check_sees_a_private_name() -> None:
    probe = Imports.__new__(Imports)
    probe.arrows, probe.private, probe.third_party = defaultdict(set), [], defaultdict(set)
    MODULES["colibri.target.probe"] = PACKAGE / "target" / "probe.py"
    try:
        probe._scan("colibri.target.probe", ast.parse(
            "from ..quant.quantize import _hidden\nfrom ..reference import executor as ex\nex._linear(1)\n"))
    finally:
        del MODULES["colibri.target.probe"]
    assert {(s, n) for _, _, s, n in probe.private} == {("colibri.quant.quantize", "_hidden"),
                                                          ("colibri.reference.executor", "_linear")}
