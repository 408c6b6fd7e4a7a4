"""Tiny random Hugging Face MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), every parameter drawn
from a seed: what the token-model export is checked on (tests and scripts/lm_accuracy.py)."""
from __future__ import annotations

import torch
from transformers import (
    MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, attn_implementation="eager")


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
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


def mixtral(vocab_size: int = COMMON["vocab_size"]) -> torch.nn.Module:
    cfg = MixtralConfig(**{**COMMON, "vocab_size": vocab_size}, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return randomised(MixtralForCausalLM(cfg), 1)


def qwen2_moe() -> torch.nn.Module:
    cfg = Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1, qkv_bias=True,
                         tie_word_embeddings=True, use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return randomised(Qwen2MoeForCausalLM(cfg), 2)


def qwen3_moe() -> torch.nn.Module:
    cfg = Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                         decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return randomised(Qwen3MoeForCausalLM(cfg), 3)


def olmoe() -> torch.nn.Module:
    cfg = OlmoeConfig(**COMMON, intermediate_size=16, num_attention_heads=4, num_key_value_heads=1, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return randomised(OlmoeForCausalLM(cfg), 4)


ARCHS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe}


MAX_SEQ_LEN = 64
