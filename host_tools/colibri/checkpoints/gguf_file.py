"""A GGUF file -> a Colibri token model, streamed (issue 26; docs/export.md "GGUF files").

`export_gguf(model.gguf, out.clb, max_seq_len=...)` reads the file with PyPI's `gguf` package (its
`GGUFReader` for the header, the metadata and the tensor infos; `gguf.quants` for the block
encodings), maps llama.cpp's names onto those of the Hugging Face model it was converted from, and
hands the result to the folder path's planner (`hf_folder.build_folder_graph`, `plan_quantisation`,
`image.stream`): one writer, one set of refusals. Tensor data is read with `os.pread` one tensor
(or one expert of a stacked tensor) at a time, never through the reader's mapping, so the file's
pages do not stay resident.

Architectures by llama.cpp's names: `llama` with experts (Mixtral), `qwen2moe`, `qwen3moe`, `olmoe`.
llama.cpp's converter permutes the rows of a `llama` model's q and k projections for its
interleaved RoPE; they are permuted back here, so the engine's half-split RoPE (Hugging Face's)
computes the same attention.

Tensor types F32, F16, BF16, Q8_0 and Q4_0 are read; any other is refused by name. Where a block
encoding maps onto the chosen Colibri dtype exactly, it is carried over and the image's weights are
the GGUF's, value for value (`CARRIED`); everything else is dequantised (exactly, to f32) and
requantised, and `GGUFExport.lines()` reports each weight's error.

Bad input is one line naming the file (and the tensor or metadata key), and nothing is written.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..model.errors import ExportError
from ..model.ir import Graph, Q4Weight, dense
from ..model.walks import weight_slots
from ..quant import quantize as Q
from . import hf_folder
from .gguf_reader import MAX_METADATA_ARRAY, GGUFTokenizer, _gguf, _Meta, _open, tokenizer_metadata

__all__ = ["GGUFCheckpoint", "GGUFExport", "GGUFTokenizer", "GGUFWeight", "MAX_METADATA_ARRAY", "export_gguf",
           "is_gguf", "tokenizer_metadata"]

MAGIC = b"GGUF"
# llama.cpp's architecture names -> the Hugging Face class whose graph the folder path builds.
ARCHS = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
         "olmoe": "OlmoeForCausalLM"}
SOURCE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
# llama.cpp renormalises the top-k routing weights of these (build_moe_ffn's norm_w) unless the file
# says otherwise ({arch}.expert_weights_norm); Mixtral's softmax over the top k is the same thing.
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# Architectures whose decoder layers may be dense (ffn_gate/ffn_up/ffn_down instead of experts):
# the converter writes Qwen-MoE's mlp_only_layers so, though llama.cpp itself loads only all-MoE files.
DENSE_LAYERS = ("qwen2moe", "qwen3moe")
# The Colibri dtype a file's weight matrices suggest when none is asked for.
NATURAL_DTYPE = {"Q4_0": "q4", "Q8_0": "q8", "F16": "f16", "BF16": "f32", "F32": "f32"}
# Where each encoding goes to the image without loss (docs/export.md "What carries over exactly").
CARRIED = {
    ("F32", "f32"), ("F16", "f32"), ("BF16", "f32"), ("Q8_0", "f32"), ("Q4_0", "f32"),  # dequantised exactly
    ("F16", "f16"),
    ("Q4_0", "q4"),  # with --group 8, 16 or 32: the blocks themselves
}


def is_gguf(path: object) -> bool:
    """A .gguf path, or a file that starts with GGUF's magic."""
    if not isinstance(path, (str, Path)):
        return False
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


# ---------------------------------------------------------------------------
# The checkpoint the folder planner reads: Hugging Face names over the GGUF's tensors


@dataclass
class _Entry:
    """A tensor as the planner sees it: all of a GGUF tensor, or one expert of a stacked one."""

    tensor: object  # gguf.ReaderTensor
    shape: tuple[int, ...]  # numpy order, the expert axis dropped
    expert: int | None = None
    unpermute_heads: int | None = None  # llama q/k: rows back from llama.cpp's RoPE order
    as_row: bool = False  # a [d] shared-expert gate read as the [1, d] matrix it is

    @property
    def name(self) -> str:
        return self.tensor.name if self.expert is None else f"{self.tensor.name}[{self.expert}]"


