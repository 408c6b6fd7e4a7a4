"""The quantisation report agrees with the C engine and the reference, for every dtype."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.exporter import build_graph
from colibri.quantize import quantize
from colibri.report import quantisation_report, rel_l2

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
    ref = reference.run(data, x)
    tol = 1e-5 * (1 + np.abs(ref).max())
    assert np.abs(rep.outputs_quantised - engine).max() <= tol
    assert np.abs(rep.outputs_quantised - ref).max() <= tol
    np.testing.assert_array_equal(rep.outputs_f32, reference.run(graph, x))
    assert rep.end_to_end_rel_l2 == pytest.approx(rel_l2(engine, rep.outputs_f32), rel=1e-3, abs=1e-7)
    assert rep.layers[-1].rel_l2 == pytest.approx(rep.end_to_end_rel_l2)
    assert len(rep.layers) == len(graph.layers) and rep.tokens == 300
    assert set(rep.routing_agreement) == {i for i, layer in enumerate(graph.layers) if isinstance(layer, colibri.ir.MoE)}
    assert all(0.9 <= share <= 1 for share in rep.routing_agreement.values())
    assert any(line.startswith("end to end over 300 tokens") for line in rep.lines())
    rep.plot(tmp_path / "err.png")
    assert (tmp_path / "err.png").read_bytes()[:4] == b"\x89PNG"


def test_routing_agreement_counts_changed_expert_sets() -> None:
    """Negating the router reverses every token's ranking of the experts: the sets change."""
    model, d_in, max_batch = random_model(3)
    graph, _ = build_graph(model, max_batch=max_batch)
    moe_index, moe = next((i, layer) for i, layer in enumerate(graph.layers) if isinstance(layer, colibri.ir.MoE))
    broken = quantize(graph, "f32")
    broken.layers[moe_index].router_weight = -np.asarray(moe.router_weight)
    x = np.random.default_rng(6).standard_normal((200, d_in)).astype(np.float32)
    rep = quantisation_report(graph, broken, x)
    assert moe.top_k < len(moe.experts), "the model must route sparsely for this test"
    assert rep.routing_agreement[moe_index] < 0.9
