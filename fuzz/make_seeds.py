"""Writes the fuzzers' seed images: small real exports of every dtype and option.

    .venv/bin/python fuzz/make_seeds.py [OUT_DIR [NAME_PART]]    (default fuzz/seeds; only the seeds whose
    name holds NAME_PART)

Each model is tiny on purpose (about 1-2 KB; 9 KB page-aligned) so that libFuzzer's mutations reach
every record quickly; together they cover every weight dtype (f32, f16, q8,
q8 with int8 activations, q4), every routing mode, shared experts with and
without a gate, pruned experts, GLU and MLP experts, every activation,
LayerNorm, RMSNorm, residual blocks, a PAGE_ALIGNED image and int8 weights
of one input column. q8 comes in both model image formats: version 2 (what
the exporter writes: f16 scales, biases in the Q8_PARAMS companions, row
pointers of 1 or 2 bytes, and a companion whose parameters fall back to f32)
and version 1 (f32 scales, 4-byte row pointers); version 3 (one CRC per
tensor payload) page-aligned and not; version 6, token models with a byte-level
BPE and a SentencePiece tokenizer section. The runner
fuzzer also loads two of them (runner-model.clb, runner-lm.clb: the byte-level BPE token model) into
its emulated flash.
"""
from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from colibri import image
from colibri import nn as cnn
from colibri.frontends.exporter import build_graph, export
from colibri.quant.quantize import quantize


def _moe_model(d: int = 4, experts: int = 3, hidden: int = 3, **moe) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, d),
        torch.nn.LayerNorm(d),
        cnn.Residual(cnn.MoE(d, experts, hidden, **moe)),
        torch.nn.RMSNorm(d, eps=1e-6),
        torch.nn.Linear(d, 2),
    )


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.GELU(),
        torch.nn.Linear(4, 4), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4, 4), torch.nn.SiLU(),
        torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, 2),
    )


def _wide_e() -> torch.nn.Module:
    """A Linear whose compensation term has more than 255 entries: 2-byte row pointers in v2."""
    return torch.nn.Sequential(torch.nn.Linear(16, 20), torch.nn.ReLU(), torch.nn.Linear(20, 2))


