"""colibri as a user installs it: the sdist and the wheel carry the C sources, and every command
works from a wheel installed outside the checkout (natmod, footprint, hil and flash compile the
engine, the runner and the MicroPython module from the copy packaged in the wheel)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri.runtime import sources

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
NAME = "colibri_moe-0.1.0"

FACTORY = '''
import torch
from colibri import nn as cnn


def build():
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        cnn.Residual(cnn.MoE(16, 4, 24, top_k=2, routing="topk_softmax", gated=True, activation="silu")),
        torch.nn.Linear(16, 4),
    ).eval()
'''


def run(cmd: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build` on a clean copy of the checkout: the sdist, then the wheel built from that sdist."""
    tmp = tmp_path_factory.mktemp("dist")
    tree = tmp / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", "*.o", "*.a", ".pio", ".pytest_cache",
        ".hypothesis", "out"))
    run([PY, "-m", "build", "--outdir", tmp / "out", tree], cwd=tmp)
    return tmp / "out"


def test_sdist_carries_the_c_sources(dist: Path) -> None:
    with tarfile.open(dist / f"{NAME}.tar.gz") as tar:
        members = {m.name.removeprefix(f"{NAME}/") for m in tar.getmembers() if m.isfile()}
    needed = set(sources.files(ROOT, sources.PACKAGED + sources.HASHED))
    assert {"firmware/colibri_core/src/colibri_engine.c", "firmware/runner/runner.c",
            "boards/mps2_an500/board.mk", "micropython_module/colibri_mp.c"} <= needed
    assert needed - members == set()
    assert not [m for m in members if m.endswith((".so", ".o", ".pyc"))]
    # README.md sends a wheel user to the sdist for what it links to (the wheel carries no docs).
    links = re.findall(r"\]\(([^)#:\s]+)\)", (ROOT / "README.md").read_text())
    assert links and {link for link in links if link not in members} == set()


def test_wheel_carries_the_sources_and_the_binding(dist: Path) -> None:
    (wheel,) = dist.glob(f"{NAME}-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {f"colibri/_src/{rel}" for rel in sources.files(ROOT, sources.PACKAGED)}
    assert packaged - names == set()
    assert [n for n in names if re.fullmatch(r"colibri/runtime/_engine\..*\.so", n)]


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel installed. The dependencies (torch, ...) come
    from this test's own environment through a .pth line; that folder's own .pth files, among them the
    editable install's path to the checkout, are not processed, so the checkout stays unimportable."""
    env_dir = tmp_path_factory.mktemp("venv") / "venv"
    run([PY, "-m", "venv", "--without-pip", env_dir], cwd=env_dir.parent)
    vpy = env_dir / "bin" / "python"
    purelib = Path(run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=env_dir).stdout.strip())
    (purelib / "colibri-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = dist.glob(f"{NAME}-*.whl")
    # --ignore-installed: the editable colibri-moe visible through the .pth must stay where it is.
    run([PY, "-m", "pip", "--python", vpy, "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel],
        cwd=env_dir)
    return env_dir


def test_every_command_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymoe.py").write_text(FACTORY)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", XDG_CACHE_HOME=str(cache), PYTHONPATH=str(work))
    exe = venv / "bin" / "colibri"

    def colibri_cli(*args: str) -> str:
        return run([exe, *args], cwd=work, env=env).stdout

    where = run([venv / "bin" / "python", "-c", "import colibri, colibri.runtime.sources as s; "
                 "print(colibri.__file__); print(s.checkout_root()); print(s.root())"], cwd=work, env=env).stdout
    file, checkout, root = where.splitlines()
    assert Path(file).is_relative_to(venv), file
    assert checkout == "None" and Path(root).is_relative_to(venv)

    assert "0.1.0" in colibri_cli("--version")
    assert "wrote moe.clb" in colibri_cli("export", "mymoe:build", "moe.clb", "--max-batch", "4")
    np.save(work / "calib.npy", np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32))
    assert "wrote q8.clb" in colibri_cli("quantize", "moe.clb", "q8.clb", "--dtype", "q8", "--calibration", "calib.npy")
    assert "q8" in colibri_cli("info", "q8.clb").lower()

    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    np.save(work / "x.npy", x)
    colibri_cli("run", "moe.clb", "-i", "x.npy", "-o", "y.npy")
    # The wheel's binding and this checkout's are built from the same sources: same answers, bit for bit.
    np.testing.assert_array_equal(np.load(work / "y.npy"), colibri.Model(work / "moe.clb").forward(x))

    colibri_cli("pack", "moe.clb", "--c-array", "carray", "--flash-image", "slot")
    assert (work / "carray" / "model.c").is_file() and (work / "carray" / "model.h").is_file()
    assert (work / "slot.bin").is_file() and (work / "slot.hex").is_file()

    for arch, code in (("x64", 2), ("armv7emsp", 7)):
        assert f"wrote {arch}.mpy" in colibri_cli("natmod", "build", "--arch", arch, "-o", f"{arch}.mpy")
        assert (work / f"{arch}.mpy").read_bytes()[:3] == bytes([ord("M"), 6, code << 2 | 3])

    out = colibri_cli("footprint", "moe.clb")
    assert re.search(r"engine \(Cortex-M7 libcolibri.a\): code [\d,]+ B flash", out), out
    assert re.search(r"runner \(runner.elf\): flash [\d,]+ B", out), out
    assert "stack high-water" in out
    assert "device agrees with the host engine" in colibri_cli("hil", "moe.clb")
    out = colibri_cli("flash", "moe.clb", "--qemu-flash", "flash.bin")
    assert "flashed moe.clb to slot" in out and (work / "flash.bin").is_file(), out

    # The firmware was built in the user's cache from the packaged sources, not inside site-packages.
    assert list(cache.glob("colibri/src-*/firmware/runner/build/mps2_an500/runner.elf"))
    assert list(cache.glob("colibri/src-*/firmware/colibri_core/build/cm7/libcolibri.a"))
    assert not list(venv.rglob("colibri/_src/**/build"))

    # The maintainer's header check, where the CLI still has it: the packaged header matches colibri.model.format.
    if subprocess.run([exe, "gen-header", "--help"], capture_output=True, cwd=work, env=env).returncode == 0:
        colibri_cli("gen-header", "--check")
