"""The quantisation report agrees with the C engine and the reference, for every dtype."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.frontends.exporter import build_graph
from colibri.quant.quantize import quantize
from colibri.quant.report import quantisation_report, rel_l2

from randmodels import random_model

SETTINGS = {
    "f16": {"dtype": "f16"},
    "q8": {"dtype": "q8"},
    "q8-no-E": {"dtype": "q8", "compensation": 0.0},
    "q8-int8-act": {"dtype": "q8", "int8_act": ["layers.*"]},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_report_matches_engine_and_reference(setting: str, tmp_path: Path) -> None:
    model, d_in, max_batch = random_model(3)
    graph, _ = build_graph(model, max_batch=max_batch)
    q = quantize(graph, **SETTINGS[setting])
    data = image.write(q)
    x = np.random.default_rng(5).standard_normal((300, d_in)).astype(np.float32)
    rep = quantisation_report(graph, q, x, batch=64)

    engine = colibri.Model(data).forward(x)
    ref = reference.run(image.read(data), x)
    tol = 1e-5 * (1 + np.abs(ref).max())
    assert np.abs(rep.outputs_quantised - engine).max() <= tol
    assert np.abs(rep.outputs_quantised - ref).max() <= tol
    np.testing.assert_array_equal(rep.outputs_f32, reference.run(graph, x))
    assert rep.end_to_end_rel_l2 == pytest.approx(rel_l2(engine, rep.outputs_f32), rel=1e-3, abs=1e-7)
    assert rep.layers[-1].rel_l2 == pytest.approx(rep.end_to_end_rel_l2)
    assert len(rep.layers) == len(graph.layers) and rep.tokens == 300
    assert set(rep.routing_agreement) == {i for i, layer in enumerate(graph.layers) if isinstance(layer, colibri.model.ir.MoE)}
    assert all(0.9 <= share <= 1 for share in rep.routing_agreement.values())
    assert any(line.startswith("end to end over 300 tokens") for line in rep.lines())
    rep.plot(tmp_path / "err.png")
    assert (tmp_path / "err.png").read_bytes()[:4] == b"\x89PNG"


def test_routing_agreement_counts_changed_expert_sets() -> None:
    """Negating the router reverses every token's ranking of the experts: the sets change."""
    model, d_in, max_batch = random_model(3)
    graph, _ = build_graph(model, max_batch=max_batch)
    moe_index, moe = next((i, layer) for i, layer in enumerate(graph.layers) if isinstance(layer, colibri.model.ir.MoE))
    broken = quantize(graph, "f32")
    broken.layers[moe_index].router_weight = -np.asarray(moe.router_weight)
    x = np.random.default_rng(6).standard_normal((200, d_in)).astype(np.float32)
    rep = quantisation_report(graph, broken, x)
    assert moe.top_k < len(moe.experts), "the model must route sparsely for this test"
    assert rep.routing_agreement[moe_index] < 0.9


# --- the plot ------------------------------------------------------------------------------------


def relu_report(n_tokens: int = 256):
    """q8 report of a model with two ReLUs: about half of their outputs are 0 in both models (|Δ| exactly 0)."""
    import torch

    from colibri import nn as cnn

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 32), torch.nn.ReLU(), cnn.Residual(torch.nn.LayerNorm(32), cnn.MoE(32, 4, 48, top_k=2)),
        torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6),
    )
    graph, _ = build_graph(model.eval(), max_batch=16)
    x = np.random.default_rng(7).standard_normal((n_tokens, 24)).astype(np.float32)
    return quantisation_report(graph, quantize(graph, "q8"), x)


def _texts(fig) -> list:
    return [t for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
            if t.get_visible() and t.get_text()]


def test_plot_leaves_exact_zeros_out_of_the_log_axis() -> None:
    rep = relu_report()
    zero_layers = [e for e in rep.layers if np.mean(e.abs_errors == 0) > 0.3]
    assert len(zero_layers) >= 2, "the ReLUs must give exact zeros for this test"
    fig = rep.figure()
    box_axes, zero_axes = fig.axes
    assert box_axes.get_yscale() == "log"
    smallest = min(float(e.abs_errors[e.abs_errors > 0].min()) for e in rep.layers if (e.abs_errors > 0).any())
    drawn = np.concatenate([np.asarray(line.get_ydata(), dtype=float) for line in box_axes.get_lines()])
    assert drawn.size and drawn.min() >= smallest  # nothing at a stand-in value such as 1e-12
    lo, _ = box_axes.get_ylim()
    assert lo >= smallest / 10
    shown = [e for e in rep.layers if e.op != "ResidualPush"]
    heights = [p.get_height() for p in zero_axes.patches]
    np.testing.assert_allclose(heights, [100 * np.mean(e.abs_errors == 0) for e in shown])
    assert max(heights) > 30


