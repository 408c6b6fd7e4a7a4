"""Small GGUF files written from the tiny random Hugging Face MoE models, in the layout llama.cpp's
convert_hf_to_gguf.py gives them (its metadata keys, tensor names, stacked experts, F32 norms and
routers, and for the `llama` architecture q/k rows permuted for its interleaved RoPE), written with
the `gguf` package's GGUFWriter. What tests/export/test_export_gguf.py imports.

`block_models()` are the same four architectures with every matrix width a multiple of 32, so
Q8_0 and Q4_0 (blocks of 32 columns) can hold every matrix; on the others, as llama.cpp's converter
does, a matrix whose rows are not whole blocks stays F16."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (
    MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

from helpers.hf_lm_models import COMMON, randomised

GGUF_ARCH = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
             "OlmoeForCausalLM": "olmoe"}
# The types Colibri reads, and two it refuses (for the tests of the refusal).
QTYPES = {name: gguf.GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "I32")}
_HF_OF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
          "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
          "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


def block_models() -> dict[str, torch.nn.Module]:
    """The four architectures with matrix widths of whole 32-column blocks (hidden 32, expert and
    dense widths 32 or 64, attention outputs 32 or 64 wide)."""
    mixtral = MixtralConfig(**COMMON, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    qwen2 = Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                           norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1, qkv_bias=True,
                           tie_word_embeddings=True, use_sliding_window=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    qwen3 = Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    olmoe = OlmoeConfig(**COMMON, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return {"mixtral": randomised(MixtralForCausalLM(mixtral), 11),
            "qwen2_moe": randomised(Qwen2MoeForCausalLM(qwen2), 12),
            "qwen3_moe": randomised(Qwen3MoeForCausalLM(qwen3), 13), "olmoe": randomised(OlmoeForCausalLM(olmoe), 14)}


def rope_interleave(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a llama q/k projection: within each head, row j of the
    first half and row j of the second become rows 2j and 2j+1 (the pairs its RoPE rotates)."""
    hd = rows.shape[0] // heads
    split = rows.reshape(heads, 2, hd // 2, *rows.shape[1:])
    return np.ascontiguousarray(np.swapaxes(split, 1, 2).reshape(rows.shape))


def gguf_tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's parameters under llama.cpp's names (float32, numpy order: the GGUF shape reversed)."""
    cfg = model.config
    arch = GGUF_ARCH[type(model).__name__]
    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"token_embd.weight": sd.pop("model.embed_tokens.weight"), "output_norm.weight": sd.pop("model.norm.weight")}
    head = sd.pop("lm_head.weight")
    if not cfg.tie_word_embeddings:
        out["output.weight"] = head
    for name in list(sd):
        _, _, i, rest = name.split(".", 3)
        value = sd.pop(name)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] = [gate; up]
            n = value.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = np.ascontiguousarray(value[:, :n])
            out[f"blk.{i}.ffn_up_exps.weight"] = np.ascontiguousarray(value[:, n:])
            continue
        target = _HF_OF[rest]
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            value = rope_interleave(value, heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            value = rope_interleave(value, kv_heads)
        out[f"blk.{i}.{target}"] = value
    return out


def stored_type(name: str, value: np.ndarray, qtype: str) -> str:
    """The converter's choice: norms, biases, 1-D tensors and routers F32; a matrix whose rows are
    not whole blocks of its type F16."""
    if value.ndim < 2 or name.endswith(("_norm.weight", ".bias")) or "ffn_gate_inp" in name:
        return "F32"
    block = gguf.GGML_QUANT_SIZES[QTYPES[qtype]][0]
    return qtype if value.shape[-1] % block == 0 else "F16"


def encode(value: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "F32":
        return value.astype(np.float32)
    if qtype == "F16":
        return value.astype(np.float16)
    if qtype == "I32":
        return value.astype(np.int32)
    return gguf.quants.quantize(value.astype(np.float32), QTYPES[qtype])


def write_gguf(model: torch.nn.Module, path: Path, qtype: str = "F32", *, tensors: dict[str, np.ndarray] | None = None,
               types: dict[str, str] | None = None, metadata=None, tokenizer: str | Path = "no_vocab",
               pre: str = "gpt-2") -> Path:
    """`model` as a GGUF file of `qtype` (F32, F16, BF16, Q8_0, Q4_0) at `path`. `tensors` replaces
    the converted tensors (to write a malformed file), `types` forces a tensor's type, `metadata(w)`
    may add keys to the writer before it is written. `tokenizer`: "no_vocab" (the default; a token
    list t0, t1, ... is written for the vocabulary checks, marked as no vocabulary), "gpt2" (that
    list with merges, not a byte-level vocabulary), "llama" (that list as SentencePiece pieces with
    scores, <unk> <s> </s> first), or a Hugging Face folder whose tokenizer.model or tokenizer.json
    is written as llama.cpp's converter writes it (`converter_tokenizer`; `pre` names a byte-level
    BPE's pre-tokenizer)."""
    arch = GGUF_ARCH[type(model).__name__]
    tensors = gguf_tensors(model) if tensors is None else tensors
    w = gguf.GGUFWriter(str(path), arch)
    write_metadata(w, model.config, arch, qtype, tokenizer=tokenizer, pre=pre)
    if metadata is not None:
        metadata(w)
    for name, value in tensors.items():
        t = (types or {}).get(name) or stored_type(name, value, qtype)
        data = encode(value, t)
        w.add_tensor(name, data, raw_dtype=QTYPES[t] if t in ("BF16", "Q8_0", "Q4_0", "Q5_0") else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_random_mixtral_q4_0(path: Path, *, hidden: int, layers: int, experts: int, intermediate: int,
                              vocab: int, heads: int = 8, kv_heads: int = 2, seed: int = 0) -> Path:
    """A pure-Q4_0 Mixtral GGUF (llama.cpp's `llama` with experts; norms and routers F32) of random
    blocks at `path`, written one tensor at a time: files of hundreds of MB without the model, or
    even one layer's f32 weights, in memory. Each Q4_0 block gets a random f16 scale in [2^-10, 2^-9)
    and 32 random codes. Widths must be multiples of 32."""
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, intermediate_size=intermediate, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, num_local_experts=experts, num_experts_per_tok=2,
                        tie_word_embeddings=False, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hd = hidden // heads
    plan = [("token_embd.weight", (vocab, hidden), "Q4_0"), ("output_norm.weight", (hidden,), "F32"),
            ("output.weight", (vocab, hidden), "Q4_0")]
    for i in range(layers):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (hidden,), "F32"), (f"{b}.ffn_norm.weight", (hidden,), "F32"),
                 (f"{b}.attn_q.weight", (heads * hd, hidden), "Q4_0"),
                 (f"{b}.attn_k.weight", (kv_heads * hd, hidden), "Q4_0"),
                 (f"{b}.attn_v.weight", (kv_heads * hd, hidden), "Q4_0"),
                 (f"{b}.attn_output.weight", (hidden, heads * hd), "Q4_0"),
                 (f"{b}.ffn_gate_inp.weight", (experts, hidden), "F32"),
                 (f"{b}.ffn_gate_exps.weight", (experts, intermediate, hidden), "Q4_0"),
                 (f"{b}.ffn_up_exps.weight", (experts, intermediate, hidden), "Q4_0"),
                 (f"{b}.ffn_down_exps.weight", (experts, hidden, intermediate), "Q4_0")]
    rng = np.random.default_rng(seed)

    def data(shape: tuple[int, ...], qtype: str) -> np.ndarray:
        if qtype == "F32":
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32) if len(shape) == 1 else \
                (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        blocks = np.frombuffer(rng.bytes(int(np.prod(shape)) // 32 * 18), np.uint8).reshape(-1, 18).copy()
        scales = rng.uniform(2.0**-10, 2.0**-9, blocks.shape[0]).astype("<f2")
        blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(*shape[:-1], shape[-1] // 32 * 18)

    w = gguf.GGUFWriter(str(path), "llama")
    write_metadata(w, cfg, "llama", "Q4_0")
    for name, shape, qtype in plan:
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // 32 * 18), np.dtype(np.uint8),
                              int(np.prod(shape)) // 32 * 18, raw_dtype=QTYPES["Q4_0"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, qtype in plan:
        w.write_tensor_data(data(shape, qtype))
    w.close()
    return path


def write_metadata(w: gguf.GGUFWriter, cfg, arch: str, qtype: str, *, tokenizer: str | Path = "no_vocab",
                   pre: str = "gpt-2") -> None:
    """The converter's metadata keys for a model of config `cfg` (`write_gguf`'s `tokenizer`, `pre`)."""
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts if arch == "llama" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "head_dim", None) and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_file_type(FILE_TYPES[qtype])
    if isinstance(tokenizer, Path):
        converter_tokenizer(w, tokenizer, cfg.vocab_size, pre=pre)
    elif tokenizer == "llama":
        vocab = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, cfg.vocab_size)]
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab)
        w.add_token_types([gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2
                          + [gguf.TokenType.NORMAL] * (cfg.vocab_size - 3))
        w.add_token_scores([-float(i) for i in range(cfg.vocab_size)])
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
        w.add_token_types([gguf.TokenType.CONTROL if i < 2 else gguf.TokenType.NORMAL for i in range(cfg.vocab_size)])
        if tokenizer == "gpt2":
            w.add_tokenizer_pre("default")
            w.add_token_merges([f"t {i}" for i in range(10)])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)


