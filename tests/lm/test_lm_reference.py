"""reference.LMState and the sampler (docs/lm.md): against a plain PyTorch transcription of the
semantics, the statuses a call returns before it changes anything, and the sampler's exact rules."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import image, reference
from colibri.model.errors import ImageError, InputError
from colibri.model.format import DType, Routing, Status
from colibri.model.ir import Attention, Embedding, Graph, Linear, MoE, ResidualAdd, ResidualPush, RMSNorm, dense
from colibri.reference import LMState, Rng, engine_expf, sample

from helpers import lmmodels

CORE_SRC = Path(__file__).resolve().parents[2] / "firmware" / "colibri_core" / "src"


# ---------------------------------------------------------------------------
# A plain float64 PyTorch transcription of docs/lm.md, the whole sequence at once (no cache)


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(dense(a) if not isinstance(a, np.ndarray) else a), dtype=torch.float64)


def _rms(x: torch.Tensor, w, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * _t(w)


def _torch_attention(a: Attention, x: torch.Tensor) -> torch.Tensor:
    n, hd = x.shape[0], a.head_dim
    q = x @ _t(a.q_w).T + (_t(a.q_b) if a.q_b is not None else 0)
    k = x @ _t(a.k_w).T + (_t(a.k_b) if a.k_b is not None else 0)
    v = x @ _t(a.v_w).T + (_t(a.v_b) if a.v_b is not None else 0)
    q, k, v = q.view(n, a.n_heads, hd), k.view(n, a.n_kv_heads, hd), v.view(n, a.n_kv_heads, hd)
    if a.q_norm is not None:
        q = _rms(q, a.q_norm, a.qk_norm_eps) if a.q_norm.shape[0] == hd else _rms(q.reshape(n, -1), a.q_norm, a.qk_norm_eps).view(q.shape)
    if a.k_norm is not None:
        k = _rms(k, a.k_norm, a.qk_norm_eps) if a.k_norm.shape[0] == hd else _rms(k.reshape(n, -1), a.k_norm, a.qk_norm_eps).view(k.shape)
    inv = a.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]

    def rot(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rot(q), rot(k)
    group = a.n_heads // a.n_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(n, -1)
    return o @ _t(a.o_w).T + (_t(a.o_b) if a.o_b is not None else 0)


def _torch_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    def expert(e, rows):
        h = torch.nn.functional.silu(rows @ _t(e.w1).T) * (rows @ _t(e.w3).T)
        return h @ _t(e.w2).T

    p = (x @ _t(m.router_weight).T).softmax(-1)
    y = torch.zeros_like(x)
    k = 1 if m.routing == Routing.TOP1 else m.top_k
    w, idx = p.topk(k, -1)
    if m.renormalize:
        w = w / w.sum(-1, keepdim=True)
    for t in range(x.shape[0]):
        for j in range(k):
            y[t] += w[t, j] * expert(m.experts[int(m.expert_map[idx[t, j]])], x[t : t + 1])[0]
    if m.shared:
        s = sum(expert(e, x) for e in m.shared)
        y = y + (torch.sigmoid(x @ _t(m.shared_gate).T) * s if m.shared_gate is not None else s)
    return y


def torch_logits(g: Graph, ids: list[int]) -> np.ndarray:
    stack, x = [], None
    for layer in g.layers:
        if isinstance(layer, Embedding):
            x = _t(layer.table)[torch.tensor(ids)]
        elif isinstance(layer, Attention):
            x = _torch_attention(layer, x)
        elif isinstance(layer, RMSNorm):
            x = _rms(x, layer.weight, layer.eps)
        elif isinstance(layer, ResidualPush):
            stack.append(x)
        elif isinstance(layer, ResidualAdd):
            x = x + stack.pop()
        elif isinstance(layer, MoE):
            x = _torch_moe(layer, x)
        elif isinstance(layer, Linear):
            x = x @ _t(layer.weight).T
        else:
            raise TypeError(layer)
    return x.numpy()


def _bar(want: np.ndarray) -> float:
    return 1e-4 * (1 + float(np.abs(want).max()))


@pytest.mark.parametrize("kw", [
    dict(),  # GQA 4/2, untied
    dict(kv_heads=1, tied=True),  # multi-query, tied head
    dict(kv_heads=4, bias=True, qk_norm="head", hd=8),  # MHA with biases, per-head q/k norm, head_dim != d/H
    dict(qk_norm="all", theta=1e6),  # whole-projection q/k norm (OLMoE)
])
def test_reference_matches_torch_over_prefill_and_steps(kw: dict) -> None:
    theta = kw.pop("theta", None)
    g = lmmodels.token_model(3, max_seq_len=48, **kw)
    if theta:
        for a in g.attention_layers():
            a.rope_theta = theta
    ids = [int(t) for t in np.random.default_rng(1).integers(0, g.vocab_size, 44)]
    want = torch_logits(g, ids)
    state = LMState(image.read(image.write(g)))
    got = [state.forward_tokens(ids[:6]), state.forward_tokens(ids[6:8])]
    got += [state.forward_tokens([t]) for t in ids[8:]]
    got = np.concatenate(got)
    assert got.dtype == np.float32 and got.shape == (44, g.vocab_size)
    assert np.abs(got - want).max() <= _bar(want)
    assert state.position == 44


def test_f16_kv_cache_rounds_keys_and_values() -> None:
    g32 = lmmodels.token_model(5, kv_dtype=DType.F32)
    g16 = lmmodels.token_model(5, kv_dtype=DType.F16)
    ids = list(range(1, 21))
    s32, s16 = LMState(g32), LMState(image.read(image.write(g16)))
    a, b = s32.forward_tokens(ids[:8]), s16.forward_tokens(ids[:8])
    assert s16._cache[0][0].dtype == np.float16
    assert 0 < np.abs(a - b).max() <= 1e-2 * (1 + np.abs(a).max())  # f16 keys/values: close, not equal


def test_reset_and_failed_calls_change_nothing() -> None:
    g = lmmodels.token_model(7, max_seq_len=10, max_batch=4)
    s = LMState(g)
    first = s.forward_tokens([1, 2, 3])
    for bad, status in (([1, g.vocab_size], Status.BAD_TOKEN), ([-1], Status.BAD_TOKEN), ([], Status.BAD_BATCH),
                        ([1] * 5, Status.BAD_BATCH)):
        with pytest.raises(InputError) as exc:
            s.forward_tokens(bad)
        assert exc.value.status == status
        assert s.position == 3
    s.forward_tokens([4, 5, 6, 7])
    s.forward_tokens([8, 9])
    with pytest.raises(InputError) as exc:
        s.forward_tokens([1, 2])  # 9 + 2 > 10: the cache is never overwritten
    assert exc.value.status == Status.CACHE_FULL and s.position == 9
    last = s.forward_tokens([3])
    assert s.position == 10
    fresh = LMState(g)
    fresh.forward_tokens([1, 2, 3, 4])
    fresh.forward_tokens([5, 6, 7, 8])
    fresh.forward_tokens([9])
    np.testing.assert_allclose(last, fresh.forward_tokens([3]), rtol=0, atol=1e-5)
    s.reset()
    assert s.position == 0
    np.testing.assert_array_equal(s.forward_tokens([1, 2, 3]), first)


def test_feature_models_are_not_token_models() -> None:
    g = lmmodels.token_model(1)
    feature = Graph(layers=[Linear(np.eye(3, dtype=np.float32))], input_size=3, output_size=3)
    with pytest.raises(InputError) as exc:
        LMState(feature)
    assert exc.value.status == Status.MODEL_KIND
    with pytest.raises(InputError) as exc:
        reference.run(g, np.zeros((1, g.vocab_size), np.float32))
    assert exc.value.status == Status.MODEL_KIND


def test_generate_feeds_back_and_starts_fresh() -> None:
    g = lmmodels.token_model(2, max_seq_len=20, max_batch=3)
    s = LMState(g)
    out = s.generate([5, 6, 7, 8], 6)
    assert s.position == 4 + 5  # the prompt in chunks of 3, then 5 fed tokens (the last one is not fed)
    # by hand: greedy over the logits of the last position, each token fed back
    h = LMState(g)
    logits = np.concatenate([h.forward_tokens([5, 6, 7]), h.forward_tokens([8])])
    want = []
    for _ in range(6):
        want.append(int(np.argmax(logits[-1])))
        logits = h.forward_tokens([want[-1]])
    assert out == want
    assert s.generate([5, 6, 7, 8], 6) == out  # reset first: the same again
    sampled = s.generate([5, 6], 8, temperature=0.8, top_k=10, top_p=0.95, seed=42)
    assert sampled == s.generate([5, 6], 8, temperature=0.8, top_k=10, top_p=0.95, seed=42)
    assert sampled != s.generate([5, 6], 8, temperature=0.8, top_k=10, top_p=0.95, seed=43)
    with pytest.raises(InputError) as exc:
        s.generate([1] * 15, 7)  # 15 + 6 fed positions > 20
    assert exc.value.status == Status.CACHE_FULL


# ---------------------------------------------------------------------------
# Sampler


def test_splitmix64_known_values() -> None:
    # SplitMix64 from seed 0 (Vigna's reference implementation): its first outputs
    r = Rng(0)
    assert [r.next() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    r = Rng(0)
    assert r.uniform() == np.float32((0xE220A8397B1DCDAF >> 40) / 2**24)


def test_greedy_and_statuses() -> None:
    assert sample(np.array([1, 3, 3, 2], np.float32)) == 1  # the lowest index among the largest
    assert sample(np.array([-np.inf, np.inf, 0], np.float32)) == 1  # Inf is a value for greedy
    with pytest.raises(InputError) as exc:
        sample(np.array([1, np.nan], np.float32))
    assert exc.value.status == Status.NAN_LOGITS
    with pytest.raises(InputError) as exc:
        sample(np.array([1, np.inf], np.float32), 1.0, rng=Rng(1))
    assert exc.value.status == Status.NAN_LOGITS
    for t, k, p in ((-1.0, 0, 1.0), (math.nan, 0, 1.0), (math.inf, 0, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5),
                    (1.0, 0, math.nan), (1.0, -1, 1.0)):
        with pytest.raises(InputError) as exc:
            sample(np.zeros(4, np.float32), t, k, p, Rng(0))
        assert exc.value.status == Status.BAD_SAMPLER


def test_sampling_rules() -> None:
    logits = np.array([2.0, 1.0, 0.5, 3.0, -1.0, 3.0], np.float32)
    r = Rng(7)
    assert {sample(logits, 1.0, 1, 1.0, r) for _ in range(50)} == {3}  # top_k 1: the first of the largest
    assert {sample(logits, 1.0, 0, 1e-6, r) for _ in range(50)} == {3}  # a tiny top_p keeps one token
    assert {sample(logits, 1.0, 3, 1.0, r) for _ in range(300)} == {3, 5, 0}
    # top_p: sorted 3, 5, 0, 1, 2, 4 with weights e^0, e^0, e^-1, e^-2, e^-2.5, e^-4 (total 2.603):
    # 2 / total = 0.768 < 0.8 <= (2 + e^-1) / total = 0.910, and 0.7 <= 0.768
    assert {sample(logits, 1.0, 0, 0.8, r) for _ in range(300)} == {3, 5, 0}
    assert {sample(logits, 1.0, 0, 0.7, r) for _ in range(300)} == {3, 5}
    # the draw follows the softmax of logits / temperature
    n, t = 20000, 0.7
    r = Rng(11)
    counts = np.bincount([sample(logits, t, 0, 1.0, r) for _ in range(n)], minlength=6) / n
    p = np.exp((logits - logits.max()) / t)
    np.testing.assert_allclose(counts, p / p.sum(), atol=0.015)


def test_sampling_the_first_index_past_the_draw() -> None:
    """The rule, worked by hand: cumulative mass in sorted order, the first index whose sum exceeds u·mass."""
    logits = np.array([0.0, 0.0, 0.0, 0.0], np.float32)  # e = 1 each, sums 1, 2, 3, 4
    for seed in range(20):
        u = Rng(seed).uniform()
        want = int(np.floor(u * 4))  # the first i with i + 1 > 4u
        assert sample(logits, 1.0, 0, 1.0, Rng(seed)) == want


EXP_C = r"""
#include <stdio.h>
#include <stdint.h>
#include "colibri_math.h"
int main(void) {
    float x;
    while (fread(&x, sizeof x, 1, stdin) == 1) {
        float y = colibri_expf(x);
        fwrite(&y, sizeof y, 1, stdout);
    }
    return 0;
}
"""


def test_engine_expf_is_the_c_engines_bit_for_bit(tmp_path) -> None:
    src, exe = tmp_path / "exp.c", tmp_path / "exp"
    src.write_text(EXP_C)
    subprocess.run(["gcc", "-std=c11", "-O2", "-ffp-contract=off", "-fno-math-errno", f"-I{CORE_SRC}", str(src),
                    "-o", str(exe)], check=True)
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.uniform(-110, 0, 200000), rng.uniform(-1, 1, 50000), rng.uniform(0, 90, 20000),
        [0.0, -0.0, np.inf, -np.inf, np.nan, 88.72283172607421875, 88.7228317260742, -103.972076416015625,
         -103.97208, -87.3, 1e-30, -1e-30],
    ]).astype(np.float32)
    out = subprocess.run([str(exe)], input=x.tobytes(), capture_output=True, check=True).stdout
    want = np.frombuffer(out, np.float32)
    got = engine_expf(x)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), x[~same][:5]


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_nonfinite_later_token_leaves_earlier_rows_alone(bad: float) -> None:
    """Causal in the values too (docs/lm.md "Semantics"): a token whose keys and values are NaN or
    inf (its embedding row is) changes nothing of the rows before it in the same call, so one call
    over the prompt gives what a call per token gives (up to the float sums' order), and the engine
    agrees."""
    g = lmmodels.token_model(4, max_seq_len=16)
    g.layers[0].table[7] = bad
    data = image.write(g)
    prompt = [1, 2, 3, 7, 4]
    whole = LMState(image.read(data)).forward_tokens(prompt)
    state = LMState(image.read(data))
    split = np.concatenate([state.forward_tokens([t]) for t in prompt])
    assert np.isfinite(whole[:3]).all()
    np.testing.assert_allclose(whole[:3], split[:3], rtol=1e-5, atol=1e-5)
    assert not np.isfinite(whole[3]).all() and np.array_equal(np.isfinite(whole), np.isfinite(split))
    engine_rows = colibri.LM(data).forward_tokens(prompt)
    np.testing.assert_allclose(engine_rows[:3], whole[:3], rtol=1e-4, atol=_bar(whole[:3]))
    assert np.array_equal(np.isfinite(engine_rows), np.isfinite(whole))