def test_plot_title_and_labels_fit_and_do_not_overlap(tmp_path: Path) -> None:
    rep = relu_report()
    fig = rep.figure()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    for text in _texts(fig):
        box = text.get_window_extent(renderer)
        assert box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and \
            box.y1 <= frame.y1 + 1, f"{text.get_text()!r} is cut off: {box} outside {frame}"
    assert "end-to-end relative L2" in fig.get_suptitle()
    ticks = [t.get_window_extent(renderer) for t in fig.axes[-1].get_xticklabels() if t.get_text()]
    assert len(ticks) == len([e for e in rep.layers if e.op != "ResidualPush"])
    for a, b in zip(ticks, ticks[1:]):
        assert not a.overlaps(b), "layer labels overlap"
    assert min(t.get_fontsize() for t in fig.axes[-1].get_xticklabels()) >= 8
    rep.plot(tmp_path / "err.png")
    assert (tmp_path / "err.png").read_bytes()[:4] == b"\x89PNG"


# ---- Where an image's bytes go ------------------------------------------------------------------

def _linear_graph(rows: int, cols: int, *, bias: bool = True):
    """One Linear cols -> rows with fixed weights (one large outlier per row for E)."""
    import torch

    torch.manual_seed(4)
    lin = torch.nn.Linear(cols, rows, bias=bias)
    graph, _ = build_graph(torch.nn.Sequential(lin).eval(), max_batch=1)
    return graph


def test_image_bytes_sum_to_the_image_and_follow_the_layout() -> None:
    """Each part is what docs/model-format.md gives for the companion: v2 with f16 scales and bias,
    1-byte row pointers (nnz <= 255); v1 with f32 scales, 4-byte row pointers, an f32 bias tensor."""
    from colibri.model import format as F
    from colibri.quant.report import BYTE_PARTS, image_bytes

    rows, cols = 40, 64
    graph = _linear_graph(rows, cols)
    nnz = round(0.005 * rows * cols)  # 13: the default compensation share
    v2 = image_bytes(image.write(quantize(graph, "q8")))
    v1 = image_bytes(image.write(quantize(graph, "q8", compact=False), version=1))
    f32 = image_bytes(image.write(graph))
    for b in (v1, v2, f32):
        assert set(b.parts) == set(BYTE_PARTS) and sum(b.parts.values()) == b.total
        assert b.parts["tables"] > 0 and all(v >= 0 for v in b.parts.values())
    assert v2.version == 2 and v1.version == 1
    assert v2.parts["weights"] == v1.parts["weights"] == rows * cols and v2.weight_dtypes == {"i8": rows * cols}
    assert f32.parts["weights"] == 4 * rows * cols and f32.parts["biases"] == 4 * rows
    assert (v2.parts["scales"], v2.parts["biases"], v2.companion_biases) == (2 * rows, 2 * rows, 2 * rows)
    assert (v1.parts["scales"], v1.parts["biases"], v1.companion_biases) == (4 * rows, 4 * rows, 0)
    assert v2.parts["e_row_ptr"] == F.q8_row_ptr_bytes(2, nnz) * (rows + 1) == rows + 1
    assert v1.parts["e_row_ptr"] == 4 * (rows + 1)
    assert v1.parts["e_col"] == v2.parts["e_col"] == 2 * nnz == v1.parts["e_val"] == v2.parts["e_val"]
    assert v2.compensation == rows + 1 + 4 * nnz
    assert v2.total < v1.total
    text = "\n".join(v2.lines())
    assert "compensation E: row pointers" in text and f"{2 * rows} in Q8_PARAMS" in text and "format v2" in text


def test_image_bytes_without_compensation_or_bias() -> None:
    """nnz 0: no row pointers at all; no bias: none in the companion either."""
    from colibri.quant.report import image_bytes

    graph = _linear_graph(8, 16, bias=False)
    b = image_bytes(image.write(quantize(graph, "q8", compensation=0.0)))
    assert b.compensation == 0 and b.parts["biases"] == 0 and b.parts["scales"] == 2 * 8


def test_quantize_report_prints_the_bytes(tmp_path: Path) -> None:
    """`colibri quantize --report` prints the byte breakdown, with or without calibration inputs."""
    import subprocess
    import sys

    from conftest import ROOT

    src = tmp_path / "f32.clb"
    src.write_bytes(image.write(_linear_graph(24, 32)))
    exe = Path(sys.executable).with_name("colibri")
    r = subprocess.run([str(exe), "quantize", str(src), str(tmp_path / "q8.clb"), "--dtype", "q8", "--report"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    for what in ("image bytes (format v2)", "int8 scales", "compensation E: row pointers", "compensation E: columns",
                 "compensation E: values", "biases", "header, records"):
        assert what in r.stdout, (what, r.stdout)
    r = subprocess.run([str(exe), "quantize", str(src), str(tmp_path / "q.clb"), "--dtype", "q8", "--plot", "x.png"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1 and "--plot needs --calibration" in r.stderr
