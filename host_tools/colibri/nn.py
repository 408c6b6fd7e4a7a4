"""PyTorch modules to build Colibri-exportable MoE models.

Their forward passes are the plain PyTorch definitions the engine is tested
against; `colibri.export` maps each of them onto one image layer.
"""
from __future__ import annotations

import torch
from torch import nn

ROUTINGS = ("top1", "topk_softmax", "softmax_topk", "dense")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid")


def make_activation(name: str) -> nn.Module:
    table = {
        "relu": nn.ReLU,
        "gelu": nn.GELU,
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "silu": nn.SiLU,
        "tanh": nn.Tanh,
        "sigmoid": nn.Sigmoid,
    }
    if name not in table:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return table[name]()


class Expert(nn.Module):
    """Feed-forward expert d -> hidden -> d.

    `gated=False`: `w2(act(w1 x))`; `gated=True` (SwiGLU with silu, as
    Mixtral): `w2(act(w1 x) * w3 x)`.
    """

    def __init__(self, d_model: int, hidden: int, activation: str = "gelu", *, gated: bool = False, bias: bool = True):
        super().__init__()
        self.activation_name = activation
        self.gated = gated
        self.w1 = nn.Linear(d_model, hidden, bias=bias)
        self.w3 = nn.Linear(d_model, hidden, bias=bias) if gated else None
        self.w2 = nn.Linear(hidden, d_model, bias=bias)
        self.act = make_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        return self.w2(h)


class MoE(nn.Module):
    """Mixture of experts over the last dimension, d_model -> d_model.

    routing:
      - "top1": Switch Transformer, softmax then the best expert, weight = its probability
      - "topk_softmax": Mixtral, the k largest logits, softmax over those
      - "softmax_topk": GShard / Qwen-MoE, softmax over all then top-k; `renormalize` divides by their sum
      - "dense": soft mixture, every expert weighted by the softmax
    Shared experts run on every token; with `shared_gate` their sum is scaled
    by sigmoid(x · g) as in Qwen2-MoE.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        hidden: int,
        *,
        top_k: int = 2,
        routing: str = "topk_softmax",
        renormalize: bool = False,
        activation: str = "gelu",
        gated: bool = False,
        expert_bias: bool = True,
        router_bias: bool = False,
        num_shared: int = 0,
        shared_hidden: int | None = None,
        shared_gate: bool = False,
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if routing == "top1":
            top_k = 1
        if routing != "dense" and not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be 1..{num_experts}, got {top_k}")
        if renormalize and routing != "softmax_topk":
            raise ValueError("renormalize applies to routing='softmax_topk' only")
        self.routing = routing
        self.top_k = top_k
        self.renormalize = renormalize
        self.router = nn.Linear(d_model, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(
            Expert(d_model, hidden, activation, gated=gated, bias=expert_bias) for _ in range(num_experts)
        )
        sh = shared_hidden or hidden
        self.shared_experts = nn.ModuleList(
            Expert(d_model, sh, activation, gated=gated, bias=expert_bias) for _ in range(num_shared)
        )
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate and num_shared else None

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """Dense [tokens, num_experts] gate weights (zero where not selected)."""
        logits = self.router(x)
        if self.routing == "dense":
            return torch.softmax(logits, dim=-1)
        if self.routing == "topk_softmax":
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            w = torch.softmax(top, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1)
            w, idx = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                w = w / w.sum(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter(-1, idx, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        g = self.gates(x)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(g[:, e] != 0).flatten()
            if rows.numel():
                y[rows] += g[rows, e, None] * expert(x[rows])
        if len(self.shared_experts):
            s = sum(expert(x) for expert in self.shared_experts)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            y = y + s
        return y.reshape(shape)


class Residual(nn.Module):
    """y = x + body(x)."""

    def __init__(self, *body: nn.Module):
        super().__init__()
        self.body = body[0] if len(body) == 1 else nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)
