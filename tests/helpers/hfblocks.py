"""Hugging Face MoE blocks from small random configs (no hub access), for the tests."""
from __future__ import annotations

import torch
from torch import nn
from transformers import MixtralConfig, Qwen2MoeConfig, SwitchTransformersConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

from colibri.frontends import hf  # noqa: F401  registers the block converters


def randomised(module: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter with N(0, 1/fan_in): transformers 5 leaves torch.empty params uninitialised here."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.ndim >= 2 else 4
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return module.eval()


def mixtral(hidden: int, inter: int, experts: int, top_k: int, act: str, seed: int) -> nn.Module:
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                        num_experts_per_tok=top_k, hidden_act=act)
    return randomised(MixtralSparseMoeBlock(cfg), seed)


def qwen2_moe(hidden: int, inter: int, shared: int, experts: int, top_k: int, norm: bool, act: str,
              seed: int) -> nn.Module:
    cfg = Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, shared_expert_intermediate_size=shared,
                         num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm, hidden_act=act)
    return randomised(Qwen2MoeSparseMoeBlock(cfg), seed)


def switch(d: int, ff: int, experts: int, bias: bool, act: str, capacity: int, seed: int) -> nn.Module:
    """capacity ≥ tokens per sequence makes HF drop no token, which is what Colibri computes."""
    cfg = SwitchTransformersConfig(d_model=d, d_ff=ff, num_experts=experts, router_bias=bias,
                                   dense_act_fn=act, expert_capacity=capacity)
    return randomised(SwitchTransformersSparseMLP(cfg), seed)
