"""The numpy reference executor: the executable specification of a model image.

`run(image_or_graph, x)` computes what the C engine must compute, in float32,
following docs/model-format.md step by step. It is written for clarity, not
speed.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable

import numpy as np

from ..model.errors import error_for
from ..model.sampler import check_sampler, integer_arg
from ..model.format import Act, DType, ExpertKind, Routing, Status
from ..model.ir import (
    Activation, Attention, Embedding, Expert, F16Weight, Graph, LayerNorm, Linear, MoE, Q4Weight, Q8Weight,
    ResidualAdd,
    ResidualPush, RMSNorm, Weight, dense,
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


ACT_BLOCK = 32  # columns per activation scale of the block form (INT8_BLOCKS)


def quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block form of int8 activations (INT8_BLOCKS): each block of 32 columns of a row (the last
    maybe shorter) quantised as `quantize_rows` quantises a row. Returns (xq int64 [n, d],
    a f32 [n, ceil(d / 32)]). Zero padding of the last block changes neither its maximum nor its values.
    """
    x = np.asarray(x, dtype=f32)
    n, d = x.shape
    nb = -(-d // ACT_BLOCK)
    padded = np.zeros((n, nb * ACT_BLOCK), dtype=f32)
    padded[:, :d] = x
    xq, a = quantize_rows(padded.reshape(n * nb, ACT_BLOCK))
    return xq.reshape(n, nb * ACT_BLOCK)[:, :d], a.reshape(n, nb)


def _block_dots(xq: np.ndarray, q: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Exact integer Σ q·xq over columns [lo, hi) for every row and output, as f32 (|Σ| <= 32 · 128 · 127)."""
    return (xq[:, lo:hi] @ q[:, lo:hi].astype(np.int64).T).astype(f32)


def _linear_blocks(x: np.ndarray, w: Q8Weight | Q4Weight) -> np.ndarray:
    """The integer part of an INT8_BLOCKS linear layer (docs/model-format.md "INT8_BLOCKS"), before E and
    the biases: I8 v = (Σ_b (f32)d_b · a_b) · s; I4 v = Σ_u (f32)d_u · (s_g · a_b) over units of
    min(group, 32) columns. Every f32 operation in the engine's order."""
    xq, a = quantize_blocks(x)
    n, (rows, cols) = x.shape[0], w.shape
    v = np.zeros((n, rows), dtype=f32)
    if isinstance(w, Q4Weight):
        scale = w.scale.astype(f32)
        unit = min(w.group, ACT_BLOCK)
        for lo in range(0, cols, unit):
            sa = (scale[None, :, lo // w.group] * a[:, lo // ACT_BLOCK, None]).astype(f32)
            v = (v + (_block_dots(xq, w.q, lo, min(cols, lo + unit)) * sa).astype(f32)).astype(f32)
        return v
    for b in range(a.shape[1]):
        lo = b * ACT_BLOCK
        v = (v + (_block_dots(xq, w.q, lo, min(cols, lo + ACT_BLOCK)) * a[:, b, None]).astype(f32)).astype(f32)
    return (v * w.scale.astype(f32)[None, :]).astype(f32)


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


def _q4_groups(x: np.ndarray, w: Q4Weight, int8_act: bool) -> np.ndarray:
    """Σ_g p_g · s_g for every row and output, the groups added in order (docs/model-format.md
    "Quantised weights: I4 with Q4_PARAMS"): p_g the group's f32 dot product of q and x, or with int8
    activations its exact integer dot product of q and xq (then times a, per row)."""
    n, (rows, cols) = x.shape[0], w.shape
    scale = w.scale.astype(f32)  # f16 scales widen exactly
    xq, a = quantize_rows(x) if int8_act else (None, None)
    v = np.zeros((n, rows), dtype=f32)
    for g in range(w.groups):
        cs = slice(g * w.group, min(cols, (g + 1) * w.group))
        if int8_act:  # |Σ| <= 256 · 8 · 127 < 2^24: exact in f32, as the engine's int32 to float
            p = (xq[:, cs] @ w.q[:, cs].astype(np.int64).T).astype(f32)
        else:
            p = _matmul(x[:, cs], w.q[:, cs].astype(f32))
        v = (v + (p * scale[None, :, g]).astype(f32)).astype(f32)
    return (v * a[:, None]).astype(f32) if int8_act else v


def _add_compensation(y: np.ndarray, x: np.ndarray, w: Q8Weight | Q4Weight) -> np.ndarray:
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


def linear(x: np.ndarray, w: Weight, b: np.ndarray | None, int8_act: bool = False,
           int8_blocks: bool = False) -> np.ndarray:
    """y = x Wᵀ + b for every weight storage, by the formulas of docs/model-format.md."""
    x = np.asarray(x, dtype=f32)
    if int8_blocks and isinstance(w, (Q8Weight, Q4Weight)):
        with np.errstate(invalid="ignore", over="ignore"):
            y = _linear_blocks(x, w)
            if w.nnz:
                y = _add_compensation(y, x, w)
            if w.bias is not None:  # the companion's bias, after E, before the layer's own
                y = (y + w.bias.astype(f32)).astype(f32)
    elif isinstance(w, Q4Weight):
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf propagate as in the engine
            y = _q4_groups(x, w, int8_act)
        if w.nnz:
            y = _add_compensation(y, x, w)
        if w.bias is not None:  # the companion's f16 bias, after E, before the layer's own
            y = (y + w.bias.astype(f32)).astype(f32)
    elif isinstance(w, Q8Weight):
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
    h = activation(e.act, linear(x, e.w1, e.b1, e.int8_act, e.int8_blocks))
    if e.kind == ExpertKind.GLU:
        h = h * linear(x, e.w3, e.b3, e.int8_act, e.int8_blocks)
    return linear(h, e.w2, e.b2, e.int8_act, e.int8_blocks)


def route(moe: MoE, x: np.ndarray) -> list[list[tuple[int, float]]]:
    """Per token, the selected routed-expert slots and their gate weights.

    Pruned router outputs take part in the softmax but can never be selected;
    NaN ranks above every number (as torch.sort and torch.topk) and among
    equal scores the lower router index wins (a stable sort).
    """
    with np.errstate(all="ignore"):  # non-finite values are results here (see run)
        return _route(moe, x)


def _route(moe: MoE, x: np.ndarray) -> list[list[tuple[int, float]]]:
    z = linear(x, moe.router_weight, moe.router_bias)
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
            s = _sigmoid(linear(x, moe.shared_gate, None)) * s
        y += s
    return y.astype(f32)


def _graph(model: Graph) -> Graph:
    if not isinstance(model, Graph):
        raise TypeError(f"the reference runs a Graph, not {type(model).__name__}: read an image with "
                        "colibri.image.read(data) first")
    return model


def run(model: Graph, x: np.ndarray, *, on_route=None, on_layer=None) -> np.ndarray:
    """Forward `x [batch, input_size]` through a graph (colibri.image.read(data) for an image's).

    `on_route(moe, selection)` sees every MoE layer's routing decisions and
    `on_layer(index, layer, output)` every layer's output, for reports.
    """
    graph = _graph(model)
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
    if graph.is_token_model:
        raise error_for(Status.MODEL_KIND, "a token model takes token ids: use reference.LMState")
    stack: list[np.ndarray] = []
    for index, layer in enumerate(graph.layers):
        x = _apply(layer, x, stack, on_route).astype(f32, copy=False)
        if on_layer is not None:
            on_layer(index, layer, x)
    return x


def _apply(layer, x: np.ndarray, stack: list[np.ndarray], on_route) -> np.ndarray:
    """One layer of the feature program on rows x (residual pushes and adds use `stack`)."""
    if isinstance(layer, Linear):
        return linear(x, layer.weight, layer.bias, layer.int8_act, layer.int8_blocks)
    if isinstance(layer, Activation):
        return activation(layer.act, x)
    if isinstance(layer, LayerNorm):
        mu = x.mean(axis=1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
        # Statistics beyond f32 make the row NaN, not x / inf = 0 (docs/model-format.md).
        den = np.where(var <= np.finfo(f32).max, np.sqrt(var + f32(layer.eps)), f32(np.nan))
        x = ((x - mu) / den).astype(f32)
        if layer.weight is not None:
            x = x * layer.weight
        if layer.bias is not None:
            x = x + layer.bias
        return x
    if isinstance(layer, RMSNorm):
        x = (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + f32(layer.eps))).astype(f32)
        if layer.weight is not None:
            x = x * layer.weight
        return x
    if isinstance(layer, ResidualPush):
        stack.append(x.copy())
        return x
    if isinstance(layer, ResidualAdd):
        return x + stack.pop()
    if isinstance(layer, MoE):
        return moe_forward(layer, x, on_route)
    raise TypeError(f"{type(layer).__name__} is not a feature-model layer")


# ---------------------------------------------------------------------------
# Token models (docs/lm.md)

# The engine's exp (firmware/colibri_core/src/colibri_math.h, the double-precision build): the
# sampler's probabilities must be the same bits in C and here, so this is its operations in the
# same order, each an IEEE double operation as in C with -ffp-contract=off.
_LN2_HI = 0.693145751953125
_LN2_LO = 1.42860682030941723212e-6
_INV_LN2 = 1.44269504088896340736
_EXP_TAYLOR = [1.0 / math.factorial(n) for n in range(1, 12)]  # 1/n!, n = 1..11
_EXPF_MAX_FINITE = f32(88.72283172607421875)
_EXPF_MIN_NONZERO = f32(-103.972076416015625)


def engine_expf(x: np.ndarray) -> np.ndarray:
    """colibri_expf on a float32 array, bit for bit."""
    x = np.asarray(x, dtype=f32)
    xd = x.astype(np.float64)
    t = xd * _INV_LN2
    n = np.trunc(np.where(t < 0, t - 0.5, t + 0.5))
    n = np.where(np.isfinite(n) & (np.abs(xd) < 200), n, 0.0)  # lanes outside the clamps are replaced below
    r = (xd - n * _LN2_HI) - n * _LN2_LO
    p = np.full_like(r, _EXP_TAYLOR[-1])
    for c in reversed(_EXP_TAYLOR[:-1]):
        p = p * r + c
    p = 1.0 + r * p
    with np.errstate(all="ignore"):
        out = (p * np.exp2(n)).astype(f32)  # 2^n exactly: n is a small integer
    out = np.where(x > _EXPF_MAX_FINITE, f32(np.inf), out)
    out = np.where(x < _EXPF_MIN_NONZERO, f32(0), out)
    return np.where(np.isnan(x), x, out).astype(f32)


class Rng:
    """SplitMix64, the sampler's random source (colibri_rng): `Rng(seed)` is colibri_rng_seed."""

    _GAMMA = 0x9E3779B97F4A7C15
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int = 0) -> None:
        self.state = integer_arg("seed", seed) & self._MASK

    def next(self) -> int:
        self.state = (self.state + self._GAMMA) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def uniform(self) -> np.float32:
        """u in [0, 1): the top 24 bits, exact in f32."""
        return f32((self.next() >> 40) * 2.0 ** -24)


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           rng: Rng | None = None) -> int:
    """One token from one row of logits, exactly as colibri_lm_sample (docs/lm.md "Sampling")."""
    check_sampler(temperature, top_k, top_p)
    z = np.asarray(logits, dtype=f32).reshape(-1)
    if z.size == 0:
        raise ValueError("no logits to sample from")
    if f32(temperature) == 0:
        if np.isnan(z).any():
            raise error_for(Status.NAN_LOGITS, "greedy sampling over logits holding NaN")
        return int(np.argmax(z))  # the first of the largest
    if not np.isfinite(z).all():
        raise error_for(Status.NAN_LOGITS, "sampling over logits holding NaN or Inf")
    if rng is None:
        raise ValueError("sampling with temperature > 0 needs an Rng")
    order = np.lexsort((np.arange(z.size), -z))  # logits descending, the lower index first among equals
    if 0 < top_k < z.size:
        order = order[:top_k]
    with np.errstate(over="ignore"):
        d = ((z[order] - z[order[0]]).astype(f32) / f32(temperature)).astype(f32)  # <= 0; -inf at worst
    e = engine_expf(d)
    run = np.cumsum(e, dtype=f32)  # in sorted order, one f32 addition at a time
    kept = run.size
    if f32(top_p) < 1:
        need = f32(f32(top_p) * run[-1])
        kept = int(np.argmax(run >= need)) + 1  # run[-1] >= need always: some index qualifies
    target = f32(rng.uniform() * run[kept - 1])
    above = np.flatnonzero(run[:kept] > target)
    return int(order[above[0] if above.size else kept - 1])


class LMState:
    """A token model and its sequence: the numpy twin of a colibri_ctx running colibri_lm_*.

    `forward_tokens(ids)` runs ids at the next positions and returns their logits, appending their
    keys and values to the cache; `reset()` empties it. Like the engine, it checks a call completely
    before it changes anything."""

    def __init__(self, model: Graph) -> None:
        self.graph = _graph(model)
        if not self.graph.is_token_model:
            raise error_for(Status.MODEL_KIND, "not a token model (no EMBED layer): use reference.run")
        self.attention = [layer for layer in self.graph.layers if isinstance(layer, Attention)]
        self.max_seq_len = self.graph.max_seq_len
        self.vocab_size = self.graph.vocab_size
        self._cache = [
            (np.zeros((self.max_seq_len, a.kv_width), dtype=_KV_NP[a.kv_dtype]),
             np.zeros((self.max_seq_len, a.kv_width), dtype=_KV_NP[a.kv_dtype]))
            for a in self.attention
        ]
        self.position = 0

    def reset(self) -> None:
        """Position 0, an empty cache (stale rows are never read: attention reads positions < position)."""
        self.position = 0

    def check(self, ids) -> np.ndarray:
        """The token ids as int64, or the status colibri_lm_forward would return for them."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if not 1 <= ids.size <= self.graph.max_batch:
            raise error_for(Status.BAD_BATCH, f"{ids.size} tokens in one call, the model takes 1..{self.graph.max_batch}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise error_for(Status.BAD_TOKEN, f"token {int(ids[bad[0]])} at {int(bad[0])} is outside [0, {self.vocab_size})")
        if self.position + ids.size > self.max_seq_len:
            raise error_for(Status.CACHE_FULL, f"position {self.position} + {ids.size} tokens > max_seq_len "
                                               f"{self.max_seq_len}")
        return ids

    def forward_tokens(self, ids, *, on_route=None, on_layer=None) -> np.ndarray:
        """float32 [len(ids), vocab]: the logits of each token given everything before it."""
        ids = self.check(ids)
        with np.errstate(all="ignore"):
            x = self._run(ids, on_route, on_layer)
        self.position += ids.size
        return x

    def _run(self, ids: np.ndarray, on_route, on_layer) -> np.ndarray:
        stack: list[np.ndarray] = []
        x = np.zeros(0, dtype=f32)
        attention_index = 0
        for index, layer in enumerate(self.graph.layers):
            if isinstance(layer, Embedding):
                x = embedding_rows(layer.table, ids)
            elif isinstance(layer, Attention):
                x = attention_forward(layer, x, self.position, *self._cache[attention_index])
                attention_index += 1
            else:
                x = _apply(layer, x, stack, on_route)
            x = x.astype(f32, copy=False)
            if on_layer is not None:
                on_layer(index, layer, x)
        return x

    def generate(self, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> list[int]:
        """New token ids after `prompt_ids`, from a fresh sequence (the cache is reset first).

        The prompt runs in chunks of max_batch tokens; each drawn token is fed back one at a time
        (the last one is not fed). One Rng(seed) draws every sampled token."""
        check_sampler(temperature, top_k, top_p)
        max_new_tokens = integer_arg("max_new_tokens", max_new_tokens)
        integer_arg("seed", seed)
        prompt = np.asarray(prompt_ids).reshape(-1)
        if prompt.size == 0:
            raise error_for(Status.BAD_BATCH, "an empty prompt: give at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if prompt.size + max(max_new_tokens - 1, 0) > self.max_seq_len:
            raise error_for(Status.CACHE_FULL, f"{prompt.size} prompt tokens + {max_new_tokens} new ones need "
                                               f"{prompt.size + max_new_tokens - 1} positions, max_seq_len is "
                                               f"{self.max_seq_len}")
        self.reset()
        rng = Rng(seed)
        out: list[int] = []
        if max_new_tokens == 0:
            return out
        step = self.graph.max_batch
        for start in range(0, prompt.size, step):
            logits = self.forward_tokens(prompt[start:start + step])
        while True:
            out.append(sample(logits[-1], temperature, top_k, top_p, rng))
            if len(out) == max_new_tokens:
                return out
            logits = self.forward_tokens([out[-1]])


_KV_NP = {DType.F32: np.float32, DType.F16: np.float16}


def embedding_rows(table: Weight, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of an f32, f16 or int8 (q·scale + E, per row) table, as float32 [n, d]."""
    if isinstance(table, Q8Weight):
        rows = (table.q[ids].astype(f32) * table.scale.astype(f32)[ids, None]).astype(f32)
        if table.nnz:
            ptr = table.row_ptr.astype(np.int64)
            for i, r in enumerate(ids):
                for j in range(ptr[r], ptr[r + 1]):
                    c = int(table.col[j])
                    rows[i, c] = f32(rows[i, c] + f32(table.val[j]))
        return rows
    if isinstance(table, F16Weight):
        return table.data[ids].astype(f32)
    return np.asarray(table, dtype=f32)[ids].copy()


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, as the RMSNORM op computes it."""
    y = (x / np.sqrt((x * x).mean(axis=-1, keepdims=True, dtype=f32) + f32(eps))).astype(f32)
    return (y * weight).astype(f32)


def _qk_norm(x: np.ndarray, weight: np.ndarray | None, heads: int, hd: int, eps: float) -> np.ndarray:
    """[n, heads·hd] normed per head (weight [hd]) or as a whole (weight [heads·hd])."""
    if weight is None:
        return x
    if weight.shape[0] == hd and heads > 1:
        return _rms(x.reshape(-1, heads, hd), weight, eps).reshape(x.shape)
    return _rms(x, weight, eps)


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, hd/2] in f32: inv_freq and the angle in f64, each rounded to f32 once at the end."""
    j = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = np.power(np.float64(f32(theta)), -(2.0 * j) / head_dim)
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    # the C library's double cos and sin, as the engine calls them (numpy's vectorised ones may differ
    # in the last bit of the double, which can move the f32 rounding)
    return _cos64(angle).astype(f32), _sin64(angle).astype(f32)


_cos64 = np.frompyfunc(math.cos, 1, 1)
_sin64 = np.frompyfunc(math.sin, 1, 1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Hugging Face rotate_half on [n, heads, hd]: pairs (j, j + hd/2), each product rounded to f32."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    first = ((a * c).astype(f32) - (b * s).astype(f32)).astype(f32)
    second = ((b * c).astype(f32) + (a * s).astype(f32)).astype(f32)
    return np.concatenate([first, second], axis=-1)


def attention_forward(a: Attention, x: np.ndarray, position: int, k_cache: np.ndarray,
                      v_cache: np.ndarray) -> np.ndarray:
    """Rows x [n, d] at positions position.. : writes their k, v into the caches, returns [n, d]."""
    n, hd, heads, kv_heads = x.shape[0], a.head_dim, a.n_heads, a.n_kv_heads
    blocks = a.int8_blocks
    q = _qk_norm(linear(x, a.q_w, a.q_b, int8_blocks=blocks), a.q_norm, heads, hd, a.qk_norm_eps)
    k = _qk_norm(linear(x, a.k_w, a.k_b, int8_blocks=blocks), a.k_norm, kv_heads, hd, a.qk_norm_eps)
    v = linear(x, a.v_w, a.v_b, int8_blocks=blocks)
    pos = np.arange(position, position + n)
    cos, sin = rope_tables(pos, hd, a.rope_theta)
    q = apply_rope(q.reshape(n, heads, hd), cos, sin)
    k = apply_rope(k.reshape(n, kv_heads, hd), cos, sin).reshape(n, kv_heads * hd)
    k_cache[position:position + n] = k
    v_cache[position:position + n] = v
    keys = k_cache[: position + n].astype(f32).reshape(-1, kv_heads, hd)
    values = v_cache[: position + n].astype(f32).reshape(-1, kv_heads, hd)
    scale = f32(1.0 / math.sqrt(hd))
    group = heads // kv_heads
    out = np.empty((n, heads, hd), dtype=f32)
    for h in range(heads):
        g = h // group
        scores = ((q[:, h, :] @ keys[:, g, :].T).astype(f32) * scale).astype(f32)  # [n, t]
        future = pos[:, None] < np.arange(position + n)[None, :]
        probs = _softmax(np.where(future, f32(-np.inf), scores))
        # Causal in the values too (docs/lm.md "Semantics"): row i reads positions 0 .. its own and
        # nothing later, so a NaN or inf in a later row's value cannot reach it through 0 · NaN.
        for i in range(n):
            t = position + i + 1
            out[i, h, :] = (probs[i, :t] @ values[:t, g, :]).astype(f32)
    return linear(out.reshape(n, heads * hd), a.o_w, a.o_b, int8_blocks=blocks)
