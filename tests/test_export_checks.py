"""The exporter writes only images the engine accepts and that compute what PyTorch computes.

Refusals (residual width, nesting depth, f16 range of q8 compensation, NaN/Inf
weights) name the module and write nothing; the example_input check fails
with the figure and the tolerance; both through colibri.export and through
`colibri export` (one line on stderr, exit status 1).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import colibri
from colibri.frontends import exporter
from colibri.model import format
from colibri import reference
from colibri import nn as cnn
from colibri.model.errors import ExportCheckError, ExportError
from colibri.model.ir import Q8Weight, dense

COLIBRI = str(Path(sys.executable).parent / "colibri")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run([COLIBRI, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert re.search(pattern, lines[0]), lines[0]


def nested(depth: int, width: int = 4) -> nn.Module:
    m: nn.Module = nn.Linear(width, width)
    for _ in range(depth):
        m = cnn.Residual(m)
    return m


def width_changing_residual() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), cnn.Residual(nn.ReLU(), nn.Linear(8, 4)))


def q8_overflow() -> nn.Module:
    """A row whose compensation value cannot be f16: scale 3e7/127 and a weight 52.4 steps of it."""
    lin = nn.Linear(64, 4)
    with torch.no_grad():
        step = 3e7 / 127
        lin.weight[1, 0] = 3e7
        lin.weight[1, 1] = 52.4 * step  # residual 0.4 step ≈ 94,000 > 65,504
    return lin


def nan_weight() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    with torch.no_grad():
        m[2].weight[1, 5] = float("nan")
    return m


def inf_norm() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 8), cnn.Residual(nn.LayerNorm(8), nn.Linear(8, 8)))
    with torch.no_grad():
        m[1].body[0].bias[2] = float("-inf")
    return m


def zero_eps() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.LayerNorm(6, eps=0.0))


REFUSALS = {  # model, export options, ExportError pattern (module path and reason)
    "residual width": (width_changing_residual, {}, r"model\.1 \(Residual\): the body maps 8 features to 4"),
    "nesting": (lambda: nested(format.MAX_RESIDUAL_DEPTH + 1), {},
                r"model(\.body){16} \(Residual\): residuals nest 17 deep, the engine allows at most 16"),
    "q8 compensation": (q8_overflow, {"dtype": "q8"},
                        r"model \(layers\.0\): .*compensation value 9\.\d+e\+04 exceeds the f16 range \(65504\); "
                        r"keep it in f32 with keep=\['layers\.0'\] \(--keep layers\.0\)"),
    "nan weight": (nan_weight, {}, r"model\.2 \(layers\.2\): 1 of 24 values of weight are NaN"),
    "inf norm": (inf_norm, {}, r"model\.1\.body\.0 \(layers\.2\): 1 of 8 values of bias are Inf"),
    "zero eps": (zero_eps, {}, r"model\.2 \(layers\.2\) \(LayerNorm\): eps=0, the engine needs eps > 0"),
    "shared experts": (lambda: nn.Sequential(nn.Linear(3, 8), cnn.MoE(8, 2, 4, top_k=1, num_shared=17)), {},
                       r"model\.1 \(layers\.1\): 17 shared experts, the engine allows at most 16"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusal_names_module_and_writes_nothing(case: str, tmp_path: Path) -> None:
    build, options, pattern = REFUSALS[case]
    out = tmp_path / "m.clb"
    with pytest.raises(ExportError, match=pattern):
        exporter.export(build(), out, max_batch=2, **options)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", REFUSALS)
def test_refusal_through_cli(case: str, tmp_path: Path) -> None:
    build, options, pattern = REFUSALS[case]
    torch.save(build(), tmp_path / "m.pt")
    extra = ["--dtype", options["dtype"]] if "dtype" in options else []
    r = cli("export", "m.pt", "m.clb", *extra, cwd=tmp_path)
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "m.clb").exists()


def test_failed_export_leaves_existing_file_alone(tmp_path: Path) -> None:
    out = tmp_path / "m.clb"
    out.write_bytes(b"previous image")
    with pytest.raises(ExportError):
        exporter.export(nan_weight(), out)
    assert out.read_bytes() == b"previous image" and len(list(tmp_path.iterdir())) == 1


def test_deepest_nesting_the_engine_allows_exports() -> None:
    x = torch.randn(3, 4)
    result = exporter.export(nested(format.MAX_RESIDUAL_DEPTH), None, max_batch=3, example_input=x)
    assert colibri.Model(result.image).forward(x.numpy()).shape == (3, 4)


def test_q8_refusal_names_the_way_out() -> None:
    """The refusal suggests keeping the weight in f32; doing so exports an image equal to PyTorch's answer."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    model = q8_overflow()
    result = exporter.export(model, None, max_batch=3, dtype="q8", keep=["layers.0"], example_input=x)
    assert isinstance(result.graph.layers[0].weight, np.ndarray)
    with torch.no_grad():
        assert result.max_abs_error <= 1e-5 * (1 + float(model(x).abs().max()))


