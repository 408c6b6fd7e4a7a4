"""Hugging Face `transformers` MoE blocks -> Colibri MoE layers.

Importing this module registers converters in `exporter.CONVERTERS` (keyed by
class name, so the blocks are recognised wherever they sit in a model):

`MixtralSparseMoeBlock`
    Router: softmax over all E logits, top-k, divide by the sum of the k.
    That equals a softmax over the k selected logits, i.e. Colibri
    `TOPK_SOFTMAX`. Experts are SwiGLU-style GLUs with `config.hidden_act`.
    transformers 5.x fuses the experts into `MixtralExperts`:
    `gate_up_proj [E, 2I, H]` whose first I rows are w1 (the activated
    "gate" half) and the last I rows w3 (the "up" half) — the forward is
    `gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)` — and
    `down_proj [E, H, I]` (= w2, already `[out, in]`). The 4.x layout (gate an
    `nn.Linear`, experts a ModuleList with w1, w2, w3, act_fn) is accepted by
    duck typing.

`Qwen2MoeSparseMoeBlock`
    Router: softmax over all, top-k, divided by their sum only if
    `norm_topk_prob`: Colibri `SOFTMAX_TOPK` with `renormalize=norm_topk_prob`.
    Fused experts as Mixtral (`moe_intermediate_size`), plus one shared GLU
    expert (`shared_expert`: gate_proj, up_proj, down_proj) scaled by
    `sigmoid(shared_expert_gate(x))`, a bias-free `Linear(H, 1)`, which is
    exactly Colibri's shared gate. The 4.x layout (Linear gate, ModuleList of
    gate_proj/up_proj/down_proj experts, `norm_topk_prob` on the block) is
    accepted too.

`SwitchTransformersSparseMLP`
    Router: `classifier` Linear (bias iff `config.router_bias`), softmax,
    argmax, and the expert output is scaled by the winning probability:
    Colibri `TOP1`. Experts are `DenseActDense` (wi, act, dropout, wo; no
    biases): Colibri `MLP` experts with `config.dense_act_fn`. In 5.x the
    block returns a plain tensor (4.x returned `(hidden, (router_logits,
    expert_index))`; the exporter takes element 0 of a tuple).

    Expert capacity is NOT modelled. HF applies it in eval mode too: per
    sequence (a cumulative count over the sequence axis of the `[batch, seq,
    E]` dispatch mask), the tokens after the first `expert_capacity` ones
    routed to an expert are dropped — in 5.x their block output is zero (4.x
    instead passed `router_prob * hidden` through). Colibri runs every token
    through its expert, so the image equals the HF block whenever no sequence
    sends more than `expert_capacity` tokens to one expert, which is
    guaranteed when the sequence length is ≤ `expert_capacity`. Choose
    `expert_capacity` ≥ the longest sequence (or ≥ `max_batch`) when
    comparing. `expert_capacity < 1` (every token dropped) is refused.

The blocks unpack `batch, seq, hidden = x.shape`. When the exporter runs a
model on [tokens, features] (its example_input check), each block is fed
[tokens, 1, features] and its output flattened back (`exporter._blocks_take_2d`):
one token per sequence, so Switch capacity never drops a token there, as in
the image. A [batch, seq, features] example is passed through unchanged.

Refused with `ExportError` naming the module path: anything that changes the
eval-mode forward and has no image equivalent — unsupported activations (e.g.
`quick_gelu`, `gelu_10`, `relu2`), fused-expert layouts other than the default
(transposed, interleaved, with biases or a post-expert norm), a biased shared
gate, a Switch expert without plain wi/wo, inconsistent shapes. Router jitter
noise is applied only in training and is ignored. A Switch `router_dtype` of
float16/bfloat16 only lowers the router's precision; the image routes in
float32 (results can differ in the last bits, and on near-ties in the choice).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..model.errors import ExportError
from .exporter import CONVERTERS, activation_of, np32
from ..model.format import Act, ExpertKind, Routing
from ..model.ir import Expert, Layer, MoE


def _refuse(module: nn.Module, path: str, why: str) -> ExportError:
    """An ExportError naming the module, so users can find the offending block in a big model."""
    return ExportError(f"{path} ({type(module).__name__}): {why}; Colibri cannot represent this")


def _linear_weights(lin: nn.Module, path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(weight [out, in], bias or None) of an nn.Linear-like module (HF routers hold just `.weight`)."""
    weight = getattr(lin, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise _refuse(lin, path, "expected a linear layer with a 2-D weight")
    bias = getattr(lin, "bias", None)
    return np32(weight), np32(bias) if isinstance(bias, torch.Tensor) else None


def _glu(act: Act, gate: nn.Module, up: nn.Module, down: nn.Module, path: str) -> Expert:
    """A GLU expert `down(act(gate x) * up x)` from three Linear-like modules (biases kept if present)."""
    w1, b1 = _linear_weights(gate, path)
    w3, b3 = _linear_weights(up, path)
    w2, b2 = _linear_weights(down, path)
    if w1.shape != w3.shape or w2.shape != (w1.shape[1], w1.shape[0]):
        raise ExportError(f"{path}: GLU shapes gate {w1.shape}, up {w3.shape}, down {w2.shape} do not fit together")
    return Expert(kind=ExpertKind.GLU, act=act, w1=w1, b1=b1, w2=w2, b2=b2, w3=w3, b3=b3)


def _check_default_fused_layout(experts: nn.Module, path: str) -> None:
    """Refuse the `use_experts_implementation` variants whose weights we would misread.

    The flags are set per class by transformers' decorator; Mixtral and
    Qwen2-MoE use the defaults (concatenated [gate; up], not transposed, no
    biases, gated, no post-expert norm). Anything else is a different layout.
    """
    expected = {"is_transposed": False, "is_concatenated": True, "has_bias": False,
                "has_gate": True, "has_post_expert_norm": False}
    for flag, want in expected.items():
        if bool(getattr(experts, flag, want)) != want:
            raise _refuse(experts, path, f"fused experts with {flag}={not want}")


def _fused_glu_experts(experts: nn.Module, path: str) -> list[Expert]:
    """Split transformers-5 fused experts: gate_up_proj [E, 2I, H] = [w1; w3], down_proj [E, H, I] = w2."""
    _check_default_fused_layout(experts, path)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[1] % 2:
        raise _refuse(experts, path, f"unexpected fused shapes gate_up_proj {tuple(gate_up.shape)}, "
                                     f"down_proj {tuple(down.shape)}")
    n, two_i, h = gate_up.shape
    i = two_i // 2
    if tuple(down.shape) != (n, h, i):
        raise _refuse(experts, path, f"down_proj {tuple(down.shape)} does not match gate_up_proj "
                                     f"{tuple(gate_up.shape)}")
    act = activation_of(experts.act_fn, f"{path}.act_fn")
    gu, dn = np32(gate_up), np32(down)
    return [Expert(kind=ExpertKind.GLU, act=act, w1=gu[e, :i].copy(), w3=gu[e, i:].copy(), w2=dn[e].copy())
            for e in range(n)]


def _glu_experts(experts: nn.Module, path: str, names: tuple[str, str, str]) -> list[Expert]:
    """Routed GLU experts from either layout: 5.x fused tensors or a 4.x ModuleList.

    `names` are the (gate, up, down) attribute names of a 4.x expert module:
    ("w1", "w3", "w2") for Mixtral, ("gate_proj", "up_proj", "down_proj") for Qwen2-MoE.
    """
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        return _fused_glu_experts(experts, path)
    if isinstance(experts, nn.ModuleList):
        out = []
        for e, mod in enumerate(experts):
            where = f"{path}.{e}"
            if not all(hasattr(mod, a) for a in (*names, "act_fn")):
                raise _refuse(mod, where, f"expert without {', '.join(names)}, act_fn")
            act = activation_of(mod.act_fn, f"{where}.act_fn")
            out.append(_glu(act, *(getattr(mod, a) for a in names), where))
        return out
    raise _refuse(experts, path, "unknown experts layout (neither fused gate_up_proj/down_proj nor a ModuleList)")


def _router(block: nn.Module, attr: str, path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Router weight [E, H] and bias of `block.<attr>` (a TopKRouter in 5.x, an nn.Linear in 4.x)."""
    gate = getattr(block, attr, None)
    if gate is None:
        raise _refuse(block, path, f"no router `{attr}`")
    return _linear_weights(gate, f"{path}.{attr}")


def _router_setting(block: nn.Module, name: str, path: str) -> object:
    """A routing setting: on the router in 5.x (`gate.top_k`), on the block in 4.x (`block.top_k`)."""
    for owner in (getattr(block, "gate", None), block):
        if owner is not None and hasattr(owner, name):
            return getattr(owner, name)
    raise _refuse(block, path, f"cannot find the routing setting `{name}`")


def _check_counts(block: nn.Module, path: str, router_w: np.ndarray, experts: list[Expert], top_k: int) -> None:
    """Router outputs, experts and top_k must agree: the image has no other way to express them."""
    d = router_w.shape[1]
    if router_w.shape[0] != len(experts):
        raise _refuse(block, path, f"router has {router_w.shape[0]} outputs for {len(experts)} experts")
    if not 1 <= top_k <= len(experts):
        raise _refuse(block, path, f"top_k={top_k} with {len(experts)} experts")
    for e, ex in enumerate(experts):
        if ex.w1.shape[1] != d or ex.w2.shape[0] != d:
            raise _refuse(block, path, f"expert {e} is not {d} -> {d}")


def convert_mixtral(block: nn.Module, path: str) -> list[Layer]:
    """MixtralSparseMoeBlock -> one TOPK_SOFTMAX MoE (softmax-all + top-k + renorm == softmax of the top-k)."""
    weight, bias = _router(block, "gate", path)
    experts = _glu_experts(block.experts, f"{path}.experts", ("w1", "w3", "w2"))
    top_k = int(_router_setting(block, "top_k", path))
    _check_counts(block, path, weight, experts, top_k)
    return [MoE(routing=Routing.TOPK_SOFTMAX, top_k=top_k, router_weight=weight, router_bias=bias,
                experts=experts, expert_map=np.arange(len(experts), dtype=np.int32))]


def _qwen_shared(block: nn.Module, path: str) -> tuple[list[Expert], np.ndarray | None]:
    """The shared GLU expert and its sigmoid gate; a zero-width shared expert contributes nothing and is left out."""
    shared = getattr(block, "shared_expert", None)
    if shared is None:
        return [], None
    where = f"{path}.shared_expert"
    if not all(hasattr(shared, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        raise _refuse(shared, where, "shared expert without gate_proj, up_proj, down_proj, act_fn")
    if shared.gate_proj.weight.shape[0] == 0:
        return [], None
    expert = _glu(activation_of(shared.act_fn, f"{where}.act_fn"),
                  shared.gate_proj, shared.up_proj, shared.down_proj, where)
    gate_mod = getattr(block, "shared_expert_gate", None)
    if gate_mod is None:
        return [expert], None
    gate_w, gate_b = _linear_weights(gate_mod, f"{path}.shared_expert_gate")
    if gate_w.shape[0] != 1:
        raise _refuse(gate_mod, f"{path}.shared_expert_gate", f"shared gate has {gate_w.shape[0]} outputs, not 1")
    if gate_b is not None:
        raise _refuse(gate_mod, f"{path}.shared_expert_gate", "shared gate with a bias")
    return [expert], gate_w


def convert_qwen2_moe(block: nn.Module, path: str) -> list[Layer]:
    """Qwen2MoeSparseMoeBlock -> one SOFTMAX_TOPK MoE (renormalised iff norm_topk_prob) with a gated shared expert."""
    weight, bias = _router(block, "gate", path)
    experts = _glu_experts(block.experts, f"{path}.experts", ("gate_proj", "up_proj", "down_proj"))
    top_k = int(_router_setting(block, "top_k", path))
    renormalize = bool(_router_setting(block, "norm_topk_prob", path))
    _check_counts(block, path, weight, experts, top_k)
    shared, shared_gate = _qwen_shared(block, path)
    return [MoE(routing=Routing.SOFTMAX_TOPK, top_k=top_k, router_weight=weight, router_bias=bias,
                experts=experts, expert_map=np.arange(len(experts), dtype=np.int32), renormalize=renormalize,
                shared=shared, shared_gate=shared_gate)]


def _switch_experts(experts: nn.Module, n: int, path: str) -> list[Expert]:
    """`expert_0 … expert_{n-1}` DenseActDense modules -> MLP experts `wo(act(wi x))` (dropout is eval identity)."""
    out = []
    for e in range(n):
        where = f"{path}.expert_{e}"
        mod = getattr(experts, f"expert_{e}", None)
        if mod is None or not all(hasattr(mod, a) for a in ("wi", "wo", "act")):
            raise _refuse(experts, path, f"no plain wi/act/wo expert `expert_{e}` (gated or renamed experts "
                                         "are not supported)")
        w1, b1 = _linear_weights(mod.wi, f"{where}.wi")
        w2, b2 = _linear_weights(mod.wo, f"{where}.wo")
        if w2.shape != (w1.shape[1], w1.shape[0]):
            raise _refuse(mod, where, f"wi {w1.shape} and wo {w2.shape} do not fit together")
        out.append(Expert(kind=ExpertKind.MLP, act=activation_of(mod.act, f"{where}.act"),
                          w1=w1, b1=b1, w2=w2, b2=b2))
    return out


def convert_switch(block: nn.Module, path: str) -> list[Layer]:
    """SwitchTransformersSparseMLP -> one TOP1 MoE; expert capacity is not modelled (see the module docstring)."""
    router = getattr(block, "router", None)
    classifier = getattr(router, "classifier", None)
    if classifier is None:
        raise _refuse(block, path, "no router.classifier")
    capacity = getattr(router, "expert_capacity", None)
    if capacity is not None and int(capacity) < 1:
        raise _refuse(router, f"{path}.router", f"expert_capacity={capacity} drops every token")
    weight, bias = _linear_weights(classifier, f"{path}.router.classifier")
    experts = _switch_experts(block.experts, weight.shape[0], f"{path}.experts")
    _check_counts(block, path, weight, experts, 1)
    return [MoE(routing=Routing.TOP1, top_k=1, router_weight=weight, router_bias=bias,
                experts=experts, expert_map=np.arange(len(experts), dtype=np.int32))]


HF_CONVERTERS: dict[str, Callable[[nn.Module, str], list[Layer]]] = {
    "MixtralSparseMoeBlock": convert_mixtral,
    "Qwen2MoeSparseMoeBlock": convert_qwen2_moe,
    # Qwen3-MoE and OLMoE: Qwen2-MoE's router (softmax, top-k, renormalised iff norm_topk_prob) and
    # fused experts, without a shared expert.
    "Qwen3MoeSparseMoeBlock": convert_qwen2_moe,
    "OlmoeSparseMoeBlock": convert_qwen2_moe,
    "SwitchTransformersSparseMLP": convert_switch,
}
CONVERTERS.update(HF_CONVERTERS)
