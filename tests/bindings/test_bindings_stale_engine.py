"""The Python tests never run a binding built from older C sources than the checkout's.

The binding carries SOURCE_HASH (colibri.runtime.sources.source_hash of what it was
built from); importing colibri from a checkout whose sources differ refuses it,
and scripts/setup.sh rebuilds it whenever they differ.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import colibri
from colibri.runtime import _engine, sources

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# Edits that change what the binding is: engine code, a kernel, a header, the source
# list, the binding's own C, the build flags, and a new source file.
EDITS = {
    "engine source": ("firmware/colibri_core/src/colibri_engine.c", "\n/* edited */\n"),
    "kernel": ("firmware/colibri_core/src/kernels/colibri_kernels_ref.c", "\n/* edited */\n"),
    "public header": ("firmware/colibri_core/include/colibri.h", "\n/* edited */\n"),
    "internal header": ("firmware/colibri_core/src/colibri_internal.h", "\n/* edited */\n"),
    "source list": ("firmware/colibri_core/sources.txt", "src/kernels/colibri_kernels_new.c\n"),
    "binding": ("host_tools/colibri/runtime/_engine.c", "\n/* edited */\n"),
    "quantiser's C search": ("host_tools/colibri/quant/_q4_search.c", "\n/* edited */\n"),
    "build flags": ("setup.py", "\n# edited\n"),
    "new file": ("firmware/colibri_core/src/kernels/colibri_kernels_new.c", "int colibri_new;\n"),
}


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what the binding is built from, with the package (and its built binding) and the scripts."""
    copy = tmp_path / "checkout"
    for rel in sources.files(ROOT, sources.HASHED):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    shutil.copytree(ROOT / "host_tools" / "colibri", copy / "host_tools" / "colibri", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    return copy


def edit(root: Path, what: str) -> None:
    rel, text = EDITS[what]
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(text)


def test_loaded_binding_is_built_from_this_checkout() -> None:
    assert sources.checkout_root() == ROOT
    assert Path(_engine.__file__).parent == ROOT / "host_tools" / "colibri" / "runtime"
    assert _engine.SOURCE_HASH == sources.source_hash(ROOT)
    # the quantiser's C search is built in the same step from the same sources: the engine's check covers it
    from colibri.quant import _q4_search

    assert Path(_q4_search.__file__).parent == ROOT / "host_tools" / "colibri" / "quant"
    assert _q4_search.SOURCE_HASH == _engine.SOURCE_HASH


@pytest.mark.parametrize("what", EDITS)
def test_every_source_edit_calls_for_a_rebuild(checkout: Path, what: str) -> None:
    assert not sources.needs_rebuild(checkout, _engine.SOURCE_HASH)
    edit(checkout, what)
    assert sources.needs_rebuild(checkout, _engine.SOURCE_HASH)


def test_other_files_do_not_call_for_a_rebuild(checkout: Path) -> None:
    (checkout / "firmware" / "colibri_core" / "build" / "host").mkdir(parents=True)
    (checkout / "firmware" / "colibri_core" / "build" / "host" / "libcolibri.a").write_bytes(b"!<arch>\n")
    (checkout / "host_tools" / "colibri" / "cli" / "run.py").write_text("# python only\n", "utf-8")
    (checkout / "firmware" / "colibri_core" / "src" / ".colibri_engine.c.swp").write_bytes(b"vim")
    assert not sources.needs_rebuild(checkout, _engine.SOURCE_HASH)


def _import_colibri(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root / "host_tools"))
    code = ("import colibri, numpy as np; m = colibri.Model(open('m.clb', 'rb').read()); "
            "print(colibri.__file__); print(m.forward(np.ones(m.input_size, np.float32)))")
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120)


def test_import_refuses_a_binding_older_than_the_sources(checkout: Path) -> None:
    torch.manual_seed(0)
    colibri.export(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), checkout / "m.clb")

    r = _import_colibri(checkout)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(checkout / "host_tools" / "colibri" / "__init__.py")

    edit(checkout, "kernel")
    r = _import_colibri(checkout)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("colibri.runtime.sources.StaleEngineError: colibri.runtime._engine"), r.stderr
    assert "make setup" in last and "pip install --no-build-isolation --no-deps -e ." in last


def _fake_venv(root: Path) -> Path:
    """setup.sh's .venv in the copy: this Python, a pip that records its arguments, an up-to-date stamp."""
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec "{PY}" "$@"\n')
    log = root / "pip.log"
    (venv_bin / "pip").write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    for exe in venv_bin.iterdir():
        exe.chmod(0o755)
    deps = hashlib.sha256((root / "pyproject.toml").read_bytes() + (root / "setup.py").read_bytes()).hexdigest()
    (root / ".venv" / ".colibri-installed").write_text(deps + "\n")
    return log


def _setup_sh(root: Path) -> subprocess.CompletedProcess:
    # dpkg-query answers "installed" for every system package, so the apt step is a no-op here.
    stubs = root / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "dpkg-query").write_text("#!/bin/sh\necho 'install ok installed'\n")
    (stubs / "dpkg-query").chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}")
    return subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=120)


def test_setup_sh_rebuilds_the_binding_after_a_c_edit(checkout: Path) -> None:
    log = _fake_venv(checkout)
    r = _setup_sh(checkout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not log.exists(), "nothing changed: setup.sh must not run pip"

    edit(checkout, "engine source")
    r = _setup_sh(checkout)
    assert "rebuilding the CPython binding" in r.stdout
    # Only the extension, without reinstalling the dependencies.
    assert log.read_text().splitlines() == ["install -q --no-build-isolation --no-deps -e ."]
    # The recording pip built nothing, so setup.sh's own check after the rebuild fails loudly.
    assert r.returncode != 0 and "binding is stale" in r.stdout


@pytest.mark.parametrize("built", ["unknown", None, "0" * 64])
def test_a_binding_without_this_checkouts_hash_is_refused(built: str | None) -> None:
    import types

    binding = types.SimpleNamespace(__file__="_engine.so")
    if built is not None:
        binding.SOURCE_HASH = built
    with pytest.raises(sources.StaleEngineError, match="make setup"):
        sources.check_binding(binding)
    sources.check_binding(_engine)  # the one this session runs with is current