def test_q8_outlier_beyond_f16_stays_in_its_row_scale() -> None:
    """An outlier of 1e6 set aside into E would be stored as Inf; its row keeps it in the scale instead."""
    lin = nn.Linear(64, 8)
    with torch.no_grad():
        lin.weight[3, 7] = 1e6
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    result = exporter.export(lin, None, max_batch=5, dtype="q8", example_input=x)
    w = result.graph.layers[0].weight
    assert isinstance(w, Q8Weight) and w.nnz > 0 and np.isfinite(w.val.astype(np.float32)).all()
    got, want = dense(w), lin.weight.detach().numpy()
    assert got[3, 7] == pytest.approx(1e6, rel=1e-6)
    assert np.abs(got[3] - want[3]).max() <= 0.5 * 1e6 / 127  # row 3's step is 1e6/127
    np.testing.assert_allclose(colibri.Model(result.image).forward(x.numpy()), reference.run(colibri.image.read(result.image), x.numpy()),
                               rtol=0, atol=1e-5 * (1 + 1e6 * 4))


def test_standalone_hf_block_with_nan_is_refused_with_path() -> None:
    import hfblocks

    block = hfblocks.mixtral(8, 6, 4, 2, "silu", seed=1)
    with torch.no_grad():
        block.experts.gate_up_proj[2, 1, 3] = float("nan")  # expert 2, w1 row 1
    with pytest.raises(ExportError, match=r"model\.1 \(layers\.1\): 1 of 48 values of experts\.2\.w1 are NaN"):
        exporter.export(nn.Sequential(nn.Linear(5, 8), block), None, max_batch=2)


# --- the example_input check ---------------------------------------------------------------------


class Doubled(nn.Linear):
    """A Linear subclass whose forward the exporter cannot see: exported as a plain Linear, it is wrong by 2x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class NanAtFirst(nn.Linear):
    """Gives NaN for the first output of the first row: the image gives a number there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        y[0, 0] = float("nan")
        return y


def test_check_fails_with_figure_and_tolerance(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), Doubled(8, 3))
    x = torch.randn(4, 6)
    want = model(x).detach().numpy()
    out = tmp_path / "m.clb"
    with pytest.raises(ExportCheckError) as info:
        exporter.export(model, out, max_batch=4, example_input=x)
    exc = info.value
    assert exc.comparison == "numpy reference vs PyTorch (f32)"
    assert exc.tolerance == pytest.approx(1e-5 * (1 + np.abs(want).max()))
    assert exc.error == pytest.approx(np.abs(want / 2 - want).max(), rel=1e-5)
    assert f"{exc.error:.3g} > tolerance {exc.tolerance:.3g}" in str(exc)
    assert not out.exists()