def _big_bias() -> torch.nn.Module:
    """A bias far off its row's weight step: that companion keeps f32 scales and bias in v2."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[2].bias[0] = 1000.3
    return model


def _narrow() -> torch.nn.Module:
    """One input feature: int8 weights [n, 1], where a rank-1 record would also fit the shape."""
    return torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


Q8 = {"dtype": "q8", "compensation": 0.05, "keep": ["*.router"]}
Q4 = {"dtype": "q4", "compensation": 0.05, "group": 8}
Q8_ACT = {**Q8, "int8_act": ["layers.6", "layers.3.experts.*", "layers.3.shared.*"]}

# name: (model factory, export options); each model is built under its own torch seed.
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], dict]] = {
    "mlp-activations-f32": (_mlp, {}),
    "narrow-q8-int8act": (_narrow, {"dtype": "q8", "int8_act": ["layers.0", "layers.2"]}),
    "top1-f32": (lambda: _moe_model(routing="top1", activation="relu"), {}),
    "topk-softmax-glu-f32": (lambda: _moe_model(routing="topk_softmax", top_k=2, gated=True, activation="silu"), {}),
    "softmax-topk-renorm-f16": (
        lambda: _moe_model(routing="softmax_topk", top_k=2, renormalize=True), {"dtype": "f16"}),
    "dense-shared-gate-f32": (
        lambda: _moe_model(routing="dense", num_shared=2, shared_gate=True, router_bias=True), {}),
    "shared-nogate-pruned-f32": (
        lambda: _moe_model(routing="topk_softmax", top_k=2, num_shared=1), {"prune": [1]}),
    "page-aligned-f32": (lambda: _moe_model(experts=2, routing="top1", gated=True), {"page_aligned": True}),
    # Format version 3 (one CRC per tensor payload): page-aligned q8, and a non-paged f16 one.
    "page-aligned-q8-int8act-v3": (
        lambda: _moe_model(experts=2, routing="topk_softmax", top_k=2, gated=True, num_shared=1),
        {**Q8_ACT, "page_aligned": True}),
    "tensor-crc-f16-v3": (lambda: _moe_model(routing="softmax_topk", top_k=2, num_shared=1, shared_gate=True),
                          {"dtype": "f16", "tensor_crc": True}),
    "softmax-topk-q8": (lambda: _moe_model(routing="softmax_topk", top_k=2, num_shared=1, shared_gate=True), Q8),
    "glu-q8-int8act": (
        lambda: _moe_model(routing="topk_softmax", top_k=2, gated=True, num_shared=1, expert_bias=False), Q8_ACT),
    "dense-pruned-q8-int8act": (
        lambda: _moe_model(routing="dense", router_bias=True, num_shared=1), {**Q8_ACT, "prune": [0]}),
    "wide-e-q8": (_wide_e, {"dtype": "q8", "compensation": 0.85}),
    "big-bias-q8-f32-params": (_big_bias, {"dtype": "q8", "compensation": 0.2}),
    # Format version 5: int4 weights in groups with f16 scales (Q4_PARAMS), odd columns (a zero high
    # nibble ends each row), biases in the companions, E of 1- and 2-byte row pointers, q4 mixed with q8,
    # int8 activations over int4 weights.
    "glu-q4-int8act": (
        lambda: _moe_model(routing="topk_softmax", top_k=2, gated=True, num_shared=1, shared_gate=True),
        {**Q4, "int8_act": ["layers.6", "layers.3.experts.*", "layers.3.shared.*"]}),
    "mlp-q4-odd-columns": (_mlp, {**Q4, "group": 16}),
    "wide-e-q4": (_wide_e, {"dtype": "q4", "compensation": 0.85, "group": 8}),
    "mixed-q4-q8": (lambda: _moe_model(routing="softmax_topk", top_k=2, renormalize=True),
                    {**Q4, "q8": ["layers.0", "layers.3.experts.0.*"]}),
    # Format version 7 (64-bit image size, tensor offsets and sizes), forced on images of every kind
    # the writer otherwise gives versions 1, 2, 3 and 5 (past 4 GiB it picks 7 itself).
    "page-aligned-f32-v7": (lambda: _moe_model(experts=2, routing="top1", gated=True),
                            {"page_aligned": True, "version": 7}),
    "softmax-topk-q8-v7": (lambda: _moe_model(routing="softmax_topk", top_k=2, num_shared=1, shared_gate=True),
                           {**Q8, "version": 7}),
    "glu-q4-int8act-v7": (
        lambda: _moe_model(routing="topk_softmax", top_k=2, gated=True, num_shared=1, shared_gate=True),
        {**Q4, "int8_act": ["layers.6", "layers.3.experts.*", "layers.3.shared.*"], "version": 7}),
    # Format version 1 (quantised with compact=False, written as version 1).
    "softmax-topk-q8-v1": (
        lambda: _moe_model(routing="softmax_topk", top_k=2, num_shared=1, shared_gate=True), {**Q8, "version": 1}),
    "glu-q8-int8act-v1": (
        lambda: _moe_model(routing="topk_softmax", top_k=2, gated=True, num_shared=1, expert_bias=False),
        {**Q8_ACT, "version": 1}),
}


def _token_model_with_tokenizer(kind: str) -> bytes:
    """Format version 6: a tiny token model (embedding, one attention block, head) carrying a
    tokenizer section, byte-level BPE (256 byte tokens, merges, a special token) or SentencePiece
    (control pieces, 256 byte-fallback pieces, scored pieces with spaces)."""
    import numpy as np

    from colibri.image.tokenizer_section import TokenizerSection, pack
    from colibri.model import format as F
    from colibri.model.ir import Attention, Embedding, Graph, Linear, RMSNorm

    T = F.TokenType
    if kind == "bpe":
        extra = [b"th", b"the", b" the", "é".encode(), "🎉".encode()[:2], "🎉".encode()]
        tokens = [bytes([b]) for b in range(256)] + extra + [b"<|endoftext|>"]
        merges = [(ord("t"), ord("h"), 256), (256, ord("e"), 257), (ord(" "), 257, 258), (0xC3, 0xA9, 259),
                  (0xF0, 0x9F, 260), (260, 0x8E, 261)]
        section = TokenizerSection(
            kind=F.TokenizerKind.BYTE_BPE, tokens=tokens,
            types=np.array([T.NORMAL] * (len(tokens) - 1) + [T.CONTROL], np.uint8),
            pre_tokenizer=F.PreTokenizer.BYTE_LEVEL, merges=np.array(merges, np.uint32),
            byte_ids=np.arange(256, dtype=np.uint32), bos=len(tokens) - 1, eos=len(tokens) - 1)
    else:
        pieces = [b"<unk>", b"<s>", b"</s>"] + [bytes([b]) for b in range(256)] + [b" a", b" the", b"ok", "日".encode()]
        types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * 4
        section = TokenizerSection(
            kind=F.TokenizerKind.SENTENCEPIECE_BPE, tokens=pieces, types=np.array(types, np.uint8),
            flags=int(F.TokenizerFlag.ADD_DUMMY_PREFIX | F.TokenizerFlag.BYTE_FALLBACK),
            scores=-np.arange(len(pieces), dtype=np.float32), byte_ids=np.arange(3, 259, dtype=np.uint32),
            bos=1, eos=2, unk=0)
    vocab, d = section.vocab_size + 2, 4  # two padding rows
    rng = np.random.default_rng(26)

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    attn = Attention(n_heads=1, n_kv_heads=1, head_dim=4, q_w=w(4, d), k_w=w(4, d), v_w=w(4, d), o_w=w(d, 4),
                     rope_theta=10000.0, max_seq_len=8, kv_dtype=F.DType.F32)
    table = w(vocab, d)
    g = Graph(layers=[Embedding(table), RMSNorm(d, 1e-5, np.ones(d, np.float32)), attn,
                      RMSNorm(d, 1e-5, np.ones(d, np.float32)), Linear(table)],
              input_size=vocab, output_size=vocab, max_batch=2)
    g.tokenizer = pack(section.padded(vocab))
    return image.write(g)


# Format version 6: token models carrying a tokenizer section (not torch exports: built as graphs).
TOKEN_SEEDS = {"tokenizer-bpe-v6": "bpe", "tokenizer-sentencepiece-v6": "sp"}


def seed_image(factory: Callable[[], torch.nn.Module], opts: dict) -> bytes:
    """The export of one seed model; with "version": 1 in opts, q8 in format version 1. The f16 and
    q8 seeds quantise their routers too (the exporter's default keeps them f32), so the fuzzers keep
    covering F16 and I8 routers, which images may hold."""
    if opts.get("dtype") in ("f16", "q8"):
        opts = {**opts, "quantize_routers": True}
    if opts.get("tensor_crc"):  # version 3 without page alignment: written from the exported graph
        opts = {k: v for k, v in opts.items() if k != "tensor_crc"}
        return image.write(export(factory(), None, max_batch=3, **opts).graph, tensor_crc=True)
    if opts.get("version") == 7:  # written from the exported graph, as the v3 seeds
        opts = dict(opts)
        page_aligned, version = opts.pop("page_aligned", False), opts.pop("version")
        return image.write(export(factory(), None, max_batch=3, **opts).graph, page_aligned=page_aligned,
                           version=version)
    if opts.get("version", 2) >= 2:
        return export(factory(), None, max_batch=3, **opts).image
    opts = dict(opts)
    version = opts.pop("version")
    graph, _ = build_graph(factory().eval(), max_batch=3)
    return image.write(quantize(graph, compact=False, **opts), version=version)


def main(out: Path, only: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (factory, opts) in MODELS.items():
        if only not in name:
            continue
        torch.manual_seed(zlib.crc32(name.encode()))
        data = seed_image(factory, opts)
        (out / f"{name}.clb").write_bytes(data)
        print(f"{name}.clb: {len(data)} bytes")
    for name, kind in TOKEN_SEEDS.items():
        if only in name:
            data = _token_model_with_tokenizer(kind)
            (out / f"{name}.clb").write_bytes(data)
            print(f"{name}.clb: {len(data)} bytes")
    # The runner fuzzer boots these from its emulated flash slots: a feature model, and a token model
    # with a tokenizer (for GENERATE_TEXT).
    if (out / "top1-f32.clb").exists():
        (out / "runner-model.clb").write_bytes((out / "top1-f32.clb").read_bytes())
    if (out / "tokenizer-bpe-v6.clb").exists():
        (out / "runner-lm.clb").write_bytes((out / "tokenizer-bpe-v6.clb").read_bytes())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "seeds",
         sys.argv[2] if len(sys.argv) > 2 else "")
