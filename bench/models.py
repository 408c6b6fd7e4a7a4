"""The bench's models (issue 10) and the peers' export-friendly variant of Colibri's MoE.

meter: 48->32, MoE 3 x (32->64->32) ReLU top-1, ->24 (the smart meter class, 15 K params).
edge: 256->256, 2 MoE layers of 8 experts 256->1024->256 SiLU top-2, ->256 (8.5 M params).
smart_meter: examples/smart_meter's forecaster (the trained one if `make demo` cached it;
otherwise the same architecture untrained: the cost of a forward does not depend on the weights).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from colibri import nn as cnn

ROOT = Path(__file__).resolve().parents[1]


def meter(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(48, 32),
        cnn.MoE(32, 3, 64, routing="top1", activation="relu"),
        nn.Linear(32, 24),
    ).eval()


def edge(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(256, 256),
        cnn.MoE(256, 8, 1024, top_k=2, routing="topk_softmax", activation="silu"),
        cnn.MoE(256, 8, 1024, top_k=2, routing="topk_softmax", activation="silu"),
        nn.Linear(256, 256),
    ).eval()


def smart_meter() -> tuple[nn.Module, str]:
    """The forecaster and where it came from (the demo's cache, or untrained)."""
    import sys

    sys.path.insert(0, str(ROOT / "examples" / "smart_meter"))
    import demo  # noqa: PLC0415  (the demo's cache layout and version)
    import forecaster  # noqa: PLC0415

    out = ROOT / "build" / "smart_meter"
    stamp = out / "models.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == demo.CACHE_VERSION:
        return torch.load(out / "moe.pt", weights_only=False).eval(), f"trained, {out.relative_to(ROOT)}/moe.pt"
    return forecaster.build_moe().eval(), "untrained (no build/smart_meter cache; same cost per forward)"


MODELS = {"meter": meter, "edge": edge}


class GatherMoE(nn.Module):
    """Colibri's MoE with top-k routing written as torch.topk + an index into stacked expert
    weights, so exporters that cannot follow `nonzero` (ONNX, LiteRT) keep sparse routing:
    each token multiplies only its k experts' weights, never all of them."""

    def __init__(self, moe: cnn.MoE, argmax_topk: bool = False):
        super().__init__()
        # TFLM has no TOPK_V2 kernel: the k best are then taken by k rounds of argmax.
        self.argmax_topk = argmax_topk
        if moe.routing == "dense" or len(moe.shared_experts):
            raise ValueError("GatherMoE covers sparse routing without shared experts")
        self.routing, self.top_k, self.renormalize = moe.routing, moe.top_k, moe.renormalize
        self.router = moe.router
        ex = moe.experts

        def stack(get):
            return nn.Parameter(torch.stack([get(e).detach() for e in ex]), requires_grad=False)

        def bias(get, n):
            return stack(lambda e: get(e) if get(e) is not None else torch.zeros(n))

        hidden, d = ex[0].w1.weight.shape
        self.w1, self.b1 = stack(lambda e: e.w1.weight), bias(lambda e: e.w1.bias, hidden)
        self.w2, self.b2 = stack(lambda e: e.w2.weight), bias(lambda e: e.w2.bias, d)
        self.gated = ex[0].w3 is not None
        if self.gated:
            self.w3, self.b3 = stack(lambda e: e.w3.weight), bias(lambda e: e.w3.bias, hidden)
        self.act = copy.deepcopy(ex[0].act)

    def topk(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.argmax_topk:
            return torch.topk(v, self.top_k, dim=-1)
        experts = torch.arange(v.shape[-1])
        vals, idxs = [], []
        for _ in range(self.top_k):
            i = torch.argmax(v, dim=-1)
            vals.append(torch.amax(v, dim=-1))
            idxs.append(i)
            v = v - 1e30 * (experts[None, :] == i[:, None]).to(v.dtype)
        return torch.stack(vals, dim=-1), torch.stack(idxs, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.routing == "topk_softmax":
            top, idx = self.topk(logits)
            w = torch.softmax(top, dim=-1)
        else:  # top1 and softmax_topk: softmax over all experts, then the best k
            w, idx = self.topk(torch.softmax(logits, dim=-1))
            if self.renormalize:
                w = w / w.sum(dim=-1, keepdim=True)
        t, k = idx.shape
        flat = idx.reshape(-1)

        def pick(p: torch.Tensor) -> torch.Tensor:
            # index_select, not p[idx]: indexing lowers negative-index wrapping (SELECT) that TFLM lacks.
            chosen = torch.index_select(p, 0, flat).reshape(t, k, *p.shape[1:])
            # Experts stored in f16 (bench/edge_mmap.py's model, as Colibri's image holds them) are
            # widened after the gather: only the chosen experts' weights are read and converted.
            return chosen if chosen.dtype == x.dtype else chosen.to(x.dtype)

        xc = x[:, None, :, None]  # [T, 1, D, 1]
        h = torch.matmul(pick(self.w1), xc).squeeze(-1) + pick(self.b1)  # [T, k, H]
        h = self.act(h)
        if self.gated:
            h = h * (torch.matmul(pick(self.w3), xc).squeeze(-1) + pick(self.b3))
        y = torch.matmul(pick(self.w2), h[..., None]).squeeze(-1) + pick(self.b2)  # [T, k, D]
        return (w[..., None] * y).sum(dim=1)


def gather_variant(module: nn.Module, argmax_topk: bool = False) -> nn.Module:
    """A copy of `module` with every colibri MoE replaced by its GatherMoE."""
    module = copy.deepcopy(module)

    def swap(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, cnn.MoE):
                setattr(parent, name, GatherMoE(child, argmax_topk))
            else:
                swap(child)

    if isinstance(module, cnn.MoE):
        return GatherMoE(module, argmax_topk).eval()
    swap(module)
    return module.eval()


class MaskedMoE(nn.Module):
    """For TFLM, whose kernels lack TOPK_V2, ONE_HOT and the bounds-checked gathers a converted
    index lowers to: the top-k as a mask (values at or above the k-th largest, found by rounds
    of max), gates zero off the chosen experts, and every expert computed (its output weighted
    0 when not chosen). The same function as the MoE at num_experts/top_k times its work;
    reported as such next to TFLM's figures."""

    def __init__(self, moe: cnn.MoE):
        super().__init__()
        if moe.routing == "dense" or len(moe.shared_experts):
            raise ValueError("MaskedMoE covers sparse routing without shared experts")
        self.routing, self.top_k, self.renormalize = moe.routing, moe.top_k, moe.renormalize
        self.router, self.experts = moe.router, moe.experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        v = logits if self.routing == "topk_softmax" else torch.softmax(logits, dim=-1)
        rest = v
        for _ in range(self.top_k):
            kth = torch.amax(rest, dim=-1, keepdim=True)
            rest = rest - 1e30 * (rest >= kth).to(v.dtype)
        mask = (v >= kth).to(v.dtype)
        if self.routing == "topk_softmax":
            e = torch.exp(v - torch.amax(v, dim=-1, keepdim=True)) * mask
            gates = e / e.sum(dim=-1, keepdim=True)
        else:
            gates = v * mask
            if self.renormalize:
                gates = gates / gates.sum(dim=-1, keepdim=True)
        return sum(gates[:, e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


def masked_variant(module: nn.Module) -> nn.Module:
    """A copy of `module` with every colibri MoE replaced by its MaskedMoE (TFLM's variant)."""
    module = copy.deepcopy(module)

    def swap(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, cnn.MoE):
                setattr(parent, name, MaskedMoE(child))
            else:
                swap(child)

    swap(module)
    return module.eval()