def test_check_fails_on_nan_where_pytorch_has_a_number_and_vice_versa() -> None:
    x = torch.randn(3, 5)
    with pytest.raises(ExportCheckError, match="1 outputs NaN/Inf on one side only") as info:
        exporter.export(nn.Sequential(NanAtFirst(5, 4)), None, max_batch=3, example_input=x)
    assert info.value.nonfinite_mismatches == 1
    want = np.array([[1.0, np.nan, np.inf, -np.inf]], dtype=np.float32)
    assert exporter.compare("", want.copy(), want).ok
    for got in ([1.0, 0.0, np.inf, -np.inf], [1.0, np.nan, np.nan, -np.inf], [1.0, np.nan, -np.inf, -np.inf],
                [np.nan, np.nan, np.inf, -np.inf]):
        c = exporter.compare("", np.array([got], dtype=np.float32), want)
        assert not c.ok and c.nonfinite_mismatches == 1


def test_check_can_be_turned_off(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 8), Doubled(8, 3))
    result = exporter.export(model, tmp_path / "m.clb", max_batch=4, example_input=torch.randn(4, 6), check=False)
    assert result.checks == [] and result.max_abs_error > 0.01
    assert (tmp_path / "m.clb").read_bytes() == result.image


def test_check_runs_the_c_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own output is compared, not only the reference's (an engine off by 1e-3 fails)."""
    real = exporter._engine_output
    monkeypatch.setattr(exporter, "_engine_output", lambda data, x: real(data, x) + np.float32(1e-3))
    for dtype in ("f32", "f16", "q8"):
        with pytest.raises(ExportCheckError, match=r"C engine vs (PyTorch|numpy reference)"):
            exporter.export(nn.Linear(6, 3), None, max_batch=2, example_input=torch.randn(2, 6), dtype=dtype)


def check_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 16), cnn.Residual(nn.LayerNorm(16), cnn.MoE(16, 24, 4, top_k=2)),
                         nn.Linear(16, 5))


@pytest.mark.parametrize("dtype,keep", [("f32", ()), ("f16", ()), ("f16", ("layers.0",)), ("q8", ())])
def test_check_passes_per_dtype(dtype: str, keep: tuple[str, ...]) -> None:
    """f16 is held to PyTorch with f16-rounded weights, q8 to the reference; the f32 error is reported only."""
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(4))
    model = check_model()
    result = exporter.export(model, None, max_batch=8, example_input=x, dtype=dtype, keep=keep)
    assert result.checks and all(c.ok for c in result.checks)
    with torch.no_grad():
        tol = 1e-5 * (1 + float(model(x).abs().max()))
    whats = [c.what for c in result.checks]
    if dtype == "f32":
        assert whats == ["numpy reference vs PyTorch (f32)", "C engine vs PyTorch (f32)"]
        assert result.max_abs_error <= tol
    else:
        assert result.max_abs_error > tol  # rounding error, beyond the f32 tolerance: reported, not failed
    if dtype == "f16":
        assert "C engine vs PyTorch (weights rounded to f16)" in whats
        # the MoE's router stays f32 (the default), so the image always keeps some f32 weights
        assert "C engine vs numpy reference (f16 image with f32 weights kept)" in whats
    if dtype == "q8":
        assert whats == ["C engine vs numpy reference (q8 image)"]


def test_check_through_cli(tmp_path: Path) -> None:
    (tmp_path / "doubled.py").write_text(
        "from torch import nn\n"
        "class Doubled(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return 2 * super().forward(x)\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), Doubled(8, 3))\n"
    )
    r = cli("export", "doubled:build", "m.clb", "--input-size", "6", "--max-batch", "4", cwd=tmp_path)
    assert_one_line_error(r, r"export check failed, numpy reference vs PyTorch \(f32\): max \|Δ\| \S+ > "
                             r"tolerance \S+; nothing written")
    assert not (tmp_path / "m.clb").exists()
    r = cli("export", "doubled:build", "m.clb", "--input-size", "6", "--max-batch", "4", "--no-check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert colibri.Model(tmp_path / "m.clb").input_size == 6
