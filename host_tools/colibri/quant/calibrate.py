"""Activation statistics of a layer graph over calibration inputs, for quantisation.

`input_moments` gives, per weight matrix (colibri.quant.quantize's names), the mean square of each of its
input features over the calibration tokens that reach it. A weight's rounding error moves an output
by error · x_c, so Σ_c E[x_c²] (w − q·s)² is the expected squared output error of its row: what
quantize_q8(importance=...) minimises and ranks its compensation E by.
"""
from __future__ import annotations

import numpy as np

from ..reference import executor as reference
from ..model.errors import ExportError
from ..model.format import ExpertKind
from ..model.ir import Attention, Embedding, Graph, Linear, MoE


def _mean_square(x: np.ndarray) -> np.ndarray:
    return np.mean(np.square(x.astype(np.float64)), axis=0).astype(np.float32)


def input_moments(graph: Graph, calibration: np.ndarray) -> dict[str, np.ndarray]:
    """name -> [cols] mean square of that matrix's input features, from the f32 graph's forward pass.

    Covered: Linear weights, routers, shared gates and expert w1/w3 (they read the layer's input),
    and expert w2 (its hidden activations, over the tokens the f32 router sends to that expert; an
    expert no token reaches is left out). Left out, so quantised unweighted: attention projections
    and embedding tables (token models take token ids, not feature rows)."""
    if graph.is_token_model:
        raise ExportError("calibration statistics need a feature-input model; a token model takes token ids")
    x = np.asarray(calibration, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != graph.input_size or len(x) == 0:
        raise ExportError(f"calibration inputs must be [n >= 1, {graph.input_size}], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ExportError("calibration inputs hold NaN or inf")
    outputs: list[np.ndarray] = []
    routes: list[list] = []
    reference.run(graph, x, on_layer=lambda i, layer, out: outputs.append(out),
                  on_route=lambda moe, sel: routes.append(sel))
    inputs = [x] + outputs[:-1]
    moments: dict[str, np.ndarray] = {}
    route_of = iter(routes)
    for i, layer in enumerate(graph.layers):
        h = inputs[i]
        if isinstance(layer, Linear):
            moments[f"layers.{i}"] = _mean_square(h)
        elif isinstance(layer, MoE):
            m = _mean_square(h)
            moments[f"layers.{i}.router"] = m
            if layer.shared_gate is not None:
                moments[f"layers.{i}.shared_gate"] = m
            selection = next(route_of)
            for group, experts in (("experts", layer.experts), ("shared", layer.shared)):
                for j, e in enumerate(experts):
                    moments[f"layers.{i}.{group}.{j}.w1"] = m
                    if e.w3 is not None:
                        moments[f"layers.{i}.{group}.{j}.w3"] = m
                    rows = (np.arange(len(h)) if group == "shared" else
                            np.array([t for t, sel in enumerate(selection) if any(s == j and wt != 0 for s, wt in sel)],
                                     dtype=np.int64))
                    if rows.size:
                        hidden = reference.activation(e.act, reference.linear(h[rows], e.w1, e.b1, False))
                        if e.kind == ExpertKind.GLU:
                            hidden = hidden * reference.linear(h[rows], e.w3, e.b3, False)
                        moments[f"layers.{i}.{group}.{j}.w2"] = _mean_square(hidden)
        elif isinstance(layer, (Attention, Embedding)):
            continue
    return moments
