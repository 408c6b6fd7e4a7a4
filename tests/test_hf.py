"""Hugging Face MoE blocks exported by colibri.frontends.hf match transformers' own forward.

Every block is built from a small random config (no hub access), put in eval
mode, run on a [batch, T, H] input, exported, and the numpy reference run of
the image is compared with the HF output within 1e-5 * (1 + max|y|).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import colibri
from colibri.frontends import exporter, hf
from colibri import reference
from colibri.model.errors import ExportError
from colibri.model.format import Routing

import hfblocks

assert hf.CONVERTERS is exporter.CONVERTERS


def _input(batch: int, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, tokens, hidden, generator=torch.Generator().manual_seed(seed + 1000))


def _hf_forward(block: nn.Module, x: torch.Tensor) -> np.ndarray:
    """The block's own output as [tokens, H] (5.x returns a tensor; a 4.x-style tuple is unwrapped)."""
    with torch.no_grad():
        y = block(x.clone())
    y = y[0] if isinstance(y, tuple) else y
    return y.reshape(-1, x.shape[-1]).numpy()


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    err = float(np.max(np.abs(got - want)))
    tol = 1e-5 * (1.0 + float(np.max(np.abs(want))))
    assert err <= tol, f"max|delta| {err:.3g} > {tol:.3g}"


def _export_and_check(block: nn.Module, x: torch.Tensor) -> exporter.ExportResult:
    """Export with the HF input itself as example (the blocks need [batch, seq, H]) and compare the image."""
    tokens = x.shape[0] * x.shape[1]
    want = _hf_forward(block, x)
    result = exporter.export(block, None, max_batch=tokens, example_input=x)
    got = reference.run(colibri.image.read(result.image), x.reshape(tokens, -1).numpy())
    _assert_close(got, want)
    assert result.max_abs_error is not None and result.max_abs_error <= 1e-5 * (1 + np.abs(want).max())
    return result


# --- Mixtral -------------------------------------------------------------------------------------

MIXTRAL = [  # hidden, intermediate, experts, top_k, activation, tokens
    (16, 24, 4, 2, "silu", 16),
    (8, 12, 3, 1, "gelu", 5),
    (12, 20, 8, 3, "gelu_new", 11),
    (20, 16, 5, 5, "relu", 7),
    (16, 8, 6, 2, "gelu_pytorch_tanh", 1),
    (10, 6, 4, 2, "tanh", 9),
]


@pytest.mark.parametrize("hidden,inter,experts,top_k,act,tokens", MIXTRAL)
def test_mixtral_matches_hf(hidden: int, inter: int, experts: int, top_k: int, act: str, tokens: int) -> None:
    block = hfblocks.mixtral(hidden, inter, experts, top_k, act, seed=hidden * experts + top_k)
    result = _export_and_check(block, _input(1, tokens, hidden, seed=tokens))
    (moe,) = result.graph.moe_layers()
    assert moe.routing == Routing.TOPK_SOFTMAX and moe.top_k == top_k and len(moe.experts) == experts


def test_mixtral_fused_weight_split() -> None:
    """gate_up_proj[e] = [w1 (activated gate); w3 (up)], down_proj[e] = w2: checked directly on the weights."""
    block = hfblocks.mixtral(8, 6, 3, 2, "silu", seed=3)
    (moe,) = exporter.to_layers(block)
    gu, down = block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy()
    for e, ex in enumerate(moe.experts):
        np.testing.assert_array_equal(ex.w1, gu[e, :6])
        np.testing.assert_array_equal(ex.w3, gu[e, 6:])
        np.testing.assert_array_equal(ex.w2, down[e])


class _V4Expert(nn.Module):
    """transformers 4.x MixtralBlockSparseTop2MLP: w2(act(w1 x) * w3 x)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock4(nn.Module):
    """The transformers 4.x MixtralSparseMoeBlock layout (Linear gate, ModuleList experts), with its forward."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_V4Expert(hidden, inter) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, idx = torch.topk(torch.softmax(self.gate(flat), dim=-1), self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(flat)
        for k in range(self.top_k):
            for e, expert in enumerate(self.experts):
                sel = idx[:, k] == e
                y[sel] += w[sel, k, None] * expert(flat[sel])
        return y.reshape(x.shape)


