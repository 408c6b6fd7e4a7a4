"""Weight quantisation of a layer graph: f16, int8 per output channel with
a sparse f16 compensation term (W ≈ Q·S + E), and int4 in groups of columns
with f16 scales and the same E (format v5).

Every weight matrix has a name (colibri.model.walks): `layers.3` for a Linear,
`layers.5.router`, `layers.5.shared_gate`, `layers.5.experts.2.w1`,
`layers.5.shared.0.w3`. `keep` takes fnmatch patterns of names to leave in
f32 (`*.router`, `layers.0`); `int8_act` patterns select the layers and
experts (`layers.0`, `layers.5.experts.*`) that also run with int8
activations (one scale per token row), `int8_blocks` those that run with int8
activations in blocks (one scale per 32 columns: INT8_BLOCKS), attention blocks
(`layers.1`: their q, k, v and o projections) included; `int8_act` patterns pass
over attention blocks, which have only the block form.

Routers and shared-expert gates stay f32 unless `quantize_routers`: they are a
sliver of the bytes, and a quantised router logit that crosses a near-tie sends
the token to another expert, which moves its whole output row.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from rich.progress import track

from ..model.errors import ExportError
from ..model.ir import Attention, Embedding, F16Weight, Graph, Q4Weight, Q8Weight, QuantWeight, Weight
from ..model.walks import BIAS_OF, act_forms, act_targets, act_weights, name_matches, router_feeders, weight_slots
from ..model.walks import where as _where

# The clip search in C. setup.py builds it in the step that builds the engine binding, from the sources
# that binding's hash covers (colibri.runtime.sources.HASHED), so a checkout whose C changed refuses the
# pair on `import colibri` until `make setup` rebuilds both.
try:
    from . import _q4_search
except ImportError:  # a source checkout without a build: the numpy search, the same bits
    _q4_search = None

DTYPES = ("f32", "f16", "q8", "q4")
DEFAULT_COMPENSATION = 0.005  # share of each tensor's weights kept exactly in E
F16_MAX = 65504.0


F16_MIN_NORMAL = 2.0**-14
# Error budget of compact parameters (format v2, docs/model-format.md "Quantised weights"):
# an f16 scale is the nearest f16 to the f32 one, the int8 weights those of the f32 scale (a
# gain error of at most 2^-12 per row); an f16 bias may move each output by at most this share of its
# row's weight step s (1/4: half of what rounding one weight may add on a unit input, while a
# row sums `cols` such roundings: their spread is about 0.29·s·|x|₂).
F16_BIAS_SHARE = 1 / 4


def _f16_bias(b: np.ndarray) -> np.ndarray:
    """A finite f32 bias as f16 parameters hold it: rounded to nearest, with magnitudes below f16's
    normal range going to the nearer of ±0 and ±2^-14 (the format has no f16 subnormal parameter)."""
    h = b.astype(np.float16)
    tiny = np.abs(h.astype(np.float32)) < F16_MIN_NORMAL
    h[tiny] = np.where(np.abs(b[tiny]) >= F16_MIN_NORMAL / 2, np.copysign(np.float16(F16_MIN_NORMAL), b[tiny]),
                       np.copysign(np.float16(0), b[tiny])).astype(np.float16)
    return h


# Clip search (quantize_q8(clip=True)): each row's scale is the one of CLIP_STEPS evenly spaced shares
# of its largest |weight|, from 1 down to CLIP_LOWEST, that gives the least (importance-weighted) squared
# rounding-and-clipping error. Below half the range the clipped tail costs more than finer steps save on
# any weight distribution a trained layer has.
CLIP_STEPS = 41
CLIP_LOWEST = 0.5
ROUTER_PATTERNS = ("*.router", "*.shared_gate")
# The attention projections a q4 model stores as q8: k and v. Their rounding reaches every later
# position through the cache, and they are the small ones (n_kv_heads · head_dim rows): on the bench's
# random Mixtral, Qwen2-MoE and OLMoE (docs/quantization.md) q8 k/v cut the q4 logit error by a fifth to
# a third for 0.5-2.5% more bytes. llama.cpp's Q4_0 raises them to Q8_0 for 8-expert models.
Q4_KV_AS_Q8 = ("k_w", "v_w")


def q4_stored_as_q8(name: str, owner: object, attr: str, is_table: bool, q8: Sequence[str],
                    int4_source: bool = False) -> bool:
    """Whether weight `name` (`attr` of `owner`) of a q4 model is stored as q8 instead: embedding tables
    and routers (the format has no int4 form of them), what the `q8` patterns name, and the attention's
    k and v projections (Q4_KV_AS_Q8) unless they come as int4 already (`int4_source`: a GGUF's Q4_0,
    carried as it is)."""
    return (is_table or name_matches(name, q8) or name_matches(name, ROUTER_PATTERNS)
            or (isinstance(owner, Attention) and attr in Q4_KV_AS_Q8 and not int4_source))


def _clip_scales(w: np.ndarray, top: np.ndarray, importance: np.ndarray | None, skip: np.ndarray | None) -> np.ndarray:
    """Per row, the scale top·α/127 (α in [CLIP_LOWEST, 1]) with the least Σ_c imp_c (w − q·s)²; `skip`
    marks the weights E holds exactly (their error is not the scale's)."""
    imp = np.ones(w.shape[1], np.float32) if importance is None else np.asarray(importance, np.float32)
    mask = np.ones_like(w) if skip is None else (~skip).astype(np.float32)
    best = (top / np.float32(127)).astype(np.float32)
    best_err = np.full(w.shape[0], np.inf)
    for alpha in np.linspace(1.0, CLIP_LOWEST, CLIP_STEPS, dtype=np.float32):
        s = (top * alpha / np.float32(127)).astype(np.float32)
        safe = np.where(s > 0, s, np.float32(1))
        q = np.clip(np.rint(w / safe[:, None]), -127, 127)
        err = (((w - q * safe[:, None]) ** 2) * mask) @ imp
        better = err < best_err  # ties keep the larger scale (α = 1 first): no clipping without a gain
        best[better], best_err[better] = s[better], err[better]
    return best


def _largest(a: np.ndarray, n: int) -> np.ndarray:
    """Indices, in no order, of the n largest values of the flat array `a`: the set
    `np.argpartition(a, a.size - n)[a.size - n:]` holds. When that set is unique (its smallest value
    is no other element's), it is found among the elements above a threshold taken from a sample,
    a fraction of the array; with a tie there, NaN, or a sample that misses, argpartition itself."""
    k = a.size - n
    if a.size >= 1 << 16 and 0 < 4 * n < a.size and not np.isnan(a.max()):
        step = a.size // (1 << 14)
        sample = a[::step]
        above = min(sample.size - 1, 2 * n // step + 64)  # the threshold: about 2n of `a` above it
        low = np.partition(sample, sample.size - 1 - above)[sample.size - 1 - above]
        candidates = np.flatnonzero(a >= low)
        if candidates.size >= n:
            values = a[candidates]
            top = np.argpartition(values, values.size - n)[values.size - n :]
            if np.count_nonzero(values >= values[top].min()) == n:
                return candidates[top]
    return np.argpartition(a, k)[k:]


def _compensation(w: np.ndarray, residual: np.ndarray, n_e: int, importance: np.ndarray | None,
                  dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sparse f16 term E (CSR: row_ptr, col, val) of a q8 or q4 matrix: the n_e largest residuals
    W - Q·S (weighted by the inputs' mean squares `importance` when given), rows then columns in
    increasing order, entries that round to zero in f16 dropped."""
    rows, cols = w.shape
    row_ptr = np.zeros(rows + 1, dtype=np.uint32)
    col = np.zeros(0, dtype=np.uint16)
    val = np.zeros(0, dtype=np.float16)
    if n_e:
        weight = np.abs(residual) if importance is None else np.abs(residual) * np.sqrt(importance)[None, :]
        flat = _largest(weight.ravel(), n_e)
        big = np.abs(residual.ravel()[flat]).max(initial=0)
        if big > F16_MAX:
            raise ExportError(f"weight magnitude {np.abs(w).max():.3g} is too large for {dtype}: its compensation "
                              f"value {big:.3g} exceeds the f16 range ({F16_MAX:g})")
        values = residual.ravel()[flat].astype(np.float16)
        keep = values != 0
        flat, values = flat[keep], values[keep]
        order = np.argsort(flat, kind="stable")  # row-major: rows, then columns increasing
        flat, values = flat[order], values[order]
        r, c = np.divmod(flat, cols)
        row_ptr[1:] = np.cumsum(np.bincount(r, minlength=rows))
        col, val = c.astype(np.uint16), values
    return row_ptr, col, val


def quantize_q8(w: np.ndarray, compensation: float = DEFAULT_COMPENSATION, *, bias: np.ndarray | None = None,
                compact: bool = False, clip: bool = False, importance: np.ndarray | None = None) -> Q8Weight:
    """int8 per output channel; E takes the `compensation` share of largest residuals.

    The largest-magnitude weights are set aside first so they do not stretch
    their row's scale; E then stores the largest residuals W − Q·S, which are
    mostly those outliers, as f16.

    `bias` (the layer's, [rows]) travels in the result (format v2) when given. With
    `compact`, scales and bias are stored as f16 if they stay within the error budget
    (F16_BIAS_SHARE; every nonzero scale a normal f16), else both as f32.

    `clip` searches each row's scale for the least squared error (`_clip_scales`) instead of
    taking its largest |weight|. `importance` ([cols], e.g. the mean square of each input
    feature over calibration tokens, `colibri.quant.calibrate`) weights that error by column, and E
    then takes the residuals largest in |r|·sqrt(importance): the ones that move outputs most.
    """
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    n_e = int(round(compensation * w.size)) if cols <= 65536 else 0
    body = np.abs(w)
    if n_e:
        outliers = _largest(body.ravel(), n_e)
        body = body.copy()
        body.ravel()[outliers] = 0

    if importance is not None:
        importance = np.asarray(importance, dtype=np.float32)
        if importance.shape != (cols,) or not np.all(np.isfinite(importance)) or np.any(importance < 0):
            raise ExportError(f"importance must be {cols} finite values >= 0, got shape {importance.shape}")
    if clip:
        skip = None if not n_e else (body == 0) & (w != 0)
        scale = _clip_scales(w, body.max(axis=1), importance, skip)
    else:
        scale = (body.max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    q[scale == 0] = 0
    residual = w - q.astype(np.float32) * scale[:, None]
    if n_e:
        # A set-aside outlier beyond f16's range cannot sit in E (it would be stored
        # as Inf): its row keeps every weight in the scale instead, which bounds
        # the row's residuals by scale / 2.
        wide = np.flatnonzero((np.abs(residual) > F16_MAX).any(axis=1))
        if wide.size:
            scale[wide] = (np.abs(w[wide]).max(axis=1) / np.float32(127)).astype(np.float32)
            q[wide] = np.clip(np.rint(w[wide] / scale[wide, None]), -127, 127).astype(np.int8)
            residual[wide] = w[wide] - q[wide].astype(np.float32) * scale[wide, None]
    if compact:
        # f16 scales: the int8 weights stay those of the f32 scales (the same rounding as
        # version 1), the stored scale is the nearest f16, a gain error of at most 2^-12 per
        # row, and E is chosen from the residuals of the scales as stored.
        s16 = scale.astype(np.float16) if np.all(scale <= F16_MAX) else None
        nonzero = None if s16 is None else s16[s16 != 0].astype(np.float32)
        ok = s16 is not None and bool(np.all((nonzero >= F16_MIN_NORMAL) & (nonzero <= F16_MAX))) \
            and bool(np.all((s16 != 0) == (scale != 0)))
        if ok and bias is not None:
            b = np.asarray(bias, dtype=np.float32)  # NaN, inf, beyond f16: f32 parameters
            ok = bool(np.all(np.isfinite(b)) and np.all(np.abs(b) <= F16_MAX))
            if ok:
                err = np.abs(_f16_bias(b).astype(np.float32) - b)
                ok = bool(np.all(err <= scale * F16_BIAS_SHARE))
        if not ok:
            return quantize_q8(w, compensation, bias=bias, compact=False, clip=clip, importance=importance)
        scale = s16.astype(np.float32)
        residual = w - q.astype(np.float32) * scale[:, None]
    row_ptr, col, val = _compensation(w, residual, n_e, importance, "q8")
    b = None if bias is None else np.asarray(bias, dtype=np.float32)
    if compact:
        return Q8Weight(q=q, scale=scale.astype(np.float16), row_ptr=row_ptr, col=col, val=val,
                        bias=None if b is None else _f16_bias(b))
    return Q8Weight(q=q, scale=scale, row_ptr=row_ptr, col=col, val=val, bias=b)


Q4_DEFAULT_GROUP = 32  # columns per f16 scale, as the ESP32 LLM ports' int4
# Clip search: each group's scale is alpha · max|w| / 7 for the alpha of this grid with the least
# squared error over the group's weights (those set aside for E excluded).
Q4_CLIP_GRID = np.linspace(1.0, 0.5, 26, dtype=np.float32)


def _f16_scale(s: np.ndarray) -> np.ndarray:
    """Scales as stored (f16, ±0 or normal): below f16's normal range a nonzero scale becomes the
    smallest normal (coarser steps, never a subnormal the format refuses)."""
    return np.where((s > 0) & (s < F16_MIN_NORMAL), np.float32(F16_MIN_NORMAL), s).astype(np.float16)


def _q4_too_large(g: np.ndarray) -> ExportError:
    return ExportError(f"weight magnitude {np.abs(g).max():.3g} is too large for q4: a group scale would "
                       f"exceed the f16 range ({F16_MAX:g})")


def q4_fit_spec(g: np.ndarray, m: np.ndarray, amax: np.ndarray, alpha: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """One α of `q4_scales_spec`: each group's scale `_f16_scale(α · amax / 7)` (f32 values) and its
    squared error Σ (w − q·s)² over the weights `m` marks, q = clip(rint(w / s), −8, 7) (0 where s is 0)."""
    s = _f16_scale((amax * alpha / np.float32(7)).astype(np.float32)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1))[:, :, None]
    q = np.clip(np.rint(g / safe), -8, 7)
    q[s == 0] = 0
    err = np.where(m, (g - q * s[:, :, None]) ** 2, 0).sum(axis=2)
    return s, err


def q4_scales_spec(g: np.ndarray, m: np.ndarray, clip_search: bool) -> np.ndarray:
    """Each group's scale ([rows, G], f32 values of the f16 as stored): of the scales
    `_f16_scale(α · amax / 7)` for α in Q4_CLIP_GRID (only α = 1 without `clip_search`), the first with
    the least Σ (w − q·s)² over the group's weights `m` marks (q = clip(rint(w / s), −8, 7): `q4_fit_spec`);
    amax is the largest marked |w| of the group. `g` holds the groups [rows, G, group], zero-padded.

    The readable form of the search; `_q4_scales` computes the same bits faster."""
    amax = np.where(m, np.abs(g), 0).max(axis=2)
    if float(amax.max(initial=0)) / 7 > F16_MAX:
        raise _q4_too_large(g)
    scale, best = q4_fit_spec(g, m, amax, np.float32(1))
    if clip_search:
        for alpha in Q4_CLIP_GRID[1:]:
            s, err = q4_fit_spec(g, m, amax, alpha)
            better = err < best
            scale[better], best[better] = s[better], err[better]
    return scale


# Weights per block of groups the numpy search (`_q4_scales_numpy`) works on: its two f32 buffers (1 MiB
# each) stay in the cache; measured best of 2^15..2^20 on the bench's Xeon with one and two threads
# (bench/quant_speed.py). The C search hands its threads chunks of this many weights.
Q4_SEARCH_BLOCK = 1 << 18
# Threads of the search: the cores this process may run on (at most 8). The scales do not depend on it.
Q4_SEARCH_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _on_threads(task, starts: list[int], stops: list[int]) -> list:
    """task(start, stop) for each range, on up to Q4_SEARCH_THREADS threads (numpy's loops and the C search
    release the GIL, so the ranges, disjoint groups, run on the cores at once); the results in order."""
    workers = max(1, min(Q4_SEARCH_THREADS, len(starts)))
    if workers == 1:
        return [task(a, b) for a, b in zip(starts, stops)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return [done.result() for done in [pool.submit(task, a, b) for a, b in zip(starts, stops)]]


def _q4_scales(g: np.ndarray, m: np.ndarray, clip_search: bool) -> np.ndarray:
    """`q4_scales_spec`, bit for bit, fast: the C search when it is built, else the numpy one."""
    if _q4_search is not None and g.dtype == np.float32 and m.dtype == np.bool_:
        scale = _q4_scales_c(g, m, clip_search)
        if scale is not None:
            return scale
    return _q4_scales_numpy(g, m, clip_search)


def _q4_scales_c(g: np.ndarray, m: np.ndarray, clip_search: bool) -> np.ndarray | None:
    """`q4_scales_spec` by colibri.quant._q4_search (its file says how the bits stay the spec's), in
    chunks of about Q4_SEARCH_BLOCK weights shared among the threads (a busy core holds up one chunk, not
    half the matrix). None when g holds NaN or inf, which it leaves to the numpy search: whatever that
    does with them (quantize_q4 refuses them before) stays as it is."""
    rows, n_groups, group = g.shape
    alphas = np.ascontiguousarray(Q4_CLIP_GRID if clip_search else Q4_CLIP_GRID[:1])
    flat_g = np.ascontiguousarray(g.reshape(-1, group))
    flat_m = np.ascontiguousarray(m.reshape(-1, group))
    total = flat_g.shape[0]
    scale = np.empty(total, np.float32)
    chunk = max(1, Q4_SEARCH_BLOCK // group)
    starts = list(range(0, total, chunk))
    stops = [min(total, a + chunk) for a in starts]
    status = _on_threads(lambda a, b: _q4_search.scales(flat_g[a:b], flat_m[a:b], alphas, scale[a:b]), starts, stops)
    if any(s != _q4_search.OK for s in status):
        if not np.all(np.isfinite(g)):
            return None
        raise _q4_too_large(g)  # the only other status: a group scale beyond f16
    return scale.reshape(rows, n_groups)


def _pairwise_sum(x: np.ndarray) -> np.ndarray:
    """Σ over axis 0 of `x` [n, N] (n a multiple of 8) in the order numpy's add.reduce sums a contiguous
    run of n float32 (pairwise: eight running sums per block of at most 128, blocks halved above)."""
    n = x.shape[0]
    if n > 128:
        half = n // 2 - n // 2 % 8
        return _pairwise_sum(x[:half]) + _pairwise_sum(x[half:])
    r = x[:8].copy()
    for i in range(8, n, 8):
        r += x[i : i + 8]
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))


def _q4_scales_numpy(g: np.ndarray, m: np.ndarray, clip_search: bool) -> np.ndarray:
    """`q4_scales_spec`, bit for bit, in numpy (the search when the C one is not built): blocks of
    groups that stay in the cache, laid out [group, groups] so that every step is one long float32
    vector operation, and no temporaries.

    Each weight goes through the spec's float32 operations in its order, and each group's squared
    errors are summed in the order of the spec's `sum(axis=2)` (`_pairwise_sum`). Weights outside `m`
    are zeroed once: each then adds rint(0 / s) = 0 and (0 − 0)² = +0, the spec's masked term. A
    group whose scale is 0 has only ±0 (or subnormals that round to 0) marked, so skipping the spec's
    q = 0 there leaves the same terms."""
    rows, n_groups, group = g.shape
    alphas = Q4_CLIP_GRID if clip_search else Q4_CLIP_GRID[:1]
    flat_g, flat_m = g.reshape(-1, group), m.reshape(-1, group)
    total = flat_g.shape[0]
    block = min(total, max(1, Q4_SEARCH_BLOCK // group))
    scale = np.empty(total, np.float32)

    def search(first: int, last: int) -> None:
        """The scales of groups first..last-1, a block at a time (each worker its own buffers)."""
        kept = np.empty((group, block), np.float32)
        work = np.empty_like(kept)
        errs = np.empty((len(alphas), block), np.float32)
        for i0 in range(first, last, block):
            i1 = min(last, i0 + block)
            n = i1 - i0
            k, t, e = kept[:, :n], work[:, :n], errs[:, :n]
            np.multiply(flat_g[i0:i1].T, flat_m[i0:i1].T, out=k)  # +0 or -0 where not marked: both give +0 below
            top = np.abs(k).max(axis=0)
            if float(top.max()) / 7 > F16_MAX:
                raise _q4_too_large(g)
            # every α's scales at once: the same float32 product and quotient per element as the spec's
            s_all = _f16_scale((top[None, :] * alphas[:, None] / np.float32(7)).astype(np.float32))
            s_all = s_all.astype(np.float32)
            safe_all = np.where(s_all > 0, s_all, np.float32(1))
            for a in range(len(alphas)):
                np.divide(k, safe_all[a], out=t)
                np.rint(t, out=t)
                np.clip(t, -8, 7, out=t)
                np.multiply(t, s_all[a], out=t)
                np.subtract(k, t, out=t)
                np.multiply(t, t, out=t)
                e[a] = _pairwise_sum(t)
            # the spec keeps a later α only when its error is strictly less: the first of the least
            scale[i0:i1] = s_all[np.argmin(e, axis=0), np.arange(n)]

    blocks = -(-total // block)
    workers = max(1, min(Q4_SEARCH_THREADS, blocks))
    bounds = [min(total, block * (blocks * i // workers)) for i in range(workers + 1)]
    _on_threads(search, bounds[:-1], bounds[1:])
    return scale.reshape(rows, n_groups)


def _q4_values(g: np.ndarray, scale: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The int4 values [rows, cols] (int8) of the finite groups g [rows, G, group] under their scales
    [rows, G], clip(rint(w / s), −8, 7) and 0 where s is 0, and the residuals w − q·s: in C when it is
    built (the same float32 steps), else in numpy."""
    rows, n_groups, group = g.shape
    if _q4_search is not None and g.dtype == np.float32:
        q = np.empty((rows, n_groups * group), np.int8)
        residual = np.empty(q.shape, np.float32)
        _q4_search.values(np.ascontiguousarray(g), np.ascontiguousarray(scale, dtype=np.float32), q, residual)
        return np.ascontiguousarray(q[:, :cols]), residual[:, :cols]
    safe = np.where(scale > 0, scale, np.float32(1))[:, :, None]
    q = np.clip(np.rint(g / safe), -8, 7)
    q[scale == 0] = 0
    q = q.reshape(rows, -1)[:, :cols].astype(np.int8)
    per_col = np.repeat(scale, group, axis=1)[:, :cols]
    return q, g.reshape(rows, -1)[:, :cols] - q.astype(np.float32) * per_col


def quantize_q4(w: np.ndarray, compensation: float = DEFAULT_COMPENSATION, *, group: int = Q4_DEFAULT_GROUP,
                bias: np.ndarray | None = None, clip_search: bool = True) -> Q4Weight:
    """Symmetric int4 (-8..7) in groups of `group` columns of a row, one f16 scale each, plus the
    sparse f16 compensation E of q8 (`quantize_q8`): the `compensation` share of largest residuals.

    As in q8, the largest-magnitude weights are set aside first so they do not stretch their group's
    scale, and E then stores the largest residuals W − Q·S, mostly those outliers. With
    `clip_search`, each group's scale is the MSE-optimal clip of `Q4_CLIP_GRID` over the group's
    other weights; otherwise max|w| / 7. The int4 values are those of the f16 scales as stored.

    `bias` (the layer's, [rows]) travels as f16 in the companion when its rounding moves no output by
    more than F16_BIAS_SHARE of its row's smallest weight step; otherwise the result has none and the
    caller keeps the f32 bias (`Q4Weight.bias is None`)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.size == 0:
        raise ExportError(f"int4 weights need a non-empty matrix, got shape {w.shape}")
    if group < 8 or group > 256 or group & (group - 1):
        raise ExportError(f"q4 group must be a power of two from 8 to 256, got {group}")
    if not np.all(np.isfinite(w)):
        raise ExportError("weights hold NaN or inf: q4 has no int4 form of them")
    rows, cols = w.shape
    n_groups = -(-cols // group)
    n_e = int(round(compensation * w.size)) if cols <= 65536 else 0
    kept = np.ones(w.shape, dtype=bool)  # weights the scales are fitted to
    if n_e:
        outliers = _largest(np.abs(w).ravel(), n_e)
        kept.ravel()[outliers] = False

    # Groups as [rows, G, group], padded with zeros (which quantise to 0, adding no error).
    if cols % group:
        padded = np.zeros((rows, n_groups * group), dtype=np.float32)
        padded[:, :cols] = w
        mask = np.zeros(padded.shape, dtype=bool)
        mask[:, :cols] = kept
    else:
        padded, mask = w, kept
    g = padded.reshape(rows, n_groups, group)
    m = mask.reshape(g.shape)
    scale = _q4_scales(g, m, clip_search)
    q, residual = _q4_values(g, scale, cols)

    row_ptr, col, val = _compensation(w, residual, n_e, None, "q4")
    return Q4Weight(q=q, scale=scale.astype(np.float16), group=group, row_ptr=row_ptr, col=col, val=val,
                    bias=q4_companion_bias(scale, bias))


def q4_companion_bias(scale: np.ndarray, bias: np.ndarray | None) -> np.ndarray | None:
    """The f16 bias an int4 weight's companion holds for the layer's f32 `bias`, or None when its
    rounding would move an output by more than F16_BIAS_SHARE of the row's smallest step in `scale`
    ([rows, G], as stored); the caller then keeps the f32 bias."""
    if bias is None:
        return None
    scale = np.asarray(scale, dtype=np.float32)
    b = np.asarray(bias, dtype=np.float32)
    if not (np.all(np.isfinite(b)) and np.all(np.abs(b) <= F16_MAX)):
        return None
    step = np.where(scale > 0, scale, np.float32(np.inf)).min(axis=1)
    step = np.where(np.isfinite(step), step, np.float32(0))  # an all-zero row: the bias exactly
    cand = _f16_bias(b)
    return cand if np.all(np.abs(cand.astype(np.float32) - b) <= step * F16_BIAS_SHARE) else None


def quantize_f16(w: np.ndarray) -> F16Weight:
    w = np.asarray(w, dtype=np.float32)
    if np.abs(w).max(initial=0) > F16_MAX:
        raise ExportError(f"weight magnitude {np.abs(w).max():.3g} exceeds the f16 range ({F16_MAX:g})")
    return F16Weight(w.astype(np.float16))


def quantize(
    graph: Graph,
    dtype: str = "q8",
    *,
    compensation: float = DEFAULT_COMPENSATION,
    keep: Sequence[str] = (),
    int8_act: Sequence[str] = (),
    int8_blocks: Sequence[str] = (),
    progress: bool = False,
    compact: bool = True,
    quantize_routers: bool = False,
    clip: bool = False,
    calibration: np.ndarray | None = None,
    dtypes: Mapping[str, str] | None = None,
    router_inputs: str | None = None,
    group: int = Q4_DEFAULT_GROUP,
    q8: Sequence[str] = (),
) -> Graph:
    """A copy of `graph` with its weight matrices stored as `dtype` (f32, f16, q8, q4).

    q4 (format v5, `quantize_q4`): int4 in groups of `group` columns with f16 scales and the same
    sparse E as q8, each bias in the companion where f16 holds it. Routers and shared gates stay f32;
    embedding tables (with a tied head) and the attention's k and v projections become q8
    (`q4_stored_as_q8`). `q8` patterns name further weights to store as q8 instead of q4.

    q8 with `compact` (format v2, the default): each int8 matrix's bias moves into its
    Q8_PARAMS companion, and scales and bias are f16 where the error budget allows
    (`quantize_q8`). `compact=False` gives what format version 1 holds (f32 scales,
    biases as f32 tensors), for `image.write(..., version=1)`.

    Routers and shared gates (ROUTER_PATTERNS) stay f32 unless `quantize_routers`. `clip`: each
    q8 row's scale by clip search. `calibration` (inputs [n, input_size]) weights each q8
    matrix's rounding error and E by the mean square of its input features over those tokens
    (`colibri.quant.calibrate.input_moments`). `dtypes` maps weight names to a dtype of their own
    (f32, f16 or q8), overriding `dtype` and the router default: a mixed-precision plan
    (`colibri.target.budget`). `router_inputs` (f32 or f16) stores the matrices that feed a router
    (`router_feeders`) at that precision: what keeps near-tied expert scores from swapping."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not 0 <= compensation < 1:
        raise ExportError(f"compensation must be a fraction in [0, 1), got {compensation}")
    out = copy.deepcopy(graph)
    slots = list(weight_slots(out))
    for name, owner, attr in slots:
        w: Weight = getattr(owner, attr)
        if not isinstance(w, np.ndarray):
            raise ExportError(f"{name} is already quantised: quantise from an f32 model")
    names = [n for n, _, _ in slots]
    unknown = sorted(set(dtypes or {}) - set(names))
    if unknown:
        raise ExportError(f"dtypes names {unknown[0]!r}, which is no weight; names look like {names[:3]}")
    bad = sorted({d for d in (dtypes or {}).values() if d not in DTYPES})
    if bad:
        raise ExportError(f"dtypes gives {bad[0]!r}; a weight's dtype must be one of {DTYPES}")
    if router_inputs not in (None, "f32", "f16"):
        raise ExportError(f"router_inputs must be f32 or f16, got {router_inputs!r}")
    feeders = set(router_feeders(graph)) if router_inputs else set()
    importance: dict[str, np.ndarray] = {}
    if calibration is not None:
        from .calibrate import input_moments

        importance = input_moments(graph, calibration)
    if q8 and dtype != "q4":
        raise ExportError("q8 patterns choose int8 weights inside a q4 model: use them with dtype='q4'")
    if "q4" in (dtype, *(dtypes or {}).values()) and (group < 8 or group > 256 or group & (group - 1)):
        raise ExportError(f"q4 group must be a power of two from 8 to 256, got {group}")
    tables = {id(layer.table) for layer in out.layers if isinstance(layer, Embedding)}
    for pattern in list(keep) + list(int8_act) + list(int8_blocks) + list(q8):
        if not any(name_matches(n, [pattern]) for n in names + [n for n, _ in act_targets(out)]):
            raise ExportError(f"pattern {pattern!r} matches no weight; names look like {names[:3]}")

    def dtype_of(name: str) -> str:
        if dtypes is not None and name in dtypes:
            return dtypes[name]
        if name in feeders and dtype not in ("f32", router_inputs):
            return router_inputs
        if name_matches(name, keep) or (not quantize_routers and name_matches(name, ROUTER_PATTERNS)):
            return "f32"
        return dtype

    if dtype != "f32" or dtypes:
        # A tied head names the embedding table itself: it is quantised (or kept) with the table, whose
        # slot comes first, and stays the same object (one tensor in the image); its own bias, if any,
        # stays a separate tensor.
        done: dict[int, Weight] = {}
        for name, owner, attr in track(slots, description=f"quantising to {dtype}", disable=not progress):
            w = getattr(owner, attr)
            if id(w) in done:
                setattr(owner, attr, done[id(w)])
                continue
            want = dtype_of(name)
            if want == "q4" and q4_stored_as_q8(name, owner, attr, id(w) in tables, q8):
                want = "q8"
            if want == "f32":
                done[id(w)] = w  # kept in f32: a tied head stays f32 with it
                continue
            try:
                if want == "q4":
                    b_attr = BIAS_OF.get(attr)
                    bias = getattr(owner, b_attr) if b_attr else None
                    qw = quantize_q4(w, compensation, group=group, bias=bias)
                    setattr(owner, attr, qw)
                    if qw.bias is not None:
                        setattr(owner, b_attr, None)
                elif want == "q8":
                    b_attr = BIAS_OF.get(attr)
                    bias = getattr(owner, b_attr) if compact and b_attr else None
                    setattr(owner, attr, quantize_q8(w, compensation, bias=bias, compact=compact, clip=clip,
                                                     importance=importance.get(name)))
                    if bias is not None:
                        setattr(owner, b_attr, None)
                else:
                    setattr(owner, attr, quantize_f16(w))
                done[id(w)] = getattr(owner, attr)
            except ExportError as exc:
                raise ExportError(f"{_where(out, name)}: {exc}; keep it in f32 with keep=[{name!r}] "
                                  f"(--keep {name})") from None
    set_act_forms(out, int8_act, int8_blocks, stored_int8)
    return out


def stored_int8(w: object) -> bool:
    """Whether a quantised graph's weight is int8 or int4."""
    return isinstance(w, QuantWeight)


def set_act_forms(graph: Graph, int8_act: Sequence[str], int8_blocks: Sequence[str],
                  is_int8: Callable[[object], bool]) -> None:
    """Flags the layers, experts and attention blocks the patterns choose with their activation form;
    `is_int8(w)`: whether weight `w` will be stored int8 or int4, which both forms need."""
    for name, target, rows, blocks in act_forms(graph, int8_act, int8_blocks):
        if not all(is_int8(w) for w in act_weights(target)):
            raise ExportError(f"{name}: int8 activations need int8 weights (q8, or q4's int4; not kept in f32)")
        if not isinstance(target, Attention):  # it has the block form only
            target.int8_act = rows
        target.int8_blocks = blocks


def linux_int8_blocks(graph: Graph, is_int8: Callable[[object], bool]) -> list[str]:
    """The INT8_BLOCKS targets of a token-model export that names no activation form: every linear
    layer, expert and attention block whose weights are all int8 or int4 (`is_int8`), when the image
    is for Linux (`image.writer.linux_layout`: experts, and 16 MiB or more compact, which no
    microcontroller slot holds); none otherwise. Every Linux backend (x86-64, AArch64, RISC-V V) has
    block kernels; the Cortex-M one, which has not, never gets such an image (docs/quantization.md)."""
    from ..image.writer import linux_layout

    if not graph.is_token_model or not linux_layout(graph):
        return []
    return [name for name, target in act_targets(graph) if all(is_int8(w) for w in act_weights(target))]
