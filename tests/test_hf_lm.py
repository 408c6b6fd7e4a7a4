"""Hugging Face MoE causal LMs exported as token models (colibri.frontends.hf_lm): the reference's f32 logits
against the model's over a prefill and single-token steps, and greedy continuations against
`generate(do_sample=False)`, for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE from tiny random configs.

Between them the configs cover grouped-query (Mixtral, Qwen3-MoE) and multi-query (OLMoE)
attention, per-head (Qwen3-MoE) and whole-projection (OLMoE) q/k norms, q/k/v biases and a gated
shared expert (Qwen2-MoE), dense layers mixed in (Qwen2-MoE `mlp_only_layers`, Qwen3-MoE
`decoder_sparse_step`), norm_topk_prob both ways, head_dim != hidden/heads, and tied embeddings
(Qwen2-MoE, OLMoE)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

import colibri
from colibri.frontends import hf_lm
from colibri import image
from colibri.model.errors import ExportError
from colibri.model.format import Routing
from colibri.model.ir import MoE
from colibri.reference import LMState

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, attn_implementation="eager")


def _randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn (transformers 5 may leave them torch.empty): matrices N(0, 1/fan_in),
    norm weights near 1, biases small."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def mixtral() -> torch.nn.Module:
    cfg = MixtralConfig(**COMMON, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _randomised(MixtralForCausalLM(cfg), 1)


def qwen2_moe() -> torch.nn.Module:
    cfg = Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1, qkv_bias=True,
                         tie_word_embeddings=True, use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return _randomised(Qwen2MoeForCausalLM(cfg), 2)


def qwen3_moe() -> torch.nn.Module:
    cfg = Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                         decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _randomised(Qwen3MoeForCausalLM(cfg), 3)


def olmoe() -> torch.nn.Module:
    cfg = OlmoeConfig(**COMMON, intermediate_size=16, num_attention_heads=4, num_key_value_heads=1, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _randomised(OlmoeForCausalLM(cfg), 4)


ARCHS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe}
MAX_SEQ_LEN = 64


@pytest.fixture(scope="module", params=list(ARCHS))
def exported(request) -> tuple[str, torch.nn.Module, bytes]:
    model = ARCHS[request.param]()
    result = colibri.export(model, max_seq_len=MAX_SEQ_LEN, max_batch=8)
    return request.param, model, result.image


def test_logits_over_prefill_and_steps(exported) -> None:
    name, model, data = exported
    ids = [int(t) for t in np.random.default_rng(5).integers(0, model.config.vocab_size, 48)]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    state = LMState(image.read(data))
    got = [state.forward_tokens(ids[:8])] + [state.forward_tokens([t]) for t in ids[8:]]  # 8 + 40 positions
    got = np.concatenate(got)
    err = float(np.abs(got - want).max())
    print(f"{name}: max|Δ| {err:.3g} over {len(ids)} positions, max|logits| {np.abs(want).max():.3g}")
    assert err <= 1e-4 * (1 + float(np.abs(want).max()))


def test_greedy_continuation_is_hfs(exported) -> None:
    name, model, data = exported
    prompt = [3, 17, 42, 5, 9, 77]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    want = out[0, len(prompt):].tolist()
    assert LMState(image.read(data)).generate(prompt, 24) == want


def test_the_graph_has_what_the_config_says(exported) -> None:
    name, model, data = exported
    g = image.read(data)
    moes = g.moe_layers()
    dense = [m for m in moes if m.routing == Routing.TOP1 and len(m.experts) == 1]
    tied = g.layers[-1].weight is g.layers[0].table
    assert tied == bool(model.config.tie_word_embeddings)
    a = g.attention_layers()
    assert len(a) == 2 and a[0].n_kv_heads == model.config.num_key_value_heads
    if name == "qwen2_moe":
        assert len(dense) == 1 and moes[0].shared and moes[0].shared_gate is not None and not moes[0].renormalize
        assert a[0].q_b is not None and a[0].o_b is None
    if name == "qwen3_moe":
        assert len(dense) == 1 and moes[1].renormalize and a[0].head_dim == 12 and a[0].q_norm.shape == (12,)
    if name == "olmoe":
        assert a[0].q_norm.shape == (32,) and a[0].k_norm.shape == (8,) and a[0].n_kv_heads == 1
    if name == "mixtral":
        assert all(m.routing == Routing.TOPK_SOFTMAX for m in moes)


def test_f16_and_q8_exports_stay_close(exported) -> None:
    """Relative logit error (max|Δ| / (1 + max|logits|)) over the export check's 32 positions, and
    greedy agreement with the f32 image over 24 new tokens."""
    name, model, data = exported
    prompt = [3, 17, 42, 5, 9, 77]
    greedy = LMState(image.read(data)).generate(prompt, 24)
    for dtype, kv, bound in (("f16", "f16", 2e-3), ("q8", "f32", 0.15)):
        r = colibri.export(model, max_seq_len=MAX_SEQ_LEN, max_batch=8, dtype=dtype, kv_dtype=kv)
        rel = r.checks[0].error / (r.checks[0].tolerance / hf_lm.LM_RTOL)
        same = sum(a == b for a, b in zip(LMState(image.read(r.image)).generate(prompt, 24), greedy))
        print(f"{name} {dtype} weights, {kv} cache: relative error {rel:.2e}, greedy agreement {same}/24")
        assert rel <= bound


def test_export_writes_the_file(tmp_path) -> None:
    path = tmp_path / "m.clb"
    model = olmoe()
    colibri.export(model, path, max_seq_len=16)
    assert image.read(path.read_bytes()).max_seq_len == 16


def test_refusals_by_name() -> None:
    model = mixtral()
    model.config.sliding_window = 32
    with pytest.raises(ExportError, match="sliding window of 32 tokens, shorter than max_seq_len=64"):
        colibri.export(model, max_seq_len=64)
    colibri.export(model, max_seq_len=32)  # a window at or above max_seq_len is plain causal attention

    cfg = Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ExportError, match="rope_type 'linear'"):
        colibri.export(_randomised(Qwen3MoeForCausalLM(cfg), 0), max_seq_len=16)

    model = olmoe()
    model.config.clip_qkv = 4.0
    with pytest.raises(ExportError, match="clip_qkv"):
        colibri.export(model, max_seq_len=16)

    with pytest.raises(ExportError, match="kv_dtype"):
        colibri.export(olmoe(), max_seq_len=16, kv_dtype="q8")


def test_nan_weights_are_refused_by_name() -> None:
    model = olmoe()
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match=r"model.layers.1.self_attn .*k_w are NaN"):
        colibri.export(model, max_seq_len=16)