def test_mixtral_v4_layout() -> None:
    block = hfblocks.randomised(MixtralSparseMoeBlock4(12, 10, 4, 2), seed=7)
    exporter.CONVERTERS["MixtralSparseMoeBlock4"] = hf.convert_mixtral
    try:
        _export_and_check(block, _input(1, 9, 12, seed=7))
    finally:
        del exporter.CONVERTERS["MixtralSparseMoeBlock4"]


# --- Qwen2-MoE -----------------------------------------------------------------------------------

QWEN = [  # hidden, moe_inter, shared_inter, experts, top_k, norm_topk_prob, activation, tokens
    (16, 8, 12, 4, 2, False, "silu", 16),
    (16, 8, 12, 4, 2, True, "silu", 16),
    (8, 6, 20, 6, 3, True, "gelu", 7),
    (12, 10, 4, 5, 1, False, "gelu_new", 3),
    (20, 4, 8, 8, 4, False, "relu", 12),
    (10, 12, 6, 3, 3, True, "silu", 1),
]


@pytest.mark.parametrize("hidden,inter,shared,experts,top_k,norm,act,tokens", QWEN)
def test_qwen2_moe_matches_hf(hidden: int, inter: int, shared: int, experts: int, top_k: int, norm: bool,
                              act: str, tokens: int) -> None:
    block = hfblocks.qwen2_moe(hidden, inter, shared, experts, top_k, norm, act, seed=hidden + experts * top_k + norm)
    result = _export_and_check(block, _input(1, tokens, hidden, seed=tokens + 1))
    (moe,) = result.graph.moe_layers()
    assert moe.routing == Routing.SOFTMAX_TOPK and moe.renormalize == norm and moe.top_k == top_k
    assert len(moe.shared) == 1 and moe.shared_gate is not None and moe.shared[0].hidden == shared


# --- Switch Transformers -------------------------------------------------------------------------

SWITCH = [  # d_model, d_ff, experts, router_bias, activation, tokens
    (16, 24, 4, False, "relu", 16),
    (16, 24, 4, True, "relu", 16),
    (8, 12, 8, True, "gelu", 6),
    (12, 32, 3, False, "gelu_new", 11),
    (20, 10, 6, True, "silu", 1),
    (10, 16, 2, False, "tanh", 8),
]


@pytest.mark.parametrize("d,ff,experts,bias,act,tokens", SWITCH)
def test_switch_matches_hf(d: int, ff: int, experts: int, bias: bool, act: str, tokens: int) -> None:
    # capacity >= tokens per sequence: HF drops no token, which is what Colibri computes.
    block = hfblocks.switch(d, ff, experts, bias, act, capacity=tokens, seed=d + experts + bias)
    result = _export_and_check(block, _input(1, tokens, d, seed=tokens + 2))
    (moe,) = result.graph.moe_layers()
    assert moe.routing == Routing.TOP1 and (moe.router_bias is not None) == bias


def test_switch_several_sequences() -> None:
    """Capacity counts per sequence: 3 sequences of 5 tokens with capacity 5 drop nothing."""
    block = hfblocks.switch(12, 16, 4, True, "relu", capacity=5, seed=11)
    _export_and_check(block, _input(3, 5, 12, seed=11))


def test_switch_capacity_not_modelled() -> None:
    """With a binding capacity HF zeroes the overflow tokens; the image runs them. Elsewhere they agree."""
    block = hfblocks.switch(8, 12, 2, False, "relu", capacity=1, seed=5)
    x = _input(1, 12, 8, seed=5)
    want = _hf_forward(block, x)
    result = exporter.export(block, None, max_batch=12)
    got = reference.run(colibri.image.read(result.image), x.reshape(12, 8).numpy())
    dropped = np.all(want == 0, axis=1)
    assert 0 < dropped.sum() <= 10  # at most one token kept per expert
    _assert_close(got[~dropped], want[~dropped])
    assert np.all(np.abs(got[dropped]).max(axis=1) > 0)


