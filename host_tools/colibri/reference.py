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
    """C's roundf, exactly: the integer part plus one away from zero when the fraction is at least 1/2.

    (floor(|v| + 0.5) is not it: |v| + 0.5 rounds up for v just below one half.)
    """
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= f32(0.5), np.sign(v), f32(0)).astype(v.dtype)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token int8 activations as the engine makes them: (xq int64 [n, d], a f32 [n]).

    A row holding NaN or ±inf has no int8 form: xq = 0 and a = NaN, so every
    output computed from it is NaN. 127 / m would overflow for m < 2^-121, so
    such rows are scaled by 2^100 first (exactly, as the engine does).
    """
    with np.errstate(all="ignore"):
        return _quantize_rows(np.asarray(x, dtype=f32))


def _quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = np.abs(x).max(axis=1).astype(f32)  # NaN if the row has a NaN, inf if an inf
    usable = np.isfinite(m) & (m > 0)
    s = np.where(m < f32(2.0 ** -100), f32(2.0 ** 100), f32(1)).astype(f32)
    safe = np.where(usable, m, f32(1)).astype(f32)
    inv = (f32(127) / (safe * s)).astype(f32)
    v = ((x * s[:, None]).astype(f32) * inv[:, None]).astype(f32)
    v = np.where(usable[:, None], v, f32(0))
    xq = np.clip(_round_half_away(v), -127, 127).astype(np.int64)
    a = np.where(usable, (m / f32(127)).astype(f32), np.where(m == 0, f32(0), f32(np.nan))).astype(f32)
    return xq, a


# Sums whose terms could reach f32's range are added in index order, as the engine adds them: there,
# where an intermediate overflows (inf, or inf - inf = NaN) depends on the order. Elsewhere the order
# only moves the last bits, and a matrix product is much faster.
_RISKY = 2.0 ** 120


def _in_order(x: np.ndarray, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Σ_k x[i, k] · w[:, k] for i in rows, in f32, k ascending (the engine's matvec loop)."""
    acc = np.zeros((len(rows), w.shape[0]), dtype=f32)
    for k in range(w.shape[1]):
        acc = (acc + (x[rows, k, None] * w[None, :, k]).astype(f32)).astype(f32)
    return acc


def _risky_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Rows of x holding a non-finite value or whose products with w could sum beyond f32
    (max|x| · the largest row sum of |w| bounds every partial sum)."""
    xmax = np.abs(x).max(axis=1, initial=0).astype(np.float64)  # NaN and inf stay NaN and inf
    bound = float(np.abs(w).sum(axis=1, dtype=np.float64).max(initial=0))
    return np.flatnonzero(~(xmax * bound < _RISKY))


def _may_overflow(x: np.ndarray, w: np.ndarray) -> bool:
    """A quick test for the whole batch (False when NaN or inf is in x): only then are rows sorted out."""
    return not float(np.abs(x).max(initial=0)) * float(np.abs(w).max(initial=0)) * w.shape[1] < _RISKY


def _matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    y = (x @ w.T).astype(f32)
    if _may_overflow(x, w):
        risky = _risky_rows(x, w)
        y[risky] = _in_order(x, w, risky)
    return y


def _add_compensation(y: np.ndarray, x: np.ndarray, w: Q8Weight) -> np.ndarray:
    """y + x Eᵀ; rows at risk add each stored entry in storage order, as the engine does, so a zero
    of E never meets an inf of x."""
    e = w.compensation()
    out = (y + x @ e.T).astype(f32)
    risky = _risky_rows(x, e) if _may_overflow(x, e) else []
    if len(risky):
        rows = np.repeat(np.arange(w.q.shape[0]), np.diff(w.row_ptr.astype(np.int64)))
        for i in risky:
            v = y[i].copy()
            for r, c, val in zip(rows, w.col.astype(np.int64), w.val.astype(f32)):
                v[r] = f32(v[r] + f32(val * x[i, c]))
            out[i] = v
    return out


def _linear(x: np.ndarray, w: Weight, b: np.ndarray | None, int8_act: bool = False) -> np.ndarray:
    """y = x Wᵀ + b for every weight storage, by the formulas of docs/model-format.md."""
    x = np.asarray(x, dtype=f32)
    if isinstance(w, Q8Weight):
        scale = w.scale.astype(f32)  # f16 scales widen exactly
        if int8_act:
            xq, a = quantize_rows(x)
            acc = (xq @ w.q.astype(np.int64).T).astype(f32)
            y = (acc * (scale[None, :] * a[:, None]).astype(f32)).astype(f32)
        else:
            y = (_matmul(x, w.q.astype(f32)) * scale[None, :]).astype(f32)
        if w.nnz:
            y = _add_compensation(y, x, w)
        if w.bias is not None:  # the companion's bias (v2), after E, before the layer's own
            y = (y + w.bias.astype(f32)).astype(f32)
    else:
        y = _matmul(x, dense(w).astype(f32, copy=False))
    return (y + b if b is not None else y).astype(f32)


def expert_forward(e: Expert, x: np.ndarray) -> np.ndarray:
    h = activation(e.act, _linear(x, e.w1, e.b1, e.int8_act))
    if e.kind == ExpertKind.GLU:
        h = h * _linear(x, e.w3, e.b3, e.int8_act)
    return _linear(h, e.w2, e.b2, e.int8_act)


def route(moe: MoE, x: np.ndarray) -> list[list[tuple[int, float]]]:
    """Per token, the selected routed-expert slots and their gate weights.

    Pruned router outputs take part in the softmax but can never be selected;
    NaN ranks above every number (as torch.sort and torch.topk) and among
    equal scores the lower router index wins (a stable sort).
    """
    with np.errstate(all="ignore"):  # non-finite values are results here (see run)
        return _route(moe, x)


def _route(moe: MoE, x: np.ndarray) -> list[list[tuple[int, float]]]:
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
            score = p[candidates]
            nan = np.isnan(score)
            order = np.lexsort((np.where(nan, f32(0), -score), ~nan))  # NaN first, then descending; stable
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
    selection = _route(moe, x)
    if on_route is not None:
        on_route(moe, selection)
    for slot, e in enumerate(moe.experts):
        # A gate weight of exactly 0 adds nothing: the expert does not run for that token (an
        # output it would overflow must not turn 0 · inf into NaN); a NaN weight runs.
        tokens = [(t, w) for t, sel in enumerate(selection) for s, w in sel if s == slot and w != 0]
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
    # NaN and inf follow IEEE 754 through every step (docs/model-format.md "Numerics: non-finite values"):
    # they are results here, not warnings.
    with np.errstate(all="ignore"):
        return _run(graph, x, on_route, on_layer)


def _run(graph: Graph, x: np.ndarray, on_route, on_layer) -> np.ndarray:
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
            # Statistics beyond f32 make the row NaN, not x / inf = 0 (docs/model-format.md).
            den = np.where(var <= np.finfo(f32).max, np.sqrt(var + f32(layer.eps)), f32(np.nan))
            x = ((x - mu) / den).astype(f32)
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
