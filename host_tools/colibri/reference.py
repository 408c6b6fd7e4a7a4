"""The numpy reference executor: the executable specification of a model image.

`run(image_or_graph, x)` computes what the C engine must compute, in float32,
following docs/model-format.md step by step. It is written for clarity, not
speed.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from . import image as image_mod
from .format import Act, ExpertKind, Routing
from .ir import (
    Activation, Expert, Graph, LayerNorm, Linear, MoE, Q8Weight, ResidualAdd, ResidualPush, RMSNorm, Weight, dense,
)

f32 = np.float32


def activation(act: Act, x: np.ndarray) -> np.ndarray:
    x = x.astype(f32, copy=False)
    if act == Act.RELU:
        return np.maximum(x, f32(0))
    if act == Act.GELU_ERF:
        erf = _erf(x / f32(np.sqrt(2.0)))
        return (f32(0.5) * x * (f32(1) + erf)).astype(f32)
    if act == Act.GELU_TANH:
        c = f32(np.sqrt(2.0 / np.pi))
        return (f32(0.5) * x * (f32(1) + np.tanh(c * (x + f32(0.044715) * x * x * x)))).astype(f32)
    if act == Act.SILU:
        return (x * _sigmoid(x)).astype(f32)
    if act == Act.TANH:
        return np.tanh(x).astype(f32)
    if act == Act.SIGMOID:
        return _sigmoid(x)
    raise ValueError(f"unknown activation {act}")


_erf_scalar = np.frompyfunc(math.erf, 1, 1)


def _erf(x: np.ndarray) -> np.ndarray:
    return _erf_scalar(x.astype(np.float64)).astype(f32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (f32(1) / (f32(1) + np.exp(-x.astype(f32)))).astype(f32)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(f32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + f32(0.5))


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token int8 activations as the engine makes them: (xq int32 [n, d], a f32 [n])."""
    m = np.abs(x).max(axis=1).astype(f32)
    safe = np.where(m > 0, m, f32(1))
    inv = (f32(127) / safe).astype(f32)
    xq = np.clip(_round_half_away((x * inv[:, None]).astype(f32)), -127, 127).astype(np.int64)
    xq[m == 0] = 0
    a = np.where(m > 0, (m / f32(127)).astype(f32), f32(0)).astype(f32)
    return xq, a


def _linear(x: np.ndarray, w: Weight, b: np.ndarray | None, int8_act: bool = False) -> np.ndarray:
    """y = x Wᵀ + b for every weight storage, by the formulas of docs/model-format.md."""
    if isinstance(w, Q8Weight):
        if int8_act:
            xq, a = quantize_rows(x)
            acc = (xq @ w.q.astype(np.int64).T).astype(f32)
            y = acc * (w.scale[None, :] * a[:, None]).astype(f32)
        else:
            y = (x @ w.q.astype(f32).T) * w.scale[None, :]
        if w.nnz:
            y = y + x @ w.compensation().T
    else:
        y = x @ dense(w).T
    return (y + b if b is not None else y).astype(f32)


def expert_forward(e: Expert, x: np.ndarray) -> np.ndarray:
    h = activation(e.act, _linear(x, e.w1, e.b1, e.int8_act))
    if e.kind == ExpertKind.GLU:
        h = h * _linear(x, e.w3, e.b3, e.int8_act)
    return _linear(h, e.w2, e.b2, e.int8_act)


def route(moe: MoE, x: np.ndarray) -> list[list[tuple[int, float]]]:
    """Per token, the selected routed-expert slots and their gate weights.

    Pruned router outputs take part in the softmax but can never be selected;
    among equal scores the lower router index wins (a stable sort).
    """
    z = _linear(x, moe.router_weight, moe.router_bias)
    kept = moe.expert_map >= 0
    out = []
    for row in z:
        p = _softmax(row) if moe.routing != Routing.TOPK_SOFTMAX else row
        candidates = np.flatnonzero(kept)
        if moe.routing == Routing.DENSE:
            chosen = candidates
        else:
            k = 1 if moe.routing == Routing.TOP1 else moe.top_k
            order = np.argsort(-p[candidates], kind="stable")
            chosen = candidates[order[:k]]
        if moe.routing == Routing.TOPK_SOFTMAX:
            w = _softmax(row[chosen])
        else:
            w = p[chosen]
            if moe.renormalize:
                w = (w / w.sum()).astype(f32)
        out.append([(int(moe.expert_map[r]), float(wi)) for r, wi in zip(chosen, w)])
    return out


def moe_forward(moe: MoE, x: np.ndarray, on_route: Callable[[MoE, list], None] | None = None) -> np.ndarray:
    y = np.zeros_like(x, dtype=f32)
    selection = route(moe, x)
    if on_route is not None:
        on_route(moe, selection)
    for slot, e in enumerate(moe.experts):
        tokens = [(t, w) for t, sel in enumerate(selection) for s, w in sel if s == slot]
        if tokens:
            idx = np.array([t for t, _ in tokens])
            w = np.array([w for _, w in tokens], dtype=f32)[:, None]
            y[idx] += w * expert_forward(e, x[idx])
    if moe.shared:
        s = sum(expert_forward(e, x) for e in moe.shared)
        if moe.shared_gate is not None:
            s = _sigmoid(_linear(x, moe.shared_gate, None)) * s
        y += s
    return y.astype(f32)


def run(model: Graph | bytes | bytearray | memoryview, x: np.ndarray, *, on_route=None, on_layer=None) -> np.ndarray:
    """Forward `x [batch, input_size]` through an image or a graph.

    `on_route(moe, selection)` sees every MoE layer's routing decisions and
    `on_layer(index, layer, output)` every layer's output, for reports.
    """
    graph = model if isinstance(model, Graph) else image_mod.read(model)
    x = np.asarray(x, dtype=f32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] != graph.input_size:
        raise ValueError(f"input must be [batch, {graph.input_size}], got {x.shape}")
    stack: list[np.ndarray] = []
    for index, layer in enumerate(graph.layers):
        if isinstance(layer, Linear):
            x = _linear(x, layer.weight, layer.bias, layer.int8_act)
        elif isinstance(layer, Activation):
            x = activation(layer.act, x)
        elif isinstance(layer, LayerNorm):
            mu = x.mean(axis=1, keepdims=True)
            var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
            x = ((x - mu) / np.sqrt(var + f32(layer.eps))).astype(f32)
            if layer.weight is not None:
                x = x * layer.weight
            if layer.bias is not None:
                x = x + layer.bias
        elif isinstance(layer, RMSNorm):
            x = (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + f32(layer.eps))).astype(f32)
            if layer.weight is not None:
                x = x * layer.weight
        elif isinstance(layer, ResidualPush):
            stack.append(x.copy())
        elif isinstance(layer, ResidualAdd):
            x = x + stack.pop()
        elif isinstance(layer, MoE):
            x = moe_forward(layer, x, on_route)
        x = x.astype(f32, copy=False)
        if on_layer is not None:
            on_layer(index, layer, x)
    return x