@dataclass
class TensorRecord:
    """How one weight matrix went into the image."""

    tensor: str  # the GGUF tensor (and expert)
    source: str  # its GGUF type
    kind: str  # the image's dtype: f32, f16, q8, q4
    exact: bool  # the image's weights equal the GGUF's dequantised ones
    carried: bool = False  # blocks moved over as they are (Q4_0 -> q4)
    rel_l2: float = 0.0  # otherwise the requantisation's relative L2 error


class GGUFCheckpoint:
    """A GGUF file's metadata and tensors under the names of the Hugging Face model it was converted
    from, read one tensor (or one expert) at a time: what `hf_folder.build_folder_graph` reads."""

    def __init__(self, path: str | Path) -> None:
        self.path = self.folder = self.config_path = Path(path)
        self.reader = reader = _open(self.path)
        self.gguf = _gguf()
        meta = self.meta = _Meta(self.path, reader)
        arch = meta.string("general.architecture", required=True)
        if arch not in ARCHS:
            raise ExportError(f"{self.path}: general.architecture {arch!r} is not a model Colibri exports "
                              f"(supported: {', '.join(ARCHS)}; llama only with experts, as Mixtral)")
        self.arch = meta.arch = arch
        self.tensors: dict[str, object] = {}
        for t in reader.tensors:
            type_name = self.gguf.GGMLQuantizationType(t.tensor_type).name
            if type_name not in SOURCE_TYPES:
                raise ExportError(f"{self.path}: tensor {t.name}: GGUF type {type_name} is not supported "
                                  f"({', '.join(SOURCE_TYPES)}; llama-quantize --pure writes one type throughout)")
            self.tensors[t.name] = t
        self.records: dict[str, TensorRecord] = {}
        self._entries: dict[str, _Entry] = {}
        self.config = self._plan()
        self.context_length = meta.integer(f"{arch}.context_length")

    # -- the planner's interface (hf_folder.Checkpoint's) --

    def names(self) -> list[str]:
        return list(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def file_of(self, name: str) -> Path:
        return self.path

    def shape(self, name: str, want: tuple[int, ...] | None = None) -> tuple[int, ...]:
        if name not in self._entries:
            raise ExportError(f"{self.path}: no tensor for {name} (a {self.arch} model has one)")
        e = self._entries[name]
        if want is not None and e.shape != tuple(want):
            raise ExportError(f"{self.path}: tensor {e.name} has shape {_ne(e.shape)}, the metadata gives "
                              f"{_ne(tuple(want))} (GGUF order)")
        return e.shape

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor as float32 (every source type dequantises exactly), NaN/Inf refused. (`index` is
        the folder's fused-expert slice; a GGUF's experts are entries of their own.)"""
        e = self._entries[name]
        raw = self.raw_rows(e)
        with np.errstate(all="ignore"):  # a NaN or infinite scale: refused below, by count
            out = self.gguf.quants.dequantize(raw, self.gguf.GGMLQuantizationType(e.tensor.tensor_type))
        out = np.ascontiguousarray(out, dtype=np.float32).reshape(e.shape)
        if e.unpermute_heads and len(e.shape) == 1:  # a llama q/k bias
            out = np.ascontiguousarray(unpermute_rows(out, e.unpermute_heads))
        bad = ~np.isfinite(out)
        if bad.any():
            raise ExportError(f"{self.path}: tensor {e.name}: {int(bad.sum())} of {out.size} values are NaN/Inf")
        return out

    def planned_weight(self, name: str, shape: tuple[int, int], load: Callable[[], np.ndarray]) -> GGUFWeight:
        e = self._entries[name]
        return GGUFWeight(name="", where=f"{self.path}: tensor {e.name}", shape=shape, load=load, checkpoint=self,
                          entry=e)

    # -- raw data --

    def type_name(self, e: _Entry) -> str:
        return self.gguf.GGMLQuantizationType(e.tensor.tensor_type).name

    def raw_rows(self, e: _Entry) -> np.ndarray:
        """The entry's bytes as rows [rows, bytes a row] (uint8), the llama q/k rows back in Hugging
        Face's order."""
        t = e.tensor
        block, type_size = self.gguf.GGML_QUANT_SIZES[self.gguf.GGMLQuantizationType(t.tensor_type)]
        cols = e.shape[-1]
        rows = math.prod(e.shape[:-1]) if len(e.shape) > 1 else 1
        row_bytes = cols // block * type_size
        offset = t.data_offset + (e.expert or 0) * rows * row_bytes
        with open(self.path, "rb") as fh:
            raw = os.pread(fh.fileno(), rows * row_bytes, offset)
        if len(raw) != rows * row_bytes:
            raise ExportError(f"{self.path}: truncated in tensor {e.name}")
        out = np.frombuffer(raw, dtype=np.uint8).reshape(rows, row_bytes)
        if e.unpermute_heads and len(e.shape) == 2:
            out = unpermute_rows(out, e.unpermute_heads)
        return out

    # -- metadata and tensor names -> the Hugging Face config and names --

    def _tensor(self, name: str, ne: Sequence[int] | None, *, why: str = "the metadata", optional: bool = False):
        """The GGUF tensor `name`, refused when missing (unless `optional`) or of another shape than
        `ne` (GGUF order: columns first)."""
        t = self.tensors.get(name)
        if t is None:
            if optional:
                return None
            raise ExportError(f"{self.path}: no tensor {name} (a {self.arch} model has it)")
        got = [int(n) for n in t.shape]
        if ne is not None and got != list(ne):
            raise ExportError(f"{self.path}: tensor {name} has shape {got}, {why} gives {list(ne)} (GGUF order)")
        return t

    def _add(self, hf_name: str, t, *, expert: int | None = None, unpermute: int | None = None,
             as_row: bool = False) -> None:
        shape = tuple(int(n) for n in reversed([int(n) for n in t.shape]))
        if expert is not None:
            shape = shape[1:]
        if as_row:
            shape = (1, shape[-1])
        self._entries[hf_name] = _Entry(t, shape, expert, unpermute, as_row)

    def _plan(self) -> dict:
        m, a = self.meta, self.arch
        n_layers = m.integer(f"{a}.block_count", required=True, minimum=1)
        d = m.integer(f"{a}.embedding_length", required=True, minimum=1)
        heads = m.integer(f"{a}.attention.head_count", required=True, minimum=1)
        kv_heads = m.integer(f"{a}.attention.head_count_kv", heads, minimum=1)
        hd = m.integer(f"{a}.attention.key_length", d // heads, minimum=1)
        v_len = m.integer(f"{a}.attention.value_length", hd)
        if v_len != hd:
            raise ExportError(f"{self.path}: metadata {a}.attention.value_length={v_len} differs from key_length "
                              f"{hd}; Colibri cannot represent this")
        rope_dims = m.integer(f"{a}.rope.dimension_count", hd)
        if rope_dims != hd:
            raise ExportError(f"{self.path}: metadata {a}.rope.dimension_count={rope_dims} rotates part of a "
                              f"{hd}-wide head (the engine rotates the whole head); Colibri cannot represent this")
        scaling = m.string(f"{a}.rope.scaling.type", "none")
        factor = m.number(f"{a}.rope.scaling.factor", 1.0)
        if scaling != "none" or factor != 1.0 or "rope_freqs.weight" in self.tensors:
            raise ExportError(f"{self.path}: scaled RoPE ({a}.rope.scaling.type={scaling}, factor {factor:g}, or "
                              "rope_freqs.weight); only plain RoPE is implemented")
        theta = m.number(f"{a}.rope.freq_base", 10000.0)  # llama.cpp's default
        eps = m.number(f"{a}.attention.layer_norm_rms_epsilon", required=True)
        n_exp = m.integer(f"{a}.expert_count", 0)
        k = m.integer(f"{a}.expert_used_count", 0)
        if n_exp == 0:
            raise ExportError(f"{self.path}: {a}.expert_count is 0 or missing: a dense {a} model; Colibri exports "
                              "mixture-of-experts models")
        if not 1 <= k <= n_exp:
            raise ExportError(f"{self.path}: metadata {a}.expert_used_count={k} with {n_exp} experts")
        scale = m.number(f"{a}.expert_weights_scale", 1.0)
        gating = m.integer(f"{a}.expert_gating_func", 1)  # 1: softmax (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE)
        if scale != 1.0 or gating != 1:
            raise ExportError(f"{self.path}: expert routing with {a}.expert_weights_scale={scale:g}, "
                              f"expert_gating_func={gating}; Colibri routes with a softmax of weight 1")
        for key in (f"{a}.attention.clamp_kqv", f"{a}.final_logit_softcapping", f"{a}.attn_logit_softcapping",
                    f"{a}.logit_scale"):
            if m.field(key) is not None:
                raise ExportError(f"{self.path}: metadata {key} (clamped or scaled attention or logits); Colibri "
                                  "cannot represent this")
        window = m.integer(f"{a}.attention.sliding_window", 0)

        embd = self._tensor("token_embd.weight", None)
        shape = [int(n) for n in embd.shape]
        if len(shape) != 2 or shape[0] != d:
            raise ExportError(f"{self.path}: tensor token_embd.weight has shape {shape}, the metadata gives "
                              f"[{d}, vocabulary] (GGUF order)")
        vocab = shape[1]
        tokens = m.array_length("tokenizer.ggml.tokens")
        if tokens is not None and tokens != vocab:
            raise ExportError(f"{self.path}: tokenizer.ggml.tokens holds {tokens} tokens, tensor token_embd.weight "
                              f"{vocab} rows: the vocabulary disagrees with the embedding")
        declared = m.integer(f"{a}.vocab_size")
        if declared is not None and declared != vocab:
            raise ExportError(f"{self.path}: metadata {a}.vocab_size={declared}, tensor token_embd.weight holds "
                              f"{vocab} token rows")
        self._add("model.embed_tokens.weight", embd)
        self._add("model.norm.weight", self._tensor("output_norm.weight", [d]))
        head = self._tensor("output.weight", [d, vocab], why=f"the vocabulary of token_embd.weight ({vocab})",
                            optional=True)
        if head is not None:
            self._add("lm_head.weight", head)

        mixtral = a == "llama"
        expert_ff = m.integer(f"{a}.expert_feed_forward_length" if a in DENSE_LAYERS else f"{a}.feed_forward_length")
        dense_ff = m.integer(f"{a}.feed_forward_length") if a in DENSE_LAYERS else None
        shared_ff = m.integer(f"{a}.expert_shared_feed_forward_length")
        dense_layers: list[int] = []
        known: set[str] = {"token_embd.weight", "output_norm.weight", "output.weight"}
        for i in range(n_layers):
            g = f"blk.{i}"
            h = f"model.layers.{i}"
            names = {
                "attn_norm.weight": (f"{h}.input_layernorm.weight", [d]),
                "ffn_norm.weight": (f"{h}.post_attention_layernorm.weight", [d]),
                "attn_q.weight": (f"{h}.self_attn.q_proj.weight", [d, heads * hd]),
                "attn_k.weight": (f"{h}.self_attn.k_proj.weight", [d, kv_heads * hd]),
                "attn_v.weight": (f"{h}.self_attn.v_proj.weight", [d, kv_heads * hd]),
                "attn_output.weight": (f"{h}.self_attn.o_proj.weight", [heads * hd, d]),
            }
            optional = {
                "attn_q.bias": (f"{h}.self_attn.q_proj.bias", [heads * hd]),
                "attn_k.bias": (f"{h}.self_attn.k_proj.bias", [kv_heads * hd]),
                "attn_v.bias": (f"{h}.self_attn.v_proj.bias", [kv_heads * hd]),
                "attn_output.bias": (f"{h}.self_attn.o_proj.bias", [d]),
            }
            for suffix, (hf, ne) in names.items():
                unpermute = None
                if mixtral and suffix == "attn_q.weight":
                    unpermute = heads
                elif mixtral and suffix == "attn_k.weight":
                    unpermute = kv_heads
                self._add(hf, self._tensor(f"{g}.{suffix}", ne), unpermute=unpermute)
            for suffix, (hf, ne) in optional.items():
                t = self._tensor(f"{g}.{suffix}", ne, optional=True)
                if t is not None:
                    unpermute = heads if mixtral and suffix == "attn_q.bias" else None
                    unpermute = kv_heads if mixtral and suffix == "attn_k.bias" else unpermute
                    self._add(hf, t, unpermute=unpermute)
            for suffix, count in (("attn_q_norm.weight", heads), ("attn_k_norm.weight", kv_heads)):
                t = self.tensors.get(f"{g}.{suffix}")
                if t is not None:
                    got = [int(n) for n in t.shape]
                    if got not in ([hd], [count * hd]):
                        raise ExportError(f"{self.path}: tensor {g}.{suffix} has shape {got}, a norm over one head "
                                          f"([{hd}]) or all {count} ([{count * hd}])")
                    self._add(f"{h}.self_attn.{suffix.split('.')[0].replace('attn_', '')}.weight", t)
            known.update(f"{g}.{s}" for s in list(names) + list(optional) + ["attn_q_norm.weight",
                                                                               "attn_k_norm.weight"])

            moe = f"{g}.ffn_gate_exps.weight" in self.tensors or f"{g}.ffn_gate_inp.weight" in self.tensors
            if not moe:
                if a not in DENSE_LAYERS or f"{g}.ffn_gate.weight" not in self.tensors:
                    raise ExportError(f"{self.path}: no tensor {g}.ffn_gate_inp.weight (every layer of a {a} "
                                      "model routes to experts)")
                up = self._tensor(f"{g}.ffn_up.weight", None)
                ff = dense_ff if dense_ff is not None else int(up.shape[1])
                dense_ff = ff
                for suffix, hf, ne in (("ffn_gate", "gate_proj", [d, ff]), ("ffn_up", "up_proj", [d, ff]),
                                       ("ffn_down", "down_proj", [ff, d])):
                    self._add(f"{h}.mlp.{hf}.weight", self._tensor(f"{g}.{suffix}.weight", ne))
                known.update(f"{g}.{s}.weight" for s in ("ffn_gate", "ffn_up", "ffn_down"))
                dense_layers.append(i)
                continue
            p = f"{h}.block_sparse_moe" if mixtral else f"{h}.mlp"
            self._add(f"{p}.gate.weight", self._tensor(f"{g}.ffn_gate_inp.weight", [d, n_exp]))
            up = self._tensor(f"{g}.ffn_up_exps.weight", None)
            ff = expert_ff if expert_ff is not None else int(up.shape[1]) if len(up.shape) == 3 else 0
            expert_ff = ff
            parts = (("ffn_gate_exps", "w1" if mixtral else "gate_proj", [d, ff, n_exp]),
                     ("ffn_up_exps", "w3" if mixtral else "up_proj", [d, ff, n_exp]),
                     ("ffn_down_exps", "w2" if mixtral else "down_proj", [ff, d, n_exp]))
            for suffix, hf, ne in parts:
                t = self._tensor(f"{g}.{suffix}.weight", ne)
                for e in range(n_exp):
                    self._add(f"{p}.experts.{e}.{hf}.weight", t, expert=e)
            known.update(f"{g}.{s}.weight" for s in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
            if f"{g}.ffn_gate_shexp.weight" in self.tensors:
                if a != "qwen2moe":
                    raise ExportError(f"{self.path}: tensor {g}.ffn_gate_shexp.weight: a shared expert, which a {a} "
                                      "model has not")
                up = self._tensor(f"{g}.ffn_up_shexp.weight", None)
                sff = shared_ff if shared_ff is not None else int(up.shape[1]) if len(up.shape) == 2 else 0
                shared_ff = sff
                for suffix, hf, ne in (("ffn_gate_shexp", "gate_proj", [d, sff]), ("ffn_up_shexp", "up_proj", [d, sff]),
                                       ("ffn_down_shexp", "down_proj", [sff, d])):
                    self._add(f"{p}.shared_expert.{hf}.weight", self._tensor(f"{g}.{suffix}.weight", ne))
                gate = self.tensors.get(f"{g}.ffn_gate_inp_shexp.weight")
                if gate is not None:
                    got = [int(n) for n in gate.shape]
                    if got not in ([d], [d, 1]):
                        raise ExportError(f"{self.path}: tensor {g}.ffn_gate_inp_shexp.weight has shape {got}, the "
                                          f"metadata gives [{d}] (GGUF order)")
                    self._add(f"{p}.shared_expert_gate.weight", gate, as_row=True)
                known.update(f"{g}.{s}.weight" for s in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
                                                         "ffn_gate_inp_shexp"))
        for name in self.tensors:
            if name not in known:
                raise ExportError(f"{self.path}: tensor {name} is not part of a {a} model as Colibri reads it "
                                  f"({n_layers} layers of blk.N.attn_*, blk.N.ffn_*; token_embd, output_norm, output)")

        cfg = {
            "architectures": [ARCHS[a]], "hidden_size": d, "num_hidden_layers": n_layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hd, "rms_norm_eps": eps,
            "rope_theta": theta, "vocab_size": vocab, "hidden_act": "silu", "tie_word_embeddings": head is None,
            "num_experts_per_tok": k, "norm_topk_prob": bool(m.boolean(f"{a}.expert_weights_norm", NORM_TOPK[a])),
        }
        if window:
            cfg["layer_types"], cfg["sliding_window"] = ["sliding_attention"] * n_layers, window
        if mixtral:
            cfg.update(num_local_experts=n_exp, intermediate_size=expert_ff, sliding_window=cfg.get("sliding_window"))
        elif a == "olmoe":
            cfg.update(num_experts=n_exp, intermediate_size=expert_ff)
        else:
            cfg.update(num_experts=n_exp, moe_intermediate_size=expert_ff, intermediate_size=dense_ff,
                       shared_expert_intermediate_size=shared_ff, mlp_only_layers=dense_layers, decoder_sparse_step=1)
        return cfg

    def natural_dtype(self) -> str:
        """The Colibri dtype the file's weight matrices are closest to: that of the type holding most
        of their elements (routers, norms and biases aside)."""
        counts: dict[str, int] = {}
        for name, t in self.tensors.items():
            if len(t.shape) >= 2 and "ffn_gate_inp" not in name:
                type_name = self.gguf.GGMLQuantizationType(t.tensor_type).name
                counts[type_name] = counts.get(type_name, 0) + int(t.n_elements)
        return NATURAL_DTYPE[max(counts, key=counts.get)] if counts else "f32"


def _ne(shape: tuple[int, ...]) -> list[int]:
    return list(reversed(shape))


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q or k projection from llama.cpp's RoPE order (each head's rows interleaved: the
    pairs it rotates together adjacent) back to Hugging Face's (first half, second half)."""
    n = rows.shape[0]
    hd = n // heads
    return rows.reshape(heads, hd // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# ---------------------------------------------------------------------------
# Weights: carried over or requantised, and what each became


def q4_from_q4_0(raw: np.ndarray, cols: int, group: int, bias: np.ndarray | None, gguf) -> Q4Weight | None:
    """Q4_0 blocks [rows, cols/32 · 18 bytes] as a Colibri int4 weight with the same values, or None
    where none exists (a subnormal or non-finite scale; a group wider than 32 columns).

    A Q4_0 block is an f16 scale d and 32 four-bit codes c, value d·(c − 8). Colibri's int4 is
    q·s with q in −8..7 and s ≥ 0, so a block with d < 0 is stored negated: q = 8 − c, s = −d. Its
    code 0 (value −8·d, the block's largest magnitude, which llama.cpp's quantiser always writes)
    would be q = 8: it is stored as 7 with its remaining s in the compensation term E, an f16 that
    holds s exactly. So Q·S + E equals the GGUF's dequantised weights value for value. The layer's
    bias moves into the companion only where f16 holds it exactly."""
    if 32 % group or cols % 32:
        return None
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // 32, 18)
    d = blocks[:, :, :2].copy().view("<f2")[:, :, 0]
    mag = np.abs(d.astype(np.float32))
    if not np.all(np.isfinite(mag)) or np.any((mag > 0) & (mag < Q.F16_MIN_NORMAL)):
        return None
    unit = blocks.copy()
    unit[:, :, :2] = np.frombuffer(np.float16(1).tobytes(), dtype=np.uint8)
    codes = gguf.quants.dequantize(unit.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_0)  # c − 8, as floats
    q = np.rint(codes).astype(np.int8).reshape(rows, cols // 32, 32)
    negative = np.signbit(d)
    q = np.where(negative[:, :, None], -q, q)
    q[mag == 0] = 0
    eight = q == 8
    q[eight] = 7
    q = q.reshape(rows, cols)
    scale_blocks = mag.astype(np.float16)
    rows_e, cols_e = np.nonzero(eight.reshape(rows, cols))
    if rows_e.size and cols > 65536:
        return None
    row_ptr = np.zeros(rows + 1, dtype=np.uint32)
    row_ptr[1:] = np.cumsum(np.bincount(rows_e, minlength=rows))
    val = scale_blocks[rows_e, cols_e // 32].astype(np.float16)
    scale = np.repeat(scale_blocks, 32 // group, axis=1)
    b16 = Q.q4_companion_bias(scale.astype(np.float32), bias)
    if b16 is not None and not np.array_equal(b16.astype(np.float32), bias):
        b16 = None  # the companion's f16 bias would round it: the layer keeps its f32 bias, exactly
    return Q4Weight(q=q, scale=scale, group=group, row_ptr=row_ptr, col=cols_e.astype(np.uint16), val=val, bias=b16)


@dataclass(eq=False)
class GGUFWeight(hf_folder.PlannedWeight):
    """A PlannedWeight that knows its GGUF source: carried over where the encodings agree, else
    requantised with its error recorded."""

    checkpoint: GGUFCheckpoint | None = None
    entry: _Entry | None = None

    def source_is_q4(self) -> bool:
        return self.checkpoint.type_name(self.entry) == "Q4_0"

    def quantised(self):
        ck, e = self.checkpoint, self.entry
        source = ck.type_name(e)
        if self.kind == "q4" and source == "Q4_0":
            carried = q4_from_q4_0(ck.raw_rows(e), self.shape[1], self.group, self.bias, ck.gguf)
            if carried is not None:
                ck.records[self.name] = TensorRecord(e.name, source, self.kind, exact=True, carried=True)
                return carried
        w = self.load()
        out = self.quantise(w)
        got = dense(out)
        exact = bool(np.array_equal(got, w))
        from ..quant.report import rel_l2

        ck.records[self.name] = TensorRecord(e.name, source, self.kind, exact=exact,
                                             rel_l2=0.0 if exact else rel_l2(got, w))
        return out


# ---------------------------------------------------------------------------
# The export


@dataclass
class GGUFExport:
    path: Path
    bytes_written: int
    tensors: int
    version: int
    graph: Graph
    dtype: str
    records: dict[str, TensorRecord] = field(default_factory=dict)  # weight slot name -> how it went in

    def carried(self) -> list[str]:
        return [n for n, r in self.records.items() if r.exact]

    def requantised(self) -> list[str]:
        return [n for n, r in self.records.items() if not r.exact]

    def lines(self) -> list[str]:
        """What went in exactly and what was requantised, with the quantiser report's per-layer
        weight errors (relative L2 against the GGUF's dequantised weights)."""
        out = []
        exact: dict[tuple[str, str], int] = {}
        for r in self.records.values():
            if r.exact:
                exact[r.source, r.kind] = exact.get((r.source, r.kind), 0) + 1
        if exact:
            parts = ", ".join(f"{n} {s} -> {k}" for (s, k), n in sorted(exact.items()))
            out.append(f"exact: {sum(exact.values())} weight matrices hold the GGUF's values ({parts})")
        by_layer: dict[str, list[tuple[str, TensorRecord]]] = {}
        for name, r in self.records.items():
            if not r.exact:
                by_layer.setdefault(".".join(name.split(".")[:2]), []).append((name, r))
        for layer, items in by_layer.items():
            errs = [r.rel_l2 for _, r in items]
            kinds = ", ".join(sorted({f"{r.source} -> {r.kind}" for _, r in items}))
            out.append(f"weights of {layer}: {len(errs)} requantised ({kinds}), rel L2 mean {np.mean(errs):.3e} "
                       f"max {max(errs):.3e}")
        return out


def missing_max_seq_len(source: GGUFCheckpoint | str | Path) -> ExportError:
    """The error for a GGUF export without max_seq_len, naming the file's context_length."""
    ck = source if isinstance(source, GGUFCheckpoint) else GGUFCheckpoint(source)
    known = f" (the file's context_length is {ck.context_length})" if ck.context_length else ""
    return ExportError(f"{ck.path}: a token model needs max_seq_len, the KV cache's positions{known}: "
                       "colibri.export(FILE, path, max_seq_len=N) or --max-seq-len N")


def export_gguf(path_in: str | Path, path: str | Path, *, max_seq_len: int | None = None, max_batch: int = 1,
                dtype: str | None = None, kv_dtype: str = "f32", compensation: float = Q.DEFAULT_COMPENSATION,
                keep: Sequence[str] = (), int8_act: Sequence[str] = (), int8_blocks: Sequence[str] | None = None,
                group: int = Q.Q4_DEFAULT_GROUP, q8: Sequence[str] = (), check: bool = True,
                on_tensor: Callable[[int, int, int], None] | None = None,
                page_aligned: bool | None = None, tokenizer: bool | str | Path = True) -> GGUFExport:
    """Export a GGUF file to a token-model image at `path`, one tensor in memory at a time.

    The options are `hf_folder.export_folder`'s; `dtype=None` takes the file's own (`natural_dtype`:
    Q4_0 -> q4, Q8_0 -> q8, F16 -> f16, BF16 and F32 -> f32). `tokenizer` (default True): the file's
    tokenizer metadata becomes the image's tokenizer section (`gguf_tokenizer`), if it has a
    vocabulary; a path (a folder, tokenizer.json or tokenizer.model) takes it from there instead;
    False leaves it out. A kind Colibri does not carry is refused by name before anything is written."""
    if path is None:
        raise ExportError("a streamed export writes a file: give the output path")
    ck = GGUFCheckpoint(path_in)
    if max_seq_len is None:
        raise missing_max_seq_len(ck)
    dtype = ck.natural_dtype() if dtype is None else dtype
    graph = hf_folder.build_folder_graph(ck, max_seq_len=max_seq_len, max_batch=max_batch, kv_dtype=kv_dtype)
    if tokenizer is not False:
        from ..runtime import tokenizer_build

        if tokenizer is True:
            from .gguf_tokenizer import section_from_gguf

            section = section_from_gguf(ck.path)
            if section is not None:
                graph.tokenizer = tokenizer_build.packed_for(section, graph.vocab_size, str(ck.path))
        else:
            graph.tokenizer = tokenizer_build.packed_for(tokenizer, graph.vocab_size, str(tokenizer))
    result = hf_folder.export_graph(ck, graph, path, dtype=dtype, compensation=compensation, keep=keep,
                                    int8_act=int8_act, int8_blocks=int8_blocks, group=group, q8=q8, check=check,
                                    on_tensor=on_tensor, page_aligned=page_aligned)
    records = {}
    done: set[int] = set()
    for _, owner, attr in weight_slots(graph):
        w = getattr(owner, attr)
        if not isinstance(w, GGUFWeight) or id(w) in done:
            continue
        done.add(id(w))
        records[w.name] = ck.records.get(w.name) or TensorRecord(w.entry.name, ck.type_name(w.entry), w.kind,
                                                                 exact=True)  # f32: dequantised exactly
    return GGUFExport(path=result.path, bytes_written=result.bytes_written, tensors=result.tensors,
                      version=result.version, graph=graph, dtype=dtype, records=records)