# --- refusals ------------------------------------------------------------------------------------


def test_refuses_unsupported_activation_with_path() -> None:
    block = hfblocks.mixtral(8, 6, 3, 2, "quick_gelu", seed=1)
    with pytest.raises(ExportError, match=r"model\.1\.experts\.act_fn .*QuickGELU"):
        exporter.export(nn.Sequential(nn.Identity(), block), None, max_batch=4)


def test_refuses_clipped_gelu_in_shared_expert() -> None:
    block = hfblocks.qwen2_moe(8, 6, 4, 3, 2, True, "gelu_10", seed=1)
    with pytest.raises(ExportError, match=r"model\.experts\.act_fn"):
        exporter.export(block, None, max_batch=4)


def test_refuses_biased_shared_gate() -> None:
    block = hfblocks.qwen2_moe(8, 6, 4, 3, 2, False, "silu", seed=2)
    block.shared_expert_gate = nn.Linear(8, 1, bias=True)
    with pytest.raises(ExportError, match=r"model\.shared_expert_gate .*bias"):
        exporter.export(block, None, max_batch=4)


def test_refuses_non_default_fused_layout() -> None:
    block = hfblocks.mixtral(8, 6, 3, 2, "silu", seed=3)
    block.experts.is_transposed = True
    with pytest.raises(ExportError, match=r"model\.experts .*is_transposed"):
        exporter.export(block, None, max_batch=4)


def test_refuses_zero_capacity() -> None:
    block = hfblocks.switch(8, 12, 2, False, "relu", capacity=0, seed=4)
    with pytest.raises(ExportError, match=r"model\.router .*expert_capacity=0"):
        exporter.export(block, None, max_batch=4)


# --- the C engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "switch"])
def test_engine_matches_hf(kind: str) -> None:
    tokens, hidden = 13, 16
    block = {
        "mixtral": lambda: hfblocks.mixtral(hidden, 24, 4, 2, "silu", seed=21),
        "qwen2_moe": lambda: hfblocks.qwen2_moe(hidden, 8, 12, 4, 2, True, "silu", seed=22),
        "switch": lambda: hfblocks.switch(hidden, 24, 4, True, "relu", capacity=tokens, seed=23),
    }[kind]()
    x = _input(1, tokens, hidden, seed=24)
    result = _export_and_check(block, x)
    got = colibri.Model(result.image).forward(x.reshape(tokens, hidden).numpy())
    _assert_close(got, _hf_forward(block, x))


# --- blocks inside a model, on [batch, features] -------------------------------------------------


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "switch"])
def test_block_in_sequential_takes_2d_input(kind: str) -> None:
    """A block in a Sequential fed [tokens, features], as every other layer is; the export check runs on it."""
    tokens, hidden = 9, 12
    block = {
        "mixtral": lambda: hfblocks.mixtral(hidden, 16, 4, 2, "silu", seed=31),
        "qwen2_moe": lambda: hfblocks.qwen2_moe(hidden, 8, 10, 4, 2, False, "gelu", seed=32),
        "switch": lambda: hfblocks.switch(hidden, 16, 4, True, "relu", capacity=tokens, seed=33),
    }[kind]()
    torch.manual_seed(34)
    model = nn.Sequential(nn.Linear(5, hidden), block, nn.LayerNorm(hidden), nn.Linear(hidden, 3)).eval()
    x = torch.randn(tokens, 5, generator=torch.Generator().manual_seed(35))
    with torch.no_grad():  # the blocks' own calling convention: one sequence of all tokens
        want = model[3](model[2](model[1](model[0](x)[None])[0])).numpy()
    for example in (x, x.numpy()):
        result = exporter.export(model, None, max_batch=tokens, example_input=example)
        assert [c.ok for c in result.checks] == [True, True]
        _assert_close(colibri.Model(result.image).forward(x.numpy()), want)
    # A bare block takes [tokens, H] too.
    h = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(36))
    result = exporter.export(block, None, max_batch=tokens, example_input=h)
    _assert_close(reference.run(colibri.image.read(result.image), h.numpy()), _hf_forward(block, h[None]))
