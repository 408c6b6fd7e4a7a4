"""Where Colibri's C sources are, and whether the CPython binding was built from them.

Two layouts carry the sources:

- a checkout (or an unpacked sdist): this file is host_tools/colibri/runtime/sources.py
  and the engine is at firmware/colibri_core beside host_tools;
- an installed wheel: setup.py copies the sources the commands need (engine,
  runner, boards, MicroPython module: PACKAGED) into colibri/_src.

`root()` is the one place that picks between them. `build_root()` is a tree
that `make` may write into: the checkout itself, or for an installed package
a copy of colibri/_src in the user's cache (site-packages may be read-only).

The binding (colibri.runtime._engine) is compiled with SOURCE_HASH, `source_hash()` of
the sources it was built from (HASHED). In a checkout, `check_binding()`
refuses a binding whose hash differs from the sources now on disk, so a C edit
cannot go untested by the Python tests; scripts/setup.sh rebuilds it when
`python scripts/source_hash.py check` says so. The quantiser's C search
(colibri.quant._q4_search) is built in the same step from sources this hash
covers, so the binding's check covers it too.

This module uses only the standard library: setup.py and scripts/source_hash.py
load it by path, before the package (numpy, the binding) can be imported.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

try:
    from ..model.errors import ColibriError
except ImportError:  # loaded by path from setup.py or scripts/source_hash.py
    ColibriError = RuntimeError  # type: ignore[misc,assignment]

# What the binding is built from: a change to any of these must rebuild it.
HASHED = (
    "firmware/colibri_core/include/**/*",
    "firmware/colibri_core/src/**/*",
    "firmware/colibri_core/posix/**/*",
    "firmware/colibri_core/sources.txt",
    "host_tools/colibri/runtime/_engine.c",
    "host_tools/colibri/quant/_q4_search.c",  # the quantiser's C search, built in the same step
    "setup.py",
    "pyproject.toml",
)

# What `natmod build`, `footprint`, `hil` and `flash` compile, shipped in the wheel
# and the sdist: the engine library, the runner firmware with its boards, and the
# MicroPython module (natively linked by colibri.target.natmod, or as a user C module).
PACKAGED = (
    "firmware/colibri_core/Makefile",
    "firmware/colibri_core/sources.txt",
    "firmware/colibri_core/include/**/*",
    "firmware/colibri_core/src/**/*",
    "firmware/colibri_core/posix/**/*",
    "firmware/runner/Makefile",
    "firmware/runner/*.c",
    "firmware/runner/*.h",
    "boards/board.h",
    "boards/*/*",
    "micropython_module/colibri_mp.c",
    "micropython_module/micropython.mk",
    "micropython_module/micropython.cmake",
    "micropython_module/natmod/*.c",
    "micropython_module/natmod/*.h",
)

# The colibri package: this file is colibri/runtime/sources.py.
PACKAGE_DIR = Path(__file__).resolve().parents[1]
PACKAGED_DIR = PACKAGE_DIR / "_src"
REBUILD_HINT = "run `make setup` (or `pip install --no-build-isolation --no-deps -e .`) in the checkout"


class StaleEngineError(ColibriError):
    """The loaded colibri.runtime._engine was built from other C sources than the checkout's."""


def files(root: Path, patterns: tuple[str, ...]) -> list[str]:
    """The regular files under `root` matching `patterns`, as sorted POSIX paths relative to it."""
    root = Path(root)
    found = set()
    for pattern in patterns:
        for path in root.glob(pattern):
            rel = path.relative_to(root)
            # Editor swap files and the like are no source.
            if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                found.add(rel.as_posix())
    return sorted(found)


