"""`colibri info` counts a model's parameters the same whatever its dtype: a bias q8 or q4 keeps in
its weight's companion is a parameter as an f32 bias tensor is (issue 26)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import colibri
from colibri import image
from colibri import nn as cnn
from colibri.cli import main
from colibri.cli.info import describe
from colibri.frontends.exporter import build_graph
from colibri.model.ir import Q4Weight, Q8Weight
from colibri.model.walks import weight_slots
from colibri.quant.quantize import quantize
from helpers import lmmodels

DTYPES = {"f32": {}, "f16": {}, "q8": {}, "q4": {"group": 8}}


def _feature_graph():
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
        cnn.Residual(cnn.MoE(16, 4, 8, top_k=2, routing="softmax_topk", gated=True, num_shared=1,
                             shared_gate=True, router_bias=True)),
        torch.nn.Linear(16, 3),
    )
    return build_graph(model.eval(), max_batch=2)[0]


def _f32_parameters(graph) -> int:
    """Every element of every tensor of the f32 graph but the expert maps (integers, not parameters);
    a tied head's table once."""
    arrays = {id(getattr(o, a)): getattr(o, a) for _, o, a in weight_slots(graph)}
    for layer in graph.layers:
        for name in ("bias", "weight", "router_bias", "q_b", "k_b", "v_b", "o_b", "q_norm", "k_norm"):
            v = getattr(layer, name, None)
            if isinstance(v, np.ndarray):
                arrays[id(v)] = v
        for e in list(getattr(layer, "experts", [])) + list(getattr(layer, "shared", [])):
            for b in (e.b1, e.b2, e.b3):
                if b is not None:
                    arrays[id(b)] = b
    return sum(int(np.prod(a.shape)) for a in arrays.values())


@pytest.mark.parametrize("kind", ["feature", "token"])
def test_parameters_are_the_same_whatever_the_dtype(kind: str) -> None:
    graph = _feature_graph() if kind == "feature" else lmmodels.token_model(4, bias=True, qk_norm="all")
    counts = {}
    moved = 0
    for dtype, opts in DTYPES.items():
        g = graph if dtype == "f32" else quantize(graph, dtype, **opts)
        moved += sum(isinstance(getattr(o, a), (Q8Weight, Q4Weight)) and getattr(o, a).bias is not None
                     for _, o, a in weight_slots(g))
        data = image.write(g)
        engine = colibri.Model(data) if kind == "feature" else colibri.LM(data)
        counts[dtype] = (describe(data)["parameters"], engine.info["num_parameters"])
    assert moved > 0  # biases did move into the companions: the case this test is about
    want = _f32_parameters(graph)
    assert counts == {dtype: (want, want) for dtype in DTYPES}


def test_cli_info_prints_the_count(tmp_path) -> None:
    graph = _feature_graph()
    paths = []
    for dtype, opts in DTYPES.items():
        path = tmp_path / f"{dtype}.clb"
        path.write_bytes(image.write(graph if dtype == "f32" else quantize(graph, dtype, **opts)))
        paths.append(path)
    runner = CliRunner()
    counts = set()
    for path in paths:
        r = runner.invoke(main, ["info", str(path), "--json"])
        assert r.exit_code == 0, r.output
        counts.add(json.loads(r.output)["parameters"])
    assert counts == {_f32_parameters(graph)}
