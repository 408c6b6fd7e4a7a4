"""The `colibri` command from a fresh shell: export, info, run, and one-line errors."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri

from helpers.cli import cli as run_cli

ROOT = Path(__file__).resolve().parents[2]
# `quickstart:build_model` and the other examples resolve from examples/.
cli = functools.partial(run_cli, pythonpath=ROOT / "examples")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    r = cli("export", "quickstart:build_model", "model.clb", "--max-batch", "4", cwd=d)
    assert r.returncode == 0, r.stderr
    assert "wrote model.clb" in r.stdout
    return d / "model.clb"


def test_export_from_saved_module(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from quickstart import build_model

    torch.save(build_model(), tmp_path / "m.pt")
    r = cli("export", "m.pt", "m.clb", "--max-batch", "2", "--prune", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "pruned: MoE 0: dropped experts [1]" in r.stdout
    assert colibri.Model(tmp_path / "m.clb").num_experts == 3


def test_info(exported: Path) -> None:
    r = cli("info", exported.name, cwd=exported.parent)
    assert r.returncode == 0, r.stderr
    for text in ("MoE", "topk_softmax k=2", "4/4 experts", "glu silu hidden 64", "arena", "image"):
        assert text in r.stdout
    d = json.loads(cli("info", exported.name, "--json", cwd=exported.parent).stdout)
    m = colibri.Model(exported)
    assert d["arena_bytes"] == m.arena_size and d["image_bytes"] == m.image_size
    assert d["parameters"] == m.num_parameters
    assert d["routed_experts"] == 4 and d["shared_experts"] == 1


def test_run_npy_and_csv(exported: Path) -> None:
    d = exported.parent
    x = np.random.default_rng(0).standard_normal((5, 48)).astype(np.float32)
    np.save(d / "x.npy", x)
    np.savetxt(d / "x.csv", x, delimiter=",")
    r = cli("run", exported.name, "-i", "x.npy", "-o", "y.npy", cwd=d)
    assert r.returncode == 0, r.stderr
    want = colibri.reference.run(colibri.image.read(exported.read_bytes()), x)
    np.testing.assert_allclose(np.load(d / "y.npy"), want, rtol=1e-5, atol=1e-5)
    r = cli("run", exported.name, "-i", "x.csv", cwd=d)
    assert r.returncode == 0, r.stderr
    printed = np.loadtxt(r.stdout.splitlines(), delimiter=",", ndmin=2)
    np.testing.assert_allclose(printed, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: b[:100], "truncated"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:200] + bytes([b[200] ^ 0xFF]) + b[201:], "CRC-32 mismatch"),
    ],
)
def test_corrupted_file_is_one_line_error(exported: Path, corrupt, message: str) -> None:
    bad = exported.parent / "bad.clb"
    bad.write_bytes(corrupt(exported.read_bytes()))
    for cmd in (["info", "bad.clb"], ["run", "bad.clb", "-i", "x.npy"]):
        if cmd[0] == "run":
            np.save(exported.parent / "x.npy", np.zeros((1, 48), np.float32))
        r = cli(*cmd, cwd=exported.parent)
        assert r.returncode != 0
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert message in r.stderr and "Traceback" not in r.stderr


def test_unsupported_module_is_named(tmp_path: Path) -> None:
    torch.save(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv1d(1, 1, 3)), tmp_path / "bad.pt")
    r = cli("export", "bad.pt", "out.clb", cwd=tmp_path)
    assert r.returncode == 1
    assert "model.1 (torch.nn.modules.conv.Conv1d) is not supported" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.clb").exists()


def test_bad_input_shape_is_one_line(exported: Path) -> None:
    np.save(exported.parent / "wrong.npy", np.zeros((2, 7), np.float32))
    r = cli("run", exported.name, "-i", "wrong.npy", cwd=exported.parent)
    assert r.returncode == 1 and "input must be [batch, 48]" in r.stderr


def test_quantize_with_report_and_plot(exported: Path) -> None:
    d = exported.parent
    np.save(d / "calib.npy", np.random.default_rng(2).standard_normal((300, 48)).astype(np.float32))
    r = cli("quantize", exported.name, "q8.clb", "--dtype", "q8", "--calibration", "calib.npy", "--report",
            "--plot", "err.png", "--keep", "*.router", cwd=d)
    assert r.returncode == 0, r.stderr
    assert "routing agreement, MoE at layer 3" in r.stdout and "end to end over 300 tokens" in r.stdout
    png = (d / "err.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    q8 = colibri.image.read((d / "q8.clb").read_bytes())
    moe = q8.moe_layers()[0]
    assert isinstance(moe.router_weight, np.ndarray)  # kept f32
    assert isinstance(moe.experts[0].w1, colibri.model.ir.Q8Weight)
    assert (d / "q8.clb").stat().st_size < exported.stat().st_size / 2
    info = cli("info", "q8.clb", cwd=d)
    assert info.returncode == 0, info.stderr
    assert "q8+E" in info.stdout
    again = cli("quantize", "q8.clb", "again.clb", "--dtype", "f16", cwd=d)
    assert again.returncode == 1 and "already quantised" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def test_export_f16(tmp_path: Path) -> None:
    r = cli("export", "quickstart:build_model", "f16.clb", "--dtype", "f16", "--input-size", "48", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "numpy reference vs PyTorch" in r.stdout
    m = colibri.image.read((tmp_path / "f16.clb").read_bytes())
    assert isinstance(m.layers[0].weight, colibri.model.ir.F16Weight)


def test_quantize_with_int8_blocks(exported: Path) -> None:
    """--int8-blocks sets INT8_BLOCKS on the matching layers and experts; info shows it; with --int8-act
    on the same layer it is refused by name and nothing is written."""
    d = exported.parent
    r = cli("quantize", exported.name, "q4b.clb", "--dtype", "q4", "--int8-blocks", "layers.*", cwd=d)
    assert r.returncode == 0, r.stderr
    back = colibri.image.read((d / "q4b.clb").read_bytes())
    assert any(getattr(layer, "int8_blocks", False) for layer in back.layers)
    info = cli("info", "q4b.clb", cwd=d)
    assert info.returncode == 0 and "int8-blocks" in info.stdout, info.stdout
    both = cli("quantize", exported.name, "both.clb", "--dtype", "q8", "--int8-blocks", "layers.*", "--int8-act",
               "layers.*", cwd=d)
    assert both.returncode != 0 and "choose one activation form" in both.stderr, both.stderr
    assert not (d / "both.clb").exists()