def tree_hash(root: Path, relpaths: list[str]) -> str:
    """SHA-256 over each file's relative path and content: renames count, timestamps do not."""
    h = hashlib.sha256()
    for rel in relpaths:
        data = (Path(root) / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def source_hash(root: Path) -> str:
    """The hash of everything the binding is built from in the checkout or sdist at `root`."""
    rel = files(root, HASHED)
    if "host_tools/colibri/runtime/_engine.c" not in rel:
        raise FileNotFoundError(f"{root} holds no Colibri sources (no host_tools/colibri/runtime/_engine.c)")
    return tree_hash(root, rel)


def checkout_root() -> Path | None:
    """The checkout (or unpacked sdist) this package is imported from; None for an installed package."""
    root = PACKAGE_DIR.parents[1]
    if PACKAGE_DIR.parent.name == "host_tools" and (root / "setup.py").is_file() \
            and (root / "firmware" / "colibri_core" / "sources.txt").is_file():
        return root
    return None


def root() -> Path:
    """The C sources: the checkout's when running from one, else the copy packaged with colibri."""
    return checkout_root() or PACKAGED_DIR


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "colibri"


def build_root() -> Path:
    """A source tree `make` may build in: the checkout, or a private copy of the packaged sources.

    The copy lives in $XDG_CACHE_HOME/colibri (default ~/.cache/colibri), one per
    content hash, so builds are reused across runs and never mix two versions.
    """
    checkout = checkout_root()
    if checkout is not None:
        return checkout
    rel = files(PACKAGED_DIR, PACKAGED)
    if not rel:
        raise ColibriError(f"colibri's C sources are missing from {PACKAGED_DIR}: reinstall colibri-moe")
    dest = _cache_dir() / f"src-{tree_hash(PACKAGED_DIR, rel)[:16]}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=dest.parent))
    for r in rel:
        (tmp / r).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PACKAGED_DIR / r, tmp / r)
    try:
        tmp.rename(dest)
    except OSError:  # another process made the same copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def needs_rebuild(root: Path, built_hash: str | None) -> bool:
    """setup.sh's decision: a binding built from `built_hash` is stale for the sources at `root`."""
    return built_hash != source_hash(root)


def check_binding(module) -> None:
    """Raises StaleEngineError when running from a checkout whose sources differ from the binding's."""
    checkout = checkout_root()
    if checkout is None:
        return  # an installed package: its binding and sources come from the same wheel
    built = getattr(module, "SOURCE_HASH", None)
    if needs_rebuild(checkout, built):
        raise StaleEngineError(
            f"colibri.runtime._engine ({module.__file__}) was built from other sources than {checkout} now holds "
            f"(built from {str(built)[:12]}, sources now {source_hash(checkout)[:12]}): {REBUILD_HINT}")


def binding_hash(package_dir: Path | None = None) -> str | None:
    """SOURCE_HASH of the built binding in `package_dir` (default: where `colibri` is found), loaded
    without importing colibri itself (which would refuse a stale binding); None if none is built."""
    if package_dir is None:
        spec = importlib.util.find_spec("colibri")
        if spec is None or not spec.submodule_search_locations:
            return None
        package_dir = Path(list(spec.submodule_search_locations)[0])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(package_dir) / "runtime" / f"_engine{suffix}"
        if path.is_file():
            loader = importlib.machinery.ExtensionFileLoader("colibri.runtime._engine", str(path))
            spec = importlib.util.spec_from_file_location("colibri.runtime._engine", path, loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return getattr(module, "SOURCE_HASH", "unknown")  # built before bindings carried it
    return None


def main(argv: list[str]) -> int:
    """`hash [ROOT]` prints source_hash; `check [ROOT]` exits 1 when the binding must be rebuilt."""
    if not argv or argv[0] not in ("hash", "check"):
        print("usage: source_hash.py hash|check [ROOT]", file=sys.stderr)
        return 2
    where = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[3]
    if argv[0] == "hash":
        print(source_hash(where))
        return 0
    built = binding_hash()
    if needs_rebuild(where, built):
        state = "no colibri.runtime._engine built" if built is None else f"built from {built[:12]}"
        print(f"binding is stale: {state}, sources now {source_hash(where)[:12]}")
        return 1
    print(f"binding is current ({built[:12]})")
    return 0
