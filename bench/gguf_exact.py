"""The exact answer for a GGUF file: a float64 numpy forward pass over the file's weights, dequantised
with the `gguf` package, with no rounding of activations anywhere (`make bench-lm-gguf` measures each
engine against it; docs/benchmarks.md "The GGUF import against llama.cpp").

It reads the file as llama.cpp does, not as Colibri's import does: q/k rows stay in the file's order
and a `llama` model gets llama.cpp's adjacent-pair RoPE ("norm" mode), the other architectures the
half-split one ("neox"). So it shares no code and no re-ordering with the import it judges.

`act_rounding` emulates what llama.cpp's CPU back end does to the activations of a matrix product: with
"ggml" the input of every product with an F16 weight is rounded to f16 and that of a Q8_0/Q4_0 weight
to Q8_0 blocks (blocks of 32, an f16 scale, int8 codes), the products themselves exact. That is a
model of the peer's arithmetic, used to tell which of its roundings accounts for its distance from
the exact answer; "none" is the exact forward.

    .venv/bin/python bench/gguf_exact.py FILE.gguf [--tokens 64] [--seed 7]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ARCHS = ("llama", "qwen2moe", "qwen3moe", "olmoe")
# llama.cpp renormalises the chosen experts' weights for these unless {arch}.expert_weights_norm says.
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
ROUNDED_TO_F16 = ("F16", "BF16")
ROUNDED_TO_Q8_0 = ("Q8_0", "Q4_0")


@dataclass
class ExactResult:
    logits: np.ndarray  # float64 [tokens, vocab]
    # Per MoE layer, each token's chosen experts (sorted) and its router probabilities (softmax).
    chosen: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> int [tokens, k]
    probs: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> float64 [tokens, experts]
    gates: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> the chosen experts' weights [tokens, k]


class GGUFModel:
    """A GGUF file's metadata and tensors, each dequantised (exactly, by the gguf package) on use."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.gguf = gguf
        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHS:
            raise SystemExit(f"{self.path}: architecture {self.arch!r} (the exact forward knows {', '.join(ARCHS)})")

    def value(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hp(self, key: str, default=None):
        return self.value(f"{self.arch}.{key}", default)

    def type_name(self, name: str) -> str:
        return self.gguf.GGMLQuantizationType(self.tensors[name].tensor_type).name

    def weight(self, name: str) -> np.ndarray:
        """The tensor dequantised, numpy order (the GGUF shape reversed), float64."""
        t = self.tensors[name]
        out = self.gguf.quants.dequantize(t.data, self.gguf.GGMLQuantizationType(t.tensor_type))
        return np.asarray(out, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])

    def has(self, name: str) -> bool:
        return name in self.tensors