def converter_tokenizer(w: gguf.GGUFWriter, folder: Path, vocab_size: int, *, pre: str = "gpt-2") -> None:
    """The folder's tokenizer as llama.cpp's convert_hf_to_gguf.py writes it: a tokenizer.model as
    `llama` (SentencePiece's pieces, scores and types, through the `sentencepiece` library), else a
    tokenizer.json as `gpt2` (the vocabulary as `tokenizers` spells it, added tokens by their text:
    control when special, user-defined otherwise; `pre` the pre-tokenizer's name, which the
    converter finds by hashing the tokenizer's output); the special ids, merges and chat template
    through the gguf package's SpecialVocab, which reads tokenizer.json, tokenizer_config.json and
    config.json as the converter does. Ids past the tokenizer up to `vocab_size` are [PADn] tokens."""
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    if (folder / "tokenizer.model").is_file():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        scores = [-10000.0] * vocab_size
        for i in range(sp.get_piece_size()):
            tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
            types[i] = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                        else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                        else gguf.TokenType.NORMAL)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores(scores)
        load_merges = False
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        added = tok.get_added_tokens_decoder()
        for text, i in tok.get_vocab(with_added_tokens=False).items():
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
        for i, a in added.items():
            tokens[i] = a.content
            types[i] = gguf.TokenType.CONTROL if a.special else gguf.TokenType.USER_DEFINED
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        load_merges = True
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=load_merges, n_vocab=vocab_size).add_to_gguf(w, quiet=True)


