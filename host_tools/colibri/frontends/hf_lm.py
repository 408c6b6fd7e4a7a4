"""Hugging Face MoE causal language models -> Colibri token models (docs/lm.md).

`MixtralForCausalLM`, `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM` and `OlmoeForCausalLM` are
pre-norm decoders with one layout: `model.embed_tokens`, then per decoder layer
`input_layernorm -> self_attn -> + residual`, `post_attention_layernorm -> mlp -> + residual`,
then `model.norm` and `lm_head`. They become

    EMBED, { RESIDUAL_PUSH, RMSNORM, ATTENTION, RESIDUAL_ADD, RESIDUAL_PUSH, RMSNORM, MOE, RESIDUAL_ADD } x L,
    RMSNORM, LINEAR (the head; its weight *is* the embedding table when the model ties them)

- Attention (`self_attn`): q/k/v/o projections with whatever biases they have (Qwen2-MoE's
  `qkv_bias`), grouped-query or multi-query heads, `head_dim` from the projections' shapes,
  per-head q/k RMSNorm (Qwen3-MoE: weight `[head_dim]`) or whole-projection q/k RMSNorm (OLMoE:
  `[heads·head_dim]`), rotary positions with `rope_theta` (the "default" rope type only).
- Sparse MLP blocks go through `hf.py`'s converters (Mixtral: TOPK_SOFTMAX; Qwen2-MoE, Qwen3-MoE,
  OLMoE: SOFTMAX_TOPK renormalised iff `norm_topk_prob`, Qwen2-MoE with its gated shared expert).
- A dense MLP layer (`mlp_only_layers`, `decoder_sparse_step`) is a MoE with one GLU expert and
  TOP1 routing over a zero router: softmax of one logit is exactly 1, so it computes the MLP.

Refused by name (ExportError), because the image would compute something else: a sliding window
shorter than `max_seq_len` (one at or above it never masks anything within the cache), rope types
other than "default" (linear, dynamic, yarn, longrope, llama3 scaling) and partial rotary
embeddings, an attention scale other than head_dim^-0.5, OLMoE's `clip_qkv`, RMSNorms whose
epsilons differ between q and k, decoder layers with modules beyond the four above (post-norms),
and any MLP that is neither a known sparse block nor a plain gate/up/down GLU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..model import format as F
from . import hf  # noqa: F401  registers the sparse-block converters
from .. import image
from ..image.writer import linux_layout
from ..quant import quantize
from ..reference import executor as reference
from ..model.errors import ExportCheckError, ExportError
from .exporter import (
    CONVERTERS, ExportResult, PruneReport, activation_of, check_finite, check_limits, colibri_moe, compare, np32,
)
from ..model.format import DType, ExpertKind, Routing
from ..model.ir import Attention, Embedding, Expert, Graph, Layer, Linear, MoE, ResidualAdd, ResidualPush, RMSNorm

LM_CLASSES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
KV_DTYPES = {"f32": DType.F32, "f16": DType.F16}
LM_RTOL = 1e-4  # f32 logits within 1e-4·(1 + max|logits|) of the model's (issue 12's accuracy bar)
_DECODER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def is_hf_lm(module: object) -> bool:
    return type(module).__name__ in LM_CLASSES


def is_token_module(module: object) -> bool:
    """A module colibri.export writes as a token model: a supported HF causal LM or a colibri.nn.MoETransformer."""
    from . import nn as cnn

    return is_hf_lm(module) or isinstance(module, cnn.MoETransformer)


def _refuse(path: str, module: object, why: str) -> ExportError:
    return ExportError(f"{path} ({type(module).__name__}): {why}; Colibri cannot represent this")


def _rms_norm(mod: nn.Module, path: str) -> RMSNorm:
    """An HF RMSNorm (`weight * x / sqrt(mean(x²) + eps)`) -> RMSNORM."""
    weight = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or eps is None:
        raise _refuse(path, mod, "expected an RMSNorm with a 1-D weight and variance_epsilon")
    if "Gemma" in type(mod).__name__:
        raise _refuse(path, mod, "an RMSNorm scaled by (1 + weight)")
    return RMSNorm(size=int(weight.shape[0]), eps=float(eps), weight=np32(weight))


def _weights(lin: nn.Module, path: str) -> tuple[np.ndarray, np.ndarray | None]:
    if not isinstance(lin, nn.Linear):
        raise _refuse(path, lin, "expected an nn.Linear projection")
    return np32(lin.weight), np32(lin.bias) if lin.bias is not None else None


def _rope_theta(model: nn.Module, head_dim: int) -> float:
    """rope_theta of the model's rotary embedding, refusing anything but plain RoPE over the whole head."""
    cfg = model.config
    rotary = getattr(model.model, "rotary_emb", None)
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", getattr(rotary, "rope_type", "default"))
    if rope_type != "default":
        raise _refuse("model.rotary_emb", rotary, f"rope_type {rope_type!r} (only 'default' RoPE is implemented)")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None or not (math.isfinite(float(theta)) and float(theta) > 0):
        raise _refuse("model.rotary_emb", rotary, f"rope_theta {theta!r}")
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise _refuse("model.rotary_emb", rotary, f"attention_scaling {rotary.attention_scaling} on cos/sin")
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is not None:
        want = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        got = inv_freq.detach().double().numpy()
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=0):
            raise _refuse("model.rotary_emb", rotary, f"inverse frequencies other than rope_theta^(-2j/{head_dim}) "
                          "(partial rotary embedding or scaled RoPE)")
    return float(theta)


