"""Image-to-image work runs where torch and transformers cannot be imported (`pip install colibri-moe`
without extras), and what needs them says which extra to install.

Each command runs in a fresh interpreter whose import system refuses torch and transformers (a
meta-path finder ahead of the real ones), on an image written here from numpy arrays alone; every
refused import is reported on stderr, so a command that tried one and carried on fails too.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri import image
from colibri.model.format import Act, ExpertKind, Routing
from colibri.model.ir import Expert, Graph, Linear, MoE

from helpers.without_torch import BLOCKED, LAUNCH, REFUSED, colibri_without_torch  # noqa: F401


def moe_graph(seed: int = 0) -> Graph:
    """Linear -> MoE (3 GLU experts, top-2) -> Linear, from numpy only."""
    rng = np.random.default_rng(seed)

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    experts = [Expert(ExpertKind.GLU, Act.SILU, w1=w(24, 16), w2=w(16, 24), w3=w(24, 16)) for _ in range(3)]
    moe = MoE(Routing.SOFTMAX_TOPK, 2, w(3, 16), experts, np.arange(3, dtype=np.int32))
    return Graph([Linear(w(16, 8), np.zeros(16, np.float32)), moe, Linear(w(4, 16))], 8, 4, max_batch=4)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "model.clb").write_bytes(image.write(moe_graph()))
    np.save(tmp_path / "x.npy", np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32))
    return tmp_path


def assert_ran_without_torch(r: subprocess.CompletedProcess) -> None:
    assert REFUSED not in r.stderr, r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_launcher_refuses_torch(work: Path) -> None:
    """The check itself: with the finder in place, torch cannot be imported, and the attempt shows."""
    r = subprocess.run([sys.executable, "-c", LAUNCH.replace("from colibri.cli import main\nmain()", "import torch"),
                        ], capture_output=True, text=True, cwd=work, timeout=120)
    assert r.returncode == 1 and REFUSED + "torch" in r.stderr, r.stderr


@pytest.mark.parametrize("args, expect", [
    (["quantize", "model.clb", "q8.clb", "--dtype", "q8"], "wrote q8.clb"),
    (["quantize", "model.clb", "q4.clb", "--dtype", "q4", "--calibration", "x.npy", "--report"], "wrote q4.clb"),
    (["info", "model.clb"], "MoE"),
    (["info", "model.clb", "--json"], '"routed_experts": 3'),
    (["run", "model.clb", "-i", "x.npy", "-o", "y.npy"], ""),
    (["run", "model.clb", "-i", "x.npy", "--reference"], ","),
    (["verify", "model.clb"], "model.clb: ok"),
    (["pack", "model.clb", "--c-array", "carray", "--flash-image", "slot"], "slot"),
])
def test_image_commands_run_without_torch(work: Path, args: list[str], expect: str) -> None:
    r = colibri_without_torch(*args, cwd=work)
    assert_ran_without_torch(r)
    assert expect in r.stdout, r.stdout


def test_run_without_torch_gives_the_engines_answer(work: Path) -> None:
    import colibri

    assert_ran_without_torch(colibri_without_torch("run", "model.clb", "-i", "x.npy", "-o", "y.npy", cwd=work))
    want = colibri.Model(work / "model.clb").forward(np.load(work / "x.npy"))
    np.testing.assert_array_equal(np.load(work / "y.npy"), want)


@pytest.mark.cross
@pytest.mark.slow
@pytest.mark.qemu
def test_hil_runs_without_torch(work: Path) -> None:
    r = colibri_without_torch("hil", "model.clb", cwd=work)
    assert_ran_without_torch(r)
    assert "device agrees with the host engine" in r.stdout, r.stdout


@pytest.mark.slow
def test_natmod_build_runs_without_torch(work: Path) -> None:
    r = colibri_without_torch("natmod", "build", "--arch", "x64", "-o", "x64.mpy", cwd=work)
    assert_ran_without_torch(r)
    assert (work / "x64.mpy").stat().st_size > 0


def test_export_names_the_extra_to_install(work: Path) -> None:
    r = colibri_without_torch("export", "mymodel:build", "out.clb", cwd=work)
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == ("colibri: error: reading a PyTorch module (colibri.export, colibri.nn, "
                                         "colibri export) needs torch, which is not installed: "
                                         "pip install 'colibri-moe[torch]'"), r.stderr
    assert not (work / "out.clb").exists()


@pytest.mark.parametrize("code", ["import colibri.nn", "import colibri; colibri.export(None, 'm.clb')"])
def test_python_front_ends_name_the_extra(work: Path, code: str) -> None:
    launch = LAUNCH.replace('sys.argv = ["colibri", *sys.argv[1:]]\nfrom colibri.cli import main\nmain()', code)
    r = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, cwd=work, timeout=120)
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == ("colibri.model.errors.MissingExtraError: reading a PyTorch module "
                                         "(colibri.export, colibri.nn, colibri export) needs torch, which is not "
                                         "installed: pip install 'colibri-moe[torch]'"), r.stderr
