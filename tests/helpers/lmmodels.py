"""Small random token models (docs/lm.md) as Colibri graphs, for the LM format and reference tests."""
from __future__ import annotations

import numpy as np

from colibri.quant import quantize
from colibri.model.format import Act, DType, ExpertKind, Routing
from colibri.model.ir import Attention, Embedding, Expert, Graph, Linear, MoE, ResidualAdd, ResidualPush, RMSNorm


def _w(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)


def _v(rng: np.random.Generator, n: int, scale: float = 0.1) -> np.ndarray:
    return (rng.standard_normal(n) * scale).astype(np.float32)


def attention(rng: np.random.Generator, d: int, heads: int, kv_heads: int, hd: int, max_seq_len: int, *,
              bias: bool = False, qk_norm: str | None = None, kv_dtype: DType = DType.F32,
              theta: float = 10000.0) -> Attention:
    """qk_norm: None, "head" (weights [hd], Qwen3-MoE) or "all" (weights [H·hd], OLMoE)."""
    q_norm = k_norm = None
    if qk_norm == "head":
        q_norm, k_norm = 1 + _v(rng, hd), 1 + _v(rng, hd)
    elif qk_norm == "all":
        q_norm, k_norm = 1 + _v(rng, heads * hd), 1 + _v(rng, kv_heads * hd)
    return Attention(
        n_heads=heads, n_kv_heads=kv_heads, head_dim=hd,
        q_w=_w(rng, heads * hd, d), k_w=_w(rng, kv_heads * hd, d), v_w=_w(rng, kv_heads * hd, d),
        o_w=_w(rng, d, heads * hd),
        q_b=_v(rng, heads * hd) if bias else None, k_b=_v(rng, kv_heads * hd) if bias else None,
        v_b=_v(rng, kv_heads * hd) if bias else None, o_b=_v(rng, d) if bias else None,
        q_norm=q_norm, k_norm=k_norm, qk_norm_eps=1e-6 if qk_norm else 0.0,
        rope_theta=theta, max_seq_len=max_seq_len, kv_dtype=kv_dtype,
    )


def glu(rng: np.random.Generator, d: int, hidden: int) -> Expert:
    return Expert(kind=ExpertKind.GLU, act=Act.SILU, w1=_w(rng, hidden, d), w3=_w(rng, hidden, d),
                  w2=_w(rng, d, hidden))


def token_model(seed: int = 0, *, vocab: int = 40, d: int = 16, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                hd: int = 6, max_seq_len: int = 24, max_batch: int = 8, tied: bool = False, bias: bool = False,
                qk_norm: str | None = None, kv_dtype: DType = DType.F32, experts: int = 4, top_k: int = 2,
                hidden: int = 8) -> Graph:
    """EMBED, (attention block, MoE block) x layers, RMSNORM, head; the second layer's FFN is dense.
    `hidden`: each expert's (the dense FFN's is hidden + 4)."""
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((vocab, d))).astype(np.float32)
    out: list = [Embedding(table)]
    for i in range(layers):
        if i % 2:
            ffn = MoE(routing=Routing.TOP1, top_k=1, router_weight=np.zeros((1, d), np.float32),
                      experts=[glu(rng, d, hidden + 4)], expert_map=np.zeros(1, np.int32))
        else:
            ffn = MoE(routing=Routing.SOFTMAX_TOPK, top_k=top_k, router_weight=_w(rng, experts, d),
                      experts=[glu(rng, d, hidden) for _ in range(experts)], expert_map=np.arange(experts, dtype=np.int32),
                      renormalize=True, shared=[glu(rng, d, hidden)], shared_gate=_w(rng, 1, d))
        out += [ResidualPush(), RMSNorm(d, 1e-5, 1 + _v(rng, d)),
                attention(rng, d, heads, kv_heads, hd, max_seq_len, bias=bias, qk_norm=qk_norm, kv_dtype=kv_dtype),
                ResidualAdd(), ResidualPush(), RMSNorm(d, 1e-5, 1 + _v(rng, d)), ffn, ResidualAdd()]
    out += [RMSNorm(d, 1e-5, 1 + _v(rng, d)), Linear(table if tied else _w(rng, vocab, d))]
    return Graph(layers=out, input_size=vocab, output_size=vocab, max_batch=max_batch)


# The engine's LM paths, by name: GQA, MQA with biases, tied embeddings, q/k norms, f16 KV cache, f16/q8 weights.
CONFIGS = {
    "f32-gqa": dict(heads=4, kv_heads=2),
    "f32-mqa-bias": dict(heads=4, kv_heads=1, bias=True),
    "f32-mha-tied": dict(heads=3, kv_heads=3, tied=True),
    "f32-qknorm-head": dict(qk_norm="head"),
    "f32-qknorm-all": dict(qk_norm="all", bias=True),
    "f16kv": dict(kv_dtype=DType.F16, qk_norm="head"),
    "f16": dict(dtype="f16", tied=True),
    "q8": dict(dtype="q8", qk_norm="all"),
    "q8-tied-f16kv": dict(dtype="q8", tied=True, kv_dtype=DType.F16, heads=4, kv_heads=1),
}


def config_graph(seed: int, kw: dict) -> Graph:
    """token_model(seed, **kw), quantised to kw's `dtype` (default f32)."""
    kw = dict(kw)
    dtype = kw.pop("dtype", "f32")
    g = token_model(seed, **kw)
    return quantize.quantize(g, dtype) if dtype != "f32" else g