def q8_0_round(x: np.ndarray, gguf) -> np.ndarray:
    """x as ggml's CPU back end hands it to a product with a Q8_0 or Q4_0 weight: in f32, rounded to
    Q8_0 blocks of 32 along its rows (the gguf package's codec, ggml's reference quantiser)."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    rounded = gguf.quants.dequantize(gguf.quants.quantize(x.astype(np.float32), q8_0), q8_0)
    return np.asarray(rounded, dtype=np.float64).reshape(x.shape)


class Forward:
    """`routes` (layer -> int [tokens, k]) forces each MoE layer's choice of experts, say to what an
    engine chose; their weights are still this forward's router probabilities. That separates what a
    routing flip costs from what the arithmetic does."""

    def __init__(self, model: GGUFModel, act_rounding: str = "none",
                 routes: dict[int, np.ndarray] | None = None) -> None:
        if act_rounding not in ("none", "ggml"):
            raise ValueError(f"act_rounding {act_rounding!r}: none or ggml")
        self.m = model
        self.act_rounding = act_rounding
        self.routes = routes
        a = model.arch
        self.d = int(model.hp("embedding_length"))
        self.heads = int(model.hp("attention.head_count"))
        self.kv_heads = int(model.hp("attention.head_count_kv", self.heads))
        self.hd = int(model.hp("attention.key_length", self.d // self.heads))
        self.eps = float(model.hp("attention.layer_norm_rms_epsilon"))
        self.base = float(model.hp("rope.freq_base", 10000.0))
        self.layers = int(model.hp("block_count"))
        self.k = int(model.hp("expert_used_count"))
        self.norm_topk = bool(model.hp("expert_weights_norm", NORM_TOPK[a]))
        self.neox = a != "llama"

    # -- pieces --

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        w = self.m.weight(name)
        return self._rounded(x, self.m.type_name(name)) @ w.T

    def _rounded(self, x: np.ndarray, type_name: str) -> np.ndarray:
        if self.act_rounding == "ggml":
            if type_name in ROUNDED_TO_F16:
                return x.astype(np.float32).astype(np.float16).astype(np.float64)
            if type_name in ROUNDED_TO_Q8_0:
                return q8_0_round(x, self.m.gguf)
        return x

    def rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x [tokens, heads, hd] rotated: llama.cpp's "norm" mode pairs (2i, 2i+1), "neox" (i, i + hd/2)."""
        half = self.hd // 2
        inv = self.base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.hd)
        angle = positions[:, None].astype(np.float64) * inv[None, :]  # [tokens, half]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        if self.neox:
            a, b = x[..., :half], x[..., half:]
            return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def attention(self, x: np.ndarray, i: int) -> np.ndarray:
        m, g, n = self.m, f"blk.{i}", len(x)
        q, k, v = (self.linear(x, f"{g}.attn_{p}.weight") for p in ("q", "k", "v"))
        for p, t in (("q", q), ("k", k), ("v", v)):
            if m.has(f"{g}.attn_{p}.bias"):
                t += m.weight(f"{g}.attn_{p}.bias")
        if m.arch == "olmoe":  # q/k norm over the whole projection
            q = self.rms(q, m.weight(f"{g}.attn_q_norm.weight"))
            k = self.rms(k, m.weight(f"{g}.attn_k_norm.weight"))
        q = q.reshape(n, self.heads, self.hd)
        k = k.reshape(n, self.kv_heads, self.hd)
        v = v.reshape(n, self.kv_heads, self.hd)
        if m.arch == "qwen3moe":  # per head
            q = self.rms(q, m.weight(f"{g}.attn_q_norm.weight"))
            k = self.rms(k, m.weight(f"{g}.attn_k_norm.weight"))
        pos = np.arange(n)
        q, k = self.rope(q, pos), self.rope(k, pos)
        group = self.heads // self.kv_heads
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.hd)
        scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", p, v).reshape(n, self.heads * self.hd)
        return self.linear(out, f"{g}.attn_output.weight")

    def ffn(self, x: np.ndarray, gate: str, up: str, down: str) -> np.ndarray:
        g, u = self.linear(x, gate), self.linear(x, up)
        return self.linear(g / (1.0 + np.exp(-g)) * u, down)

    def moe(self, x: np.ndarray, i: int, result: ExactResult) -> np.ndarray:
        m, g = self.m, f"blk.{i}"
        if not m.has(f"{g}.ffn_gate_inp.weight"):  # a dense layer (Qwen-MoE's mlp_only_layers)
            return self.ffn(x, f"{g}.ffn_gate.weight", f"{g}.ffn_up.weight", f"{g}.ffn_down.weight")
        logits = self.linear(x, f"{g}.ffn_gate_inp.weight")
        z = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, : self.k]
        if self.routes is not None:
            top = np.asarray(self.routes[i], dtype=np.int64)
            if top.shape != (len(x), self.k):
                raise ValueError(f"forced routes of layer {i}: shape {top.shape}, want {(len(x), self.k)}")
        weights = np.take_along_axis(probs, top, axis=-1)
        if self.norm_topk:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        result.chosen[i] = np.sort(top, axis=-1)
        result.probs[i] = probs
        result.gates[i] = weights
        stacks = {p: m.weight(f"{g}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")}
        types = {p: m.type_name(f"{g}.ffn_{p}_exps.weight") for p in stacks}
        out = np.zeros_like(x)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            xe = x[rows]
            ge = self._rounded(xe, types["gate"]) @ stacks["gate"][e].T
            ue = self._rounded(xe, types["up"]) @ stacks["up"][e].T
            ye = self._rounded(ge / (1.0 + np.exp(-ge)) * ue, types["down"]) @ stacks["down"][e].T
            out[rows] += weights[rows, slot][:, None] * ye
        if m.has(f"{g}.ffn_up_shexp.weight"):
            shared = self.ffn(x, f"{g}.ffn_gate_shexp.weight", f"{g}.ffn_up_shexp.weight", f"{g}.ffn_down_shexp.weight")
            if m.has(f"{g}.ffn_gate_inp_shexp.weight"):
                w = m.weight(f"{g}.ffn_gate_inp_shexp.weight").reshape(1, -1)
                gate = self._rounded(x, m.type_name(f"{g}.ffn_gate_inp_shexp.weight")) @ w.T
                shared = shared / (1.0 + np.exp(-gate))
            out += shared
        return out

    def __call__(self, ids: np.ndarray) -> ExactResult:
        """Logits of the token ids as one sequence from position 0 (what a fresh KV cache sees)."""
        m = self.m
        result = ExactResult(logits=np.empty(0))
        x = m.weight("token_embd.weight")[np.asarray(ids, dtype=np.int64)]
        for i in range(self.layers):
            g = f"blk.{i}"
            x = x + self.attention(self.rms(x, m.weight(f"{g}.attn_norm.weight")), i)
            x = x + self.moe(self.rms(x, m.weight(f"{g}.ffn_norm.weight")), i, result)
        x = self.rms(x, m.weight("output_norm.weight"))
        head = "output.weight" if m.has("output.weight") else "token_embd.weight"
        result.logits = self.linear(x, head)
        return result


def exact_forward(path: str | Path, ids: np.ndarray, act_rounding: str = "none",
                  routes: dict[int, np.ndarray] | None = None) -> ExactResult:
    return Forward(GGUFModel(path), act_rounding, routes)(ids)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--act-rounding", choices=("none", "ggml"), default="none")
    ap.add_argument("--out", type=Path, help="write the logits here (float64, [tokens, vocab])")
    args = ap.parse_args(argv)
    model = GGUFModel(args.gguf)
    vocab = int(model.tensors["token_embd.weight"].shape[1])
    ids = np.random.default_rng(args.seed).integers(0, vocab, args.tokens)
    r = Forward(model, args.act_rounding)(ids)
    if args.out:
        r.logits.tofile(args.out)
    print(f"{args.gguf}: {args.tokens} tokens, max |logit| {np.abs(r.logits).max():.4g}, "
          f"argmax of the last {r.logits[-1].argmax()}")


if __name__ == "__main__":
    main()