def dequantised(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32 (numpy order), through the gguf package alone."""
    reader = gguf.GGUFReader(path)
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(n) for n in reversed(t.shape.tolist()))) for t in reader.tensors}


def with_weights(model: torch.nn.Module, values: dict[str, np.ndarray]) -> torch.nn.Module:
    """A copy of `model` holding a GGUF's (dequantised) tensors in place of its own: the Hugging Face
    model a quantised GGUF stands for."""
    import copy

    out = copy.deepcopy(model)
    cfg = out.config
    arch = GGUF_ARCH[type(out).__name__]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = out.state_dict()
    with torch.no_grad():
        sd["model.embed_tokens.weight"].copy_(torch.from_numpy(np.array(values["token_embd.weight"])))
        sd["model.norm.weight"].copy_(torch.from_numpy(np.array(values["output_norm.weight"])))
        if "output.weight" in values:
            sd["lm_head.weight"].copy_(torch.from_numpy(np.array(values["output.weight"])))
        for name in sd:
            if not name.startswith("model.layers."):
                continue
            _, _, i, rest = name.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":
                both = np.concatenate([values[f"blk.{i}.ffn_gate_exps.weight"], values[f"blk.{i}.ffn_up_exps.weight"]],
                                      axis=1)
                sd[name].copy_(torch.from_numpy(both))
                continue
            value = values[f"blk.{i}.{_HF_OF[rest]}"]
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                value = _uninterleave(value, heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                value = _uninterleave(value, kv_heads)
            sd[name].copy_(torch.from_numpy(np.array(value)).reshape(sd[name].shape))
    return out


def _uninterleave(rows: np.ndarray, heads: int) -> np.ndarray:
    hd = rows.shape[0] // heads
    return np.swapaxes(rows.reshape(heads, hd // 2, 2, *rows.shape[1:]), 1, 2).reshape(rows.shape)
