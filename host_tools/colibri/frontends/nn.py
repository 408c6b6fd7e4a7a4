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


# ---------------------------------------------------------------------------
# A MoE transformer language model (docs/lm.md): train it with PyTorch, export it as a token model.


class RMSNorm(nn.Module):
    """weight · x / sqrt(mean(x²) + eps), over the last dimension (the engine's RMSNORM)."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, "rotate_half" pairs (j, j + hd/2), on [..., seq, hd]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with rotary positions, grouped-query heads and optional per-head q/k RMSNorm.

    On [batch, seq, d_model], every sequence starting at position 0 (the engine's KV cache gives the
    same result one token at a time)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None, *,
                 rope_theta: float = 10000.0, qk_norm: bool = False, bias: bool = False, eps: float = 1e-5):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        head_dim = head_dim or d_model // n_heads
        if n_heads % n_kv_heads or head_dim % 2:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads}) and head_dim ({head_dim}) be even")
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_theta = n_heads, n_kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, n, self.n_heads, hd)
        k = self.k_proj(x).view(b, n, self.n_kv_heads, hd)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv = self.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd)
        angle = torch.arange(n, dtype=torch.float64, device=x.device)[:, None] * inv[None, :]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        q, k = (_rotate(t.transpose(1, 2), cos, sin) for t in (q, k))  # [b, heads, n, hd]
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.n_heads * hd))


class MoETransformer(nn.Module):
    """A decoder-only MoE language model: token ids [batch, seq] -> logits [batch, seq, vocab].

    Pre-norm blocks `x + attention(norm(x))`, `x + moe(norm(x))` (MoE as `colibri.nn.MoE`, gated
    SiLU experts by default), a final RMSNorm and a head tied to the embedding unless
    `tie_embeddings=False`. `colibri.export(model, path, max_seq_len=N)` writes it as a token model."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *, num_experts: int = 4,
                 hidden: int | None = None, top_k: int = 2, routing: str = "softmax_topk", renormalize: bool = True,
                 n_kv_heads: int | None = None, head_dim: int | None = None, rope_theta: float = 10000.0,
                 qk_norm: bool = False, num_shared: int = 0, tie_embeddings: bool = True, eps: float = 1e-5):
        super().__init__()
        hidden = hidden or 2 * d_model
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList()
        for _ in range(n_layers):
            block = nn.Module()
            block.attn_norm = RMSNorm(d_model, eps)
            block.attn = CausalSelfAttention(d_model, n_heads, n_kv_heads, head_dim, rope_theta=rope_theta,
                                             qk_norm=qk_norm, eps=eps)
            block.moe_norm = RMSNorm(d_model, eps)
            block.moe = MoE(d_model, num_experts, hidden, top_k=top_k, routing=routing,
                            renormalize=renormalize and routing == "softmax_topk", activation="silu", gated=True,
                            expert_bias=False, num_shared=num_shared)
            self.blocks.append(block)
        self.norm = RMSNorm(d_model, eps)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block.attn(block.attn_norm(x))
            x = x + block.moe(block.moe_norm(x))
        return self.head(self.norm(x))