def _sliding_window(model: nn.Module, layer_index: int, attn: nn.Module) -> int | None:
    """The window this layer's attention masks to, or None for plain causal attention."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if types is not None:
        return window if types[layer_index] == "sliding_attention" else None
    if getattr(attn, "sliding_window", None) is not None:
        return attn.sliding_window
    if type(model).__name__ == "MixtralForCausalLM":  # Mixtral masks every layer with config.sliding_window
        return window
    return None


def _attention(model: nn.Module, attn: nn.Module, path: str, theta: float, max_seq_len: int,
               kv_dtype: DType) -> Attention:
    cfg = model.config
    q_w, q_b = _weights(attn.q_proj, f"{path}.q_proj")
    k_w, k_b = _weights(attn.k_proj, f"{path}.k_proj")
    v_w, v_b = _weights(attn.v_proj, f"{path}.v_proj")
    o_w, o_b = _weights(attn.o_proj, f"{path}.o_proj")
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    hd = int(getattr(attn, "head_dim", q_w.shape[0] // heads))
    d = int(cfg.hidden_size)
    if (q_w.shape != (heads * hd, d) or k_w.shape != (kv_heads * hd, d) or v_w.shape != k_w.shape
            or o_w.shape != (d, heads * hd) or heads % kv_heads or hd % 2):
        raise _refuse(path, attn, f"projections q {q_w.shape} k {k_w.shape} v {v_w.shape} o {o_w.shape} for "
                                  f"{heads} heads, {kv_heads} kv heads of {hd}")
    scaling = float(getattr(attn, "scaling", hd ** -0.5))
    if not math.isclose(scaling, hd ** -0.5, rel_tol=1e-12):
        raise _refuse(path, attn, f"attention scale {scaling} (the engine scales by head_dim^-0.5)")
    if getattr(cfg, "clip_qkv", None) is not None:
        raise _refuse(path, attn, f"clip_qkv={cfg.clip_qkv} (clamped q/k/v)")
    if getattr(attn, "is_causal", True) is not True:
        raise _refuse(path, attn, "non-causal attention")
    window = _sliding_window(model, int(getattr(attn, "layer_idx", 0) or 0), attn)
    if window is not None and int(window) < max_seq_len:
        raise _refuse(path, attn, f"a sliding window of {window} tokens, shorter than max_seq_len={max_seq_len} "
                                  "(sliding-window attention is not implemented; export with max_seq_len <= "
                                  f"{window})")
    norms, eps = [], set()
    for name, count in (("q_norm", heads), ("k_norm", kv_heads)):
        mod = getattr(attn, name, None)
        if mod is None:
            norms.append(None)
            continue
        norm = _rms_norm(mod, f"{path}.{name}")
        if norm.size not in (hd, count * hd):
            raise _refuse(f"{path}.{name}", mod, f"a norm over {norm.size} values (per head {hd}, or {count * hd})")
        norms.append(norm.weight)
        eps.add(norm.eps)
    if len(eps) > 1:
        raise _refuse(path, attn, f"q_norm and k_norm with different epsilons {sorted(eps)}")
    return Attention(
        n_heads=heads, n_kv_heads=kv_heads, head_dim=hd, q_w=q_w, k_w=k_w, v_w=v_w, o_w=o_w,
        q_b=q_b, k_b=k_b, v_b=v_b, o_b=o_b, q_norm=norms[0], k_norm=norms[1],
        qk_norm_eps=eps.pop() if eps else 0.0, rope_theta=theta, max_seq_len=max_seq_len, kv_dtype=kv_dtype,
    )


def dense_moe(expert: Expert) -> MoE:
    """A dense FFN as a MoE: one expert, TOP1 over a zero router (softmax([0]) = 1 exactly)."""
    d = int(expert.w1.shape[1])
    return MoE(routing=Routing.TOP1, top_k=1, router_weight=np.zeros((1, d), dtype=np.float32),
               experts=[expert], expert_map=np.zeros(1, dtype=np.int32))


def _ffn(mlp: nn.Module, path: str) -> MoE:
    convert = CONVERTERS.get(type(mlp).__name__)
    if convert is not None:
        layers = convert(mlp, path)
        if len(layers) != 1 or not isinstance(layers[0], MoE):
            raise _refuse(path, mlp, "the sparse block did not convert to one MoE layer")
        return layers[0]
    if all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        w1, b1 = _weights(mlp.gate_proj, f"{path}.gate_proj")
        w3, b3 = _weights(mlp.up_proj, f"{path}.up_proj")
        w2, b2 = _weights(mlp.down_proj, f"{path}.down_proj")
        return dense_moe(Expert(kind=ExpertKind.GLU, act=activation_of(mlp.act_fn, f"{path}.act_fn"),
                                w1=w1, b1=b1, w2=w2, b2=b2, w3=w3, b3=b3))
    raise _refuse(path, mlp, "an MLP that is neither a known sparse MoE block nor a gate/up/down GLU")


def build_lm_graph(model: nn.Module, *, max_seq_len: int, max_batch: int = 1, kv_dtype: str = "f32") -> Graph:
    """The token-model graph of a Hugging Face MoE causal LM (see the module docstring)."""
    name = type(model).__name__
    if name not in LM_CLASSES:
        raise ExportError(f"{name} is not a supported causal LM (supported: {', '.join(LM_CLASSES)})")
    if kv_dtype not in KV_DTYPES:
        raise ExportError(f"kv_dtype must be one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= 0xFFFFFFFF:
        raise ExportError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    base = model.model
    embed = base.embed_tokens
    if not isinstance(embed, nn.Embedding) or getattr(embed, "max_norm", None) is not None:
        raise _refuse("model.embed_tokens", embed, "expected a plain nn.Embedding")
    table = np32(embed.weight)
    layers: list[Layer] = [Embedding(table)]
    paths = ["model.embed_tokens"]
    head_dim = int(base.layers[0].self_attn.q_proj.weight.shape[0]) // int(model.config.num_attention_heads)
    head_dim = int(getattr(base.layers[0].self_attn, "head_dim", head_dim))
    theta = _rope_theta(model, head_dim)
    for i, block in enumerate(base.layers):
        path = f"model.layers.{i}"
        extra = {n for n, _ in block.named_children()} - _DECODER_PARTS
        if extra:
            raise _refuse(path, block, f"decoder layer with {sorted(extra)} besides {sorted(_DECODER_PARTS)}")
        attn = _attention(model, block.self_attn, f"{path}.self_attn", theta, max_seq_len, KV_DTYPES[kv_dtype])
        seq = [
            (ResidualPush(), path), (_rms_norm(block.input_layernorm, f"{path}.input_layernorm"), f"{path}.input_layernorm"),
            (attn, f"{path}.self_attn"), (ResidualAdd(), path),
            (ResidualPush(), path),
            (_rms_norm(block.post_attention_layernorm, f"{path}.post_attention_layernorm"), f"{path}.post_attention_layernorm"),
            (_ffn(block.mlp, f"{path}.mlp"), f"{path}.mlp"), (ResidualAdd(), path),
        ]
        layers += [layer for layer, _ in seq]
        paths += [p for _, p in seq]
    layers.append(_rms_norm(base.norm, "model.norm"))
    paths.append("model.norm")
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise _refuse("lm_head", head, "expected an nn.Linear head")
    tied = head.weight is embed.weight or (head.weight.data_ptr() == embed.weight.data_ptr()
                                           and head.weight.shape == embed.weight.shape)
    if getattr(model, "logits_scaling", None) not in (None, 1, 1.0) or getattr(model.config, "final_logit_softcapping", None):
        raise _refuse("lm_head", head, "scaled or soft-capped logits")
    layers.append(Linear(table if tied else np32(head.weight), np32(head.bias) if head.bias is not None else None))
    paths.append("lm_head")
    vocab = table.shape[0]
    if layers[-1].out_features != vocab:
        raise _refuse("lm_head", head, f"{layers[-1].out_features} outputs for a vocabulary of {vocab}")
    return Graph(layers=layers, input_size=vocab, output_size=vocab, max_batch=max_batch, paths=paths)


def _module_logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        if is_hf_lm(model):
            return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        return model(torch.tensor([ids]))[0].float().numpy()


def build_nn_lm_graph(model: nn.Module, *, max_seq_len: int, max_batch: int = 1, kv_dtype: str = "f32") -> Graph:
    """The token-model graph of a colibri.nn.MoETransformer (the same layer program as an HF model's)."""
    if kv_dtype not in KV_DTYPES:
        raise ExportError(f"kv_dtype must be one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= 0xFFFFFFFF:
        raise ExportError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    table = np32(model.embed.weight)
    layers: list[Layer] = [Embedding(table)]
    paths = ["embed"]

    def norm(mod: nn.Module) -> RMSNorm:
        return RMSNorm(size=int(mod.weight.shape[0]), eps=float(mod.eps), weight=np32(mod.weight))

    for i, block in enumerate(model.blocks):
        a, path = block.attn, f"blocks.{i}"
        bias = (lambda lin: np32(lin.bias) if lin.bias is not None else None)
        attn = Attention(
            n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
            q_w=np32(a.q_proj.weight), k_w=np32(a.k_proj.weight), v_w=np32(a.v_proj.weight), o_w=np32(a.o_proj.weight),
            q_b=bias(a.q_proj), k_b=bias(a.k_proj), v_b=bias(a.v_proj), o_b=bias(a.o_proj),
            q_norm=np32(a.q_norm.weight) if a.q_norm is not None else None,
            k_norm=np32(a.k_norm.weight) if a.k_norm is not None else None,
            qk_norm_eps=float(a.q_norm.eps) if a.q_norm is not None else 0.0,
            rope_theta=float(a.rope_theta), max_seq_len=max_seq_len, kv_dtype=KV_DTYPES[kv_dtype],
        )
        layers += [ResidualPush(), norm(block.attn_norm), attn, ResidualAdd(),
                   ResidualPush(), norm(block.moe_norm), colibri_moe(block.moe), ResidualAdd()]
        paths += [path, f"{path}.attn_norm", f"{path}.attn", path, path, f"{path}.moe_norm", f"{path}.moe", path]
    tied = model.head.weight is model.embed.weight
    layers += [norm(model.norm), Linear(table if tied else np32(model.head.weight))]
    paths += ["norm", "head"]
    vocab = table.shape[0]
    return Graph(layers=layers, input_size=vocab, output_size=vocab, max_batch=max_batch, paths=paths)


def _f32_twin(model: nn.Module) -> nn.Module:
    """The model itself when every floating parameter is f32, else an f32 copy (the export check's
    reference for bf16/f16 checkpoints)."""
    if all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point()):
        return model
    import copy

    return copy.deepcopy(model).float()


def reference_logits(data: bytes | Graph, ids: list[int]) -> np.ndarray:
    """The reference's logits for ids from position 0, fed in chunks of max_batch."""
    state = reference.LMState(data if isinstance(data, Graph) else image.read(data))
    step = state.graph.max_batch
    return np.concatenate([state.forward_tokens(ids[i:i + step]) for i in range(0, len(ids), step)])


def check_tokens(vocab: int, n: int) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the export check's input)."""
    return [int(t) for t in np.random.default_rng(0x10C0).integers(0, vocab, n)]


def export_lm(
    model: nn.Module,
    path: str | Path | None = None,
    *,
    max_seq_len: int | None = None,
    max_batch: int = 1,
    dtype: str = "f32",
    kv_dtype: str = "f32",
    compensation: float = quantize.DEFAULT_COMPENSATION,
    keep: Sequence[str] = (),
    int8_act: Sequence[str] = (),
    check: bool = True,
    group: int = quantize.Q4_DEFAULT_GROUP,
    q8: Sequence[str] = (),
    int8_blocks: Sequence[str] | None = None,
    page_aligned: bool | None = None,
    tokenizer=None,
) -> ExportResult:
    """Export a Hugging Face MoE causal LM or a colibri.nn.MoETransformer to a token-model image
    (format v4, docs/lm.md; v5 with q4 weights).

    `max_seq_len` sizes the KV cache (positions), `max_batch` the most tokens one forward call
    takes (the prefill chunk), `kv_dtype` the cache's storage (f32, or f16 to halve it), `dtype` the
    weights as colibri.export's. The export check runs the image (numpy reference) over a fixed
    sequence of min(max_seq_len, 32) tokens and compares every position's logits with the model's:
    within 1e-4·(1 + max|logits|) for f32 (ExportCheckError and nothing written otherwise); for f16
    and q8 the error is only reported, in `max_abs_error`. `page_aligned` as colibri.export's (None: the
    experts on pages of their own once the image would be at least 16 MiB; docs/linux-edge.md).
    `int8_blocks` None (the default) with no `int8_act`: int8 activation blocks on every int8/int4
    layer once the image is that size (`quantize.linux_int8_blocks`); () for none.

    `tokenizer`: a model folder, a tokenizer.json, a SentencePiece tokenizer.model (or a
    `TokenizerSection`) to carry in the image as its tokenizer section (format v6, docs/lm.md);
    one that cannot be the model's is refused before anything is written. None: no section.
    """
    if max_seq_len is None:
        raise ExportError(f"{type(model).__name__} is a token model: give max_seq_len (the KV cache's positions), "
                          "e.g. colibri.export(model, path, max_seq_len=256)")
    if dtype not in quantize.DTYPES:
        raise ExportError(f"dtype must be one of {quantize.DTYPES}, got {dtype!r}")
    if not 1 <= max_batch <= F.MAX_BATCH_LIMIT:
        raise ExportError(f"max_batch must be 1..{F.MAX_BATCH_LIMIT}, got {max_batch}")
    model = model.eval()
    with torch.no_grad():
        build = build_lm_graph if is_hf_lm(model) else build_nn_lm_graph
        f32_graph = build(model, max_seq_len=max_seq_len, max_batch=max_batch, kv_dtype=kv_dtype)
    check_finite(f32_graph)
    check_limits(f32_graph)
    if tokenizer is not None:
        from ..runtime import tokenizer_build

        f32_graph.tokenizer = tokenizer_build.packed_for(tokenizer, f32_graph.vocab_size, str(tokenizer))
    graph = quantize.quantize(f32_graph, dtype, compensation=compensation, keep=keep, int8_act=int8_act,
                              int8_blocks=int8_blocks or (), group=group, q8=q8)
    if int8_blocks is None and not int8_act:  # docs/quantization.md "Activation blocks by default"
        blocks = quantize.linux_int8_blocks(graph, quantize.stored_int8)
        quantize.set_act_forms(graph, (), blocks, quantize.stored_int8)
    data = image.write(graph, page_aligned=linux_layout(graph) if page_aligned is None else page_aligned)
    image.read(data)  # the reader is the validator's twin (tests/lm/test_lm_format.py)
    ids = check_tokens(f32_graph.vocab_size, min(max_seq_len, 32))
    # The image holds the weights widened to f32 exactly; a bf16/f16 model's own forward rounds every
    # activation to 16 bits, which is not what the check measures: compare with its f32 widening.
    want = _module_logits(_f32_twin(model), ids)
    got = reference_logits(data, ids)
    result = compare(f"numpy reference vs PyTorch ({dtype} weights, {kv_dtype} cache)", got, want, rtol=LM_RTOL)
    if check and dtype == "f32" and kv_dtype == "f32" and not result.ok:
        raise ExportCheckError(result.what, result.error, result.tolerance, result.nonfinite_mismatches,
                               "; nothing written (check=False exports anyway)")
    if path is not None:
        image.write_atomically(Path(path), data)
    return ExportResult(image=data, graph=graph, pruned=PruneReport(), max_abs_error=result.error, checks=[result])
