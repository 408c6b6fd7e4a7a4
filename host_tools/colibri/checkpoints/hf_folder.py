"""A Hugging Face model folder -> a Colibri token model, streamed (issue 26; docs/lm.md).

`export_folder(DIR, out.clb, max_seq_len=...)` reads `config.json`, plans the image from the config
and the tensors' shapes (the safetensors headers), then reads, quantises and writes one tensor at a
time (`image.stream`): peak memory is a few tensors, never the model. No torch: the shards are
opened with the `safetensors` library (numpy), bf16 widened to f32 by shifting its bits (numpy has
no bfloat16; bf16 is the top half of an f32, so the widening is exact).

The graph is the one `hf_lm.build_lm_graph` builds from the loaded model, with the same refusals,
decided from the config instead of the modules: on every model both paths export, the image is byte
for byte the in-memory export's (tests/export/test_export_hf_folder.py). Each weight matrix is a `PlannedWeight`
that `image.writer.layout` asks for its records and that makes its payloads when written.

Bad input is one line naming the file and the tensor, and nothing is written: a missing or
truncated shard, a missing tensor, a tensor of the wrong shape or dtype, NaN/Inf weights, a config
the engine would compute differently, a vocabulary that disagrees with the embedding.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..image import codecs, reader
from ..model import format as F
from ..model.errors import ExportError
from ..model.format import Act, DType, ExpertKind, Routing
from ..model.ir import Attention, Embedding, Expert, Graph, Layer, Linear, MoE, ResidualAdd, ResidualPush, RMSNorm
from ..model.walks import BIAS_OF, act_forms, act_targets, act_weights, name_matches, weight_slots
from ..model.walks import where as _where
from ..quant import quantize as Q

LM_CLASSES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
KV_DTYPES = {"f32": DType.F32, "f16": DType.F16}
# config.hidden_act -> the engine's activation (transformers' ACT2FN names).
HF_ACTS = {"silu": Act.SILU, "swish": Act.SILU, "gelu": Act.GELU_ERF, "gelu_new": Act.GELU_TANH,
           "gelu_pytorch_tanh": Act.GELU_TANH, "relu": Act.RELU, "tanh": Act.TANH, "sigmoid": Act.SIGMOID}
SOURCE_DTYPES = ("F32", "F16", "BF16")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_folder(path: object) -> bool:
    return isinstance(path, (str, Path)) and Path(path).is_dir()


# ---------------------------------------------------------------------------
# The checkpoint: config.json and safetensors shards


class Checkpoint:
    """A Hugging Face folder's config and tensors, read one tensor at a time."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.folder = Path(folder)
        cfg_path = self.config_path = self.folder / "config.json"
        if not cfg_path.is_file():
            raise ExportError(f"{cfg_path}: missing (a Hugging Face model folder has config.json)")
        try:
            self.config = json.loads(cfg_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ExportError(f"{cfg_path}: not JSON ({_one_line(exc)})") from None
        check_config_types(self.config, cfg_path)
        if (self.folder / INDEX).is_file():
            index_path = self.folder / INDEX
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise ExportError(f"{index_path}: not a safetensors index (no weight_map: {_one_line(exc)})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v and "/" not in v
                                                           for v in weight_map.values()):
                raise ExportError(f"{index_path}: weight_map must map tensor names to shard file names in the folder")
            self.where = {name: self.folder / shard for name, shard in weight_map.items()}
        elif (self.folder / SINGLE).is_file():
            self.where = None  # filled from the one file's header below
        else:
            raise ExportError(f"{self.folder}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")
        shards = sorted(set(self.where.values())) if self.where is not None else [self.folder / SINGLE]
        self._entries: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}  # name -> file, dtype, shape, offset
        for shard in shards:
            if not shard.is_file():
                named = next(n for n, s in self.where.items() if s == shard)
                raise ExportError(f"{shard}: missing shard (the index puts tensor {named} there)")
            try:
                with safe_open(shard, framework="numpy") as f:
                    names = list(f.keys())
                    info = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in names}
            except (SafetensorError, OSError) as exc:  # a truncated or corrupt header, an unreadable file
                raise ExportError(f"{shard}: not a readable safetensors file ({_one_line(exc)})") from None
            offsets, data_start = _data_offsets(shard)  # safe_open has checked they cover the file exactly
            for n in names:
                begin, _ = offsets[n]
                if self.where is not None and self.where.get(n) != shard:
                    continue  # a tensor the index places elsewhere
                self._entries[n] = (shard, info[n][0], info[n][1], data_start + begin)
        if self.where is not None:
            for n, shard in self.where.items():
                if n not in self._entries:
                    raise ExportError(f"{shard}: has no tensor {n}, which {INDEX} puts there")

    def names(self) -> list[str]:
        return list(self._entries)

    def planned_weight(self, name: str, shape: tuple[int, int], load: Callable[[], np.ndarray]) -> PlannedWeight:
        """The weight matrix `name` (or a slice of it that `load` reads), made when written."""
        return PlannedWeight(name="", where=f"{self.file_of(name)}: tensor {name}", shape=shape, load=load)

    def has(self, name: str) -> bool:
        return name in self._entries

    def file_of(self, name: str) -> Path:
        return self._entries[name][0] if name in self._entries else self.folder

    def shape(self, name: str, want: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The tensor's shape, refusing a missing tensor, a dtype other than F32/F16/BF16 and, with
        `want`, any other shape."""
        if name not in self._entries:
            raise ExportError(f"{self.folder}: no tensor {name} in the checkpoint (config.json "
                              f"{self.config.get('architectures', ['?'])[0]} needs it)")
        file, dtype, shape, _ = self._entries[name]
        if dtype not in SOURCE_DTYPES:
            raise ExportError(f"{file}: tensor {name} is {dtype}; Colibri reads {', '.join(SOURCE_DTYPES)} weights")
        if want is not None and shape != tuple(want):
            raise ExportError(f"{file}: tensor {name} has shape {list(shape)}, config.json gives {list(want)}")
        return shape

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor as float32 (exact for all three source dtypes), refusing NaN/Inf; with `index`,
        only `tensor[index]` (one expert of a fused [E, ...] tensor) is read."""
        file, dtype, shape, offset = self._entries[name]
        item = 4 if dtype == "F32" else 2
        if index is not None:
            shape = shape[1:]
            offset += index * math.prod(shape) * item
            name = f"{name}[{index}]"
        count = math.prod(shape)
        with open(file, "rb") as fh:
            fh.seek(offset)
            raw = fh.read(count * item)
        if len(raw) != count * item:
            raise ExportError(f"{file}: truncated in tensor {name}")
        if dtype == "F32":
            out = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        elif dtype == "F16":
            out = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        else:  # BF16: the high 16 bits of an f32
            out = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        del raw
        out = out.reshape(shape)
        bad = ~np.isfinite(out)
        if bad.any():
            raise ExportError(f"{file}: tensor {name}: {int(bad.sum())} of {out.size} values are NaN/Inf")
        return out


# What each config.json key the graph reads must hold (None counts as absent). Sizes and counts are
# positive; a wrong type or range is refused here, by name, before any arithmetic uses it.
_POSITIVE = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
             "decoder_sparse_step")
_COUNTS = ("shared_expert_intermediate_size", "num_experts", "sliding_window", "max_window_layers")
_NUMBERS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "clip_qkv", "final_logit_softcapping",
            "logits_scaling")
_FLAGS = ("tie_word_embeddings", "norm_topk_prob", "use_sliding_window")
_STRINGS = ("hidden_act",)
_DICTS = ("rope_parameters", "rope_scaling")


def check_config_types(cfg: object, cfg_path: Path) -> None:
    """Refuse a config.json whose keys the graph reads hold the wrong kind of value."""
    if not isinstance(cfg, dict):
        raise ExportError(f"{cfg_path}: not a JSON object")

    def bad(key: str, value: object, what: str) -> ExportError:
        return ExportError(f"{cfg_path}: {key} is {json.dumps(value)[:40]}, {what} is expected")

    def integer(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key, value in cfg.items():
        if value is None:
            continue
        if key in _POSITIVE and not (integer(value) and value >= 1):
            raise bad(key, value, "a positive integer")
        if key in _COUNTS and not (integer(value) and value >= 0):
            raise bad(key, value, "a non-negative integer")
        if key in _NUMBERS and not number(value):
            raise bad(key, value, "a number")
        if key in _FLAGS and not isinstance(value, bool):
            raise bad(key, value, "true or false")
        if key in _STRINGS and not isinstance(value, str):
            raise bad(key, value, "a string")
        if key in _DICTS:
            if not isinstance(value, dict):
                raise bad(key, value, "an object")
            for inner in ("rope_type", "type"):
                if inner in value and not isinstance(value[inner], str):
                    raise bad(f"{key}.{inner}", value[inner], "a string")
            for inner in ("rope_theta", "partial_rotary_factor", "factor"):
                if value.get(inner) is not None and not number(value[inner]):
                    raise bad(f"{key}.{inner}", value[inner], "a number")
        names = isinstance(value, list) and all(isinstance(a, str) for a in value)
        if key == "architectures" and not (names and value):
            raise bad(key, value, "a list of class names")
        if key == "mlp_only_layers" and not (isinstance(value, list) and all(integer(v) for v in value)):
            raise bad(key, value, "a list of layer indices")
        if key == "layer_types" and not names:
            raise bad(key, value, "a list of layer kinds")
    n = cfg.get("num_hidden_layers")
    if isinstance(cfg.get("layer_types"), list) and integer(n) and len(cfg["layer_types"]) < n:
        raise ExportError(f"{cfg_path}: layer_types names {len(cfg['layer_types'])} layers of num_hidden_layers={n}")


def _data_offsets(shard: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """Each tensor's byte range in the shard's data section and where that section starts: the
    safetensors header (a u64 length, then JSON) that safe_open has already validated."""
    with open(shard, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}, 8 + n


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ---------------------------------------------------------------------------
# Weights made when written


@dataclass(eq=False)
class PlannedWeight:
    """A weight matrix that is read, quantised and turned into image payloads only when the writer
    reaches it. `kind` (f32, f16, q8, q4) is decided at planning, as `quantize.quantize` decides it;
    `bias` travels in the companion when `absorbs_bias` (q8 compact always; q4 where f16 holds it)."""

    name: str  # the quantiser's slot name (layers.3.experts.1.w1)
    where: str  # the checkpoint tensor it comes from, for errors
    shape: tuple[int, int]
    load: Callable[[], np.ndarray]
    kind: str = "f32"
    bias: np.ndarray | None = None
    compensation: float = Q.DEFAULT_COMPENSATION
    group: int = Q.Q4_DEFAULT_GROUP
    graph_where: str = ""

    @property
    def ndim(self) -> int:
        return 2

    @property
    def image_dtype(self) -> DType:
        """The weight's tensor dtype in the image (what `image.writer.has_int4` asks)."""
        return {"f32": DType.F32, "f16": DType.F16, "q8": DType.I8, "q4": DType.I4}[self.kind]

    def source_is_q4(self) -> bool:
        """Whether the source holds this matrix in int4 already (a GGUF's Q4_0; never a folder's)."""
        return False

    def quantised(self):
        return self.quantise(self.load())

    def quantise(self, w: np.ndarray):
        """`w` (this weight's f32 values) in the planned kind."""
        try:
            if self.kind == "q8":
                return Q.quantize_q8(w, self.compensation, bias=self.bias, compact=True)
            if self.kind == "q4":
                return Q.quantize_q4(w, self.compensation, group=self.group, bias=self.bias)
            if self.kind == "f16":
                return Q.quantize_f16(w)
        except ExportError as exc:
            raise ExportError(f"{self.where}: {self.graph_where}: {exc}; keep it in f32 with --keep {self.name}") from None
        return w

    def absorbs_bias(self) -> bool:
        if self.bias is None or self.kind not in ("q8", "q4"):
            return False
        if self.kind == "q8":
            return True
        return self.quantised().bias is not None  # q4: decided by the weight's scales (planning reads it once)

    def image_entries(self, version: int):
        rows, cols = self.shape
        held: dict[str, object] = {}

        def weight():
            held["w"] = self.quantised()
            return held["w"]

        if self.kind == "q8":
            return [(lambda: np.ascontiguousarray(weight().q, dtype=np.int8).tobytes(), DType.I8, rows, cols, 2),
                    (lambda: codecs.q8_params_payload(held.pop("w"), version), DType.Q8_PARAMS, rows, cols, 2)]
        if self.kind == "q4":
            return [(lambda: codecs.q4_pack(weight().q), DType.I4, rows, cols, 2),
                    (lambda: codecs.q4_params_payload(held.pop("w")), DType.Q4_PARAMS, rows, cols, 2)]
        if self.kind == "f16":
            return [(lambda: np.ascontiguousarray(self.quantised().data, dtype="<f2").tobytes(), DType.F16, rows, cols, 2)]
        return [(lambda: np.ascontiguousarray(self.load(), dtype="<f4").tobytes(), DType.F32, rows, cols, 2)]


# ---------------------------------------------------------------------------
# The graph, from config.json and the tensors' shapes


def _refuse(cfg_path: Path, what: str) -> ExportError:
    return ExportError(f"{cfg_path}: {what}; Colibri cannot represent this")


class _Builder:
    def __init__(self, ck: Checkpoint) -> None:
        self.ck = ck
        self.cfg = ck.config
        self.cfg_path = ck.config_path
        self.arch = (self.cfg.get("architectures") or ["?"])[0]

    def get(self, key: str, default=None):
        return self.cfg.get(key, default)

    def need(self, key: str):
        if key not in self.cfg or self.cfg[key] is None:
            raise ExportError(f"{self.cfg_path}: no {key!r} ({self.arch} needs it)")
        return self.cfg[key]

    def vector(self, name: str, size: int) -> np.ndarray:
        self.ck.shape(name, (size,))
        return self.ck.read(name)

    def bias(self, name: str, size: int) -> np.ndarray | None:
        return self.vector(name, size) if self.ck.has(name) else None

    def matrix(self, name: str, shape: tuple[int, int], load: Callable[[], np.ndarray] | None = None) -> PlannedWeight:
        if load is None:
            self.ck.shape(name, shape)
            ck = self.ck
            load = lambda: ck.read(name)  # noqa: E731
        return self.ck.planned_weight(name, shape, load)

    def norm(self, name: str, size: int, eps: float) -> RMSNorm:
        return RMSNorm(size=size, eps=eps, weight=self.vector(name, size))

    def act(self) -> Act:
        name = self.get("hidden_act", "silu")
        if name not in HF_ACTS:
            raise _refuse(self.cfg_path, f"hidden_act {name!r} (Colibri has {', '.join(HF_ACTS)})")
        return HF_ACTS[name]

    def rope_theta(self, head_dim: int) -> float:
        params = self.get("rope_parameters") or self.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _refuse(self.cfg_path, f"rope_type {rope_type!r} (only 'default' RoPE is implemented)")
        partial = params.get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise _refuse(self.cfg_path, f"partial_rotary_factor {partial} (the engine rotates the whole head)")
        theta = params.get("rope_theta", self.get("rope_theta"))
        if theta is None or not (math.isfinite(float(theta)) and float(theta) > 0):
            raise _refuse(self.cfg_path, f"rope_theta {theta!r}")
        return float(theta)

    def window(self, i: int) -> int | None:
        types, window = self.get("layer_types"), self.get("sliding_window")
        if types is not None:
            return window if types[i] == "sliding_attention" else None
        if self.arch == "MixtralForCausalLM":
            return window
        if self.get("use_sliding_window") and i >= int(self.get("max_window_layers", 0)):
            return window
        return None

    def attention(self, i: int, theta: float, max_seq_len: int, kv_dtype: DType, eps: float) -> Attention:
        p = f"model.layers.{i}.self_attn"
        d = int(self.need("hidden_size"))
        heads = int(self.need("num_attention_heads"))
        kv_heads = int(self.get("num_key_value_heads") or heads)
        hd = int(self.get("head_dim") or d // heads)
        if heads % kv_heads or hd % 2:
            raise _refuse(self.cfg_path, f"{heads} heads, {kv_heads} kv heads of {hd}")
        if self.get("clip_qkv") is not None:
            raise _refuse(self.cfg_path, f"clip_qkv={self.get('clip_qkv')} (clamped q/k/v)")
        window = self.window(i)
        if window is not None and int(window) < max_seq_len:
            raise _refuse(self.cfg_path, f"a sliding window of {window} tokens in layer {i}, shorter than "
                                         f"max_seq_len={max_seq_len} (sliding-window attention is not implemented; "
                                         f"export with --max-seq-len {window} or less)")
        q = self.matrix(f"{p}.q_proj.weight", (heads * hd, d))
        k = self.matrix(f"{p}.k_proj.weight", (kv_heads * hd, d))
        v = self.matrix(f"{p}.v_proj.weight", (kv_heads * hd, d))
        o = self.matrix(f"{p}.o_proj.weight", (d, heads * hd))
        norms = []
        for name, count in (("q_norm", heads), ("k_norm", kv_heads)):
            t = f"{p}.{name}.weight"
            if not self.ck.has(t):
                norms.append(None)
                continue
            size = self.ck.shape(t)
            if len(size) != 1 or size[0] not in (hd, count * hd):
                raise ExportError(f"{self.ck.file_of(t)}: tensor {t} has shape {list(size)}, a norm over one head "
                                  f"({hd}) or all {count} ({count * hd})")
            norms.append(self.vector(t, size[0]))
        return Attention(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=hd, q_w=q, k_w=k, v_w=v, o_w=o,
            q_b=self.bias(f"{p}.q_proj.bias", heads * hd), k_b=self.bias(f"{p}.k_proj.bias", kv_heads * hd),
            v_b=self.bias(f"{p}.v_proj.bias", kv_heads * hd), o_b=self.bias(f"{p}.o_proj.bias", d),
            q_norm=norms[0], k_norm=norms[1], qk_norm_eps=eps if any(n is not None for n in norms) else 0.0,
            rope_theta=theta, max_seq_len=max_seq_len, kv_dtype=kv_dtype,
        )

    def glu(self, prefix: str, names: tuple[str, str, str], hidden: int, d: int, act: Act) -> Expert:
        gate, up, down = (f"{prefix}.{n}.weight" for n in names)
        for n in (gate, up, down):
            if self.ck.has(n.replace(".weight", ".bias")):
                raise ExportError(f"{self.ck.file_of(n)}: tensor {n.replace('.weight', '.bias')}: a biased expert "
                                  f"projection, which {self.arch} has not")
        return Expert(kind=ExpertKind.GLU, act=act, w1=self.matrix(gate, (hidden, d)), w3=self.matrix(up, (hidden, d)),
                      w2=self.matrix(down, (d, hidden)))

    def experts(self, prefix: str, n: int, hidden: int, d: int, act: Act, names: tuple[str, str, str]) -> list[Expert]:
        fused = f"{prefix}.gate_up_proj"
        if self.ck.has(fused):  # transformers 5's fused layout: gate_up_proj [E, 2I, H] = [w1; w3], down_proj [E, H, I]
            self.ck.shape(fused, (n, 2 * hidden, d))
            self.ck.shape(f"{prefix}.down_proj", (n, d, hidden))
            ck = self.ck
            out = []
            for e in range(n):
                w1 = self.matrix(fused, (hidden, d), lambda e=e: ck.read(fused, e)[:hidden].copy())
                w3 = self.matrix(fused, (hidden, d), lambda e=e: ck.read(fused, e)[hidden:].copy())
                w2 = self.matrix(f"{prefix}.down_proj", (d, hidden), lambda e=e: ck.read(f"{prefix}.down_proj", e))
                out.append(Expert(kind=ExpertKind.GLU, act=act, w1=w1, w3=w3, w2=w2))
            return out
        return [self.glu(f"{prefix}.{e}", names, hidden, d, act) for e in range(n)]

    def ffn(self, i: int, d: int) -> MoE:
        act = self.act()
        if self.arch == "MixtralForCausalLM":
            p = f"model.layers.{i}.block_sparse_moe"
            if not self.ck.has(f"{p}.gate.weight") and self.ck.has(f"model.layers.{i}.mlp.gate.weight"):
                p = f"model.layers.{i}.mlp"
            n, k = int(self.need("num_local_experts")), int(self.need("num_experts_per_tok"))
            hidden = int(self.need("intermediate_size"))
            router = self.matrix(f"{p}.gate.weight", (n, d))
            if not 1 <= k <= n:
                raise _refuse(self.cfg_path, f"num_experts_per_tok={k} with {n} experts")
            experts = self.experts(f"{p}.experts", n, hidden, d, act, ("w1", "w3", "w2"))
            return MoE(routing=Routing.TOPK_SOFTMAX, top_k=k, router_weight=router,
                       router_bias=self.bias(f"{p}.gate.bias", n), experts=experts,
                       expert_map=np.arange(n, dtype=np.int32))
        p = f"model.layers.{i}.mlp"
        n = int(self.get("num_experts") or self.get("num_local_experts") or 0)  # attribute_map aliases
        step = int(self.get("decoder_sparse_step") or 1)
        sparse = n > 0 and i not in (self.get("mlp_only_layers") or []) and (i + 1) % step == 0
        if not sparse:
            hidden = int(self.need("intermediate_size"))
            e = self.glu(p, ("gate_proj", "up_proj", "down_proj"), hidden, d, act)
            return MoE(routing=Routing.TOP1, top_k=1, router_weight=np.zeros((1, d), dtype=np.float32),
                       experts=[e], expert_map=np.zeros(1, dtype=np.int32))
        k = int(self.need("num_experts_per_tok"))
        if not 1 <= k <= n:
            raise _refuse(self.cfg_path, f"num_experts_per_tok={k} with {n} experts")
        hidden = int(self.need("intermediate_size" if self.arch == "OlmoeForCausalLM" else "moe_intermediate_size"))
        router = self.matrix(f"{p}.gate.weight", (n, d))
        experts = self.experts(f"{p}.experts", n, hidden, d, act, ("gate_proj", "up_proj", "down_proj"))
        shared, gate = [], None
        if self.ck.has(f"{p}.shared_expert.gate_proj.weight"):
            sh = int(self.need("shared_expert_intermediate_size"))
            if sh > 0:
                shared = [self.glu(f"{p}.shared_expert", ("gate_proj", "up_proj", "down_proj"), sh, d, act)]
                if self.ck.has(f"{p}.shared_expert_gate.weight"):
                    if self.ck.has(f"{p}.shared_expert_gate.bias"):
                        raise ExportError(f"{self.ck.file_of(p + '.shared_expert_gate.bias')}: tensor "
                                          f"{p}.shared_expert_gate.bias: a shared gate with a bias; Colibri cannot "
                                          "represent this")
                    gate = self.matrix(f"{p}.shared_expert_gate.weight", (1, d))
        return MoE(routing=Routing.SOFTMAX_TOPK, top_k=k, router_weight=router,
                   router_bias=self.bias(f"{p}.gate.bias", n), experts=experts,
                   expert_map=np.arange(n, dtype=np.int32), renormalize=bool(self.get("norm_topk_prob", False)),
                   shared=shared, shared_gate=gate)


_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "block_sparse_moe")


def build_folder_graph(ck: Checkpoint, *, max_seq_len: int, max_batch: int = 1, kv_dtype: str = "f32") -> Graph:
    """The graph `hf_lm.build_lm_graph` builds for the loaded model, its matrices PlannedWeights."""
    b = _Builder(ck)
    if b.arch not in LM_CLASSES:
        raise ExportError(f"{b.cfg_path}: {b.arch} is not a supported causal LM (supported: {', '.join(LM_CLASSES)})")
    if kv_dtype not in KV_DTYPES:
        raise ExportError(f"kv_dtype must be one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or not 1 <= max_seq_len <= 0xFFFFFFFF:
        raise ExportError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if not 1 <= max_batch <= F.MAX_BATCH_LIMIT:
        raise ExportError(f"max_batch must be 1..{F.MAX_BATCH_LIMIT}, got {max_batch}")
    d, vocab, n_layers = int(b.need("hidden_size")), int(b.need("vocab_size")), int(b.need("num_hidden_layers"))
    eps = float(b.need("rms_norm_eps"))
    embed_name = "model.embed_tokens.weight"
    shape = ck.shape(embed_name)
    if len(shape) != 2 or shape[1] != d:
        raise ExportError(f"{ck.file_of(embed_name)}: tensor {embed_name} has shape {list(shape)}, config.json gives "
                          f"[{vocab}, {d}]")
    if shape[0] != vocab:
        raise ExportError(f"{ck.file_of(embed_name)}: tensor {embed_name} holds {shape[0]} token rows, config.json's "
                          f"vocab_size is {vocab}")
    table = b.matrix(embed_name, (vocab, d))
    for name in ck.names():
        parts = name.split(".")
        if name.startswith("model.layers.") and len(parts) > 3:
            if not parts[2].isdigit() or int(parts[2]) >= n_layers:
                raise ExportError(f"{ck.file_of(name)}: tensor {name} is past config.json's num_hidden_layers={n_layers}")
            if parts[3] not in _LAYER_PARTS:
                raise _refuse(b.cfg_path, f"decoder layer {parts[2]} with {parts[3]} ({name}) besides "
                                          f"{', '.join(_LAYER_PARTS[:4])}")
    hd = int(b.get("head_dim") or d // int(b.need("num_attention_heads")))
    theta = b.rope_theta(hd)
    layers: list[Layer] = [Embedding(table)]
    paths = ["model.embed_tokens"]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        seq = [(ResidualPush(), p), (b.norm(f"{p}.input_layernorm.weight", d, eps), f"{p}.input_layernorm"),
               (b.attention(i, theta, max_seq_len, KV_DTYPES[kv_dtype], eps), f"{p}.self_attn"), (ResidualAdd(), p),
               (ResidualPush(), p),
               (b.norm(f"{p}.post_attention_layernorm.weight", d, eps), f"{p}.post_attention_layernorm"),
               (b.ffn(i, d), f"{p}.mlp"), (ResidualAdd(), p)]
        layers += [layer for layer, _ in seq]
        paths += [path for _, path in seq]
    layers.append(b.norm("model.norm.weight", d, eps))
    paths.append("model.norm")
    if b.get("final_logit_softcapping") or b.get("logits_scaling") not in (None, 1, 1.0):
        raise _refuse(b.cfg_path, "scaled or soft-capped logits")
    tied = bool(b.get("tie_word_embeddings", False))
    if tied:
        head = table
    else:
        shape = ck.shape("lm_head.weight")
        if shape != (vocab, d):
            raise ExportError(f"{ck.file_of('lm_head.weight')}: tensor lm_head.weight has shape {list(shape)}, for a "
                              f"vocabulary of {vocab} (model.embed_tokens) it must be [{vocab}, {d}]")
        head = b.matrix("lm_head.weight", (vocab, d))
    layers.append(Linear(head, b.bias("lm_head.bias", vocab)))
    paths.append("lm_head")
    return Graph(layers=layers, input_size=vocab, output_size=vocab, max_batch=max_batch, paths=paths)


def plan_quantisation(graph: Graph, dtype: str, *, compensation: float = Q.DEFAULT_COMPENSATION,
                      keep: Sequence[str] = (), int8_act: Sequence[str] = (), int8_blocks: Sequence[str] = (),
                      group: int = Q.Q4_DEFAULT_GROUP, q8: Sequence[str] = (),
                      dtypes: dict[str, str] | None = None) -> None:
    """Give every PlannedWeight the kind `quantize.quantize(graph, dtype, ...)` would store it as (the
    options `export_lm` passes), in place; move each bias the companion will hold out of its owner.
    `dtypes` (weight name -> f32/f16/q8/q4, as `colibri quantize --target`'s plan chooses them)
    overrides the kind of the weights it names."""
    if dtype not in Q.DTYPES:
        raise ExportError(f"dtype must be one of {Q.DTYPES}, got {dtype!r}")
    if not 0 <= compensation < 1:
        raise ExportError(f"compensation must be a fraction in [0, 1), got {compensation}")
    if q8 and dtype != "q4":
        raise ExportError("q8 patterns choose int8 weights inside a q4 model: use them with dtype='q4'")
    if dtype == "q4" and (group < 8 or group > 256 or group & (group - 1)):
        raise ExportError(f"q4 group must be a power of two from 8 to 256, got {group}")
    slots = list(weight_slots(graph))
    names = [n for n, _, _ in slots]
    targets = list(act_targets(graph))
    for pattern in list(keep) + list(int8_act) + list(int8_blocks) + list(q8):
        if not any(name_matches(n, [pattern]) for n in names + [n for n, _ in targets]):
            raise ExportError(f"pattern {pattern!r} matches no weight; names look like {names[:3]}")
    tables = {id(layer.table) for layer in graph.layers if isinstance(layer, Embedding)}
    done: set[int] = set()
    for name, owner, attr in slots:
        w = getattr(owner, attr)
        if not isinstance(w, PlannedWeight) or id(w) in done:
            continue  # a dense layer's zero router (kept f32 as the quantiser keeps routers), or a tied head
        done.add(id(w))
        w.name, w.graph_where, w.compensation, w.group = name, _where(graph, name), compensation, group
        want = "f32" if name_matches(name, keep) or name_matches(name, Q.ROUTER_PATTERNS) else dtype
        if want == "q4" and Q.q4_stored_as_q8(name, owner, attr, id(w) in tables, q8, w.source_is_q4()):
            want = "q8"
        if dtypes is not None and name in dtypes:
            want = dtypes[name]
        w.kind = want
        b_attr = BIAS_OF.get(attr)
        if b_attr and want in ("q8", "q4") and getattr(owner, b_attr) is not None:
            w.bias = getattr(owner, b_attr)
            if w.absorbs_bias():
                setattr(owner, b_attr, None)
            else:
                w.bias = None
    Q.set_act_forms(graph, int8_act, int8_blocks, planned_int8)


def planned_int8(w: object) -> bool:
    """Whether a planned weight will be stored int8 or int4."""
    return isinstance(w, PlannedWeight) and w.kind in ("q8", "q4")


@dataclass
class FolderExport:
    path: Path
    bytes_written: int
    tensors: int
    version: int
    graph: Graph


def export_folder(folder: str | Path, path: str | Path, *, max_seq_len: int | None = None, max_batch: int = 1,
                  dtype: str = "f32", kv_dtype: str = "f32", compensation: float = Q.DEFAULT_COMPENSATION,
                  keep: Sequence[str] = (), int8_act: Sequence[str] = (), int8_blocks: Sequence[str] | None = None,
                  group: int = Q.Q4_DEFAULT_GROUP, q8: Sequence[str] = (), check: bool = True,
                  on_tensor: Callable[[int, int, int], None] | None = None,
                  page_aligned: bool | None = None, tokenizer: bool | str | Path = True) -> FolderExport:
    """Export a Hugging Face folder to a token-model image at `path`, one tensor in memory at a time.

    The options are `hf_lm.export_lm`'s (`page_aligned` None: experts on pages of their own once the image
    would be at least 16 MiB, docs/linux-edge.md "Export defaults"). `check` validates the written file's structure with the
    reader (the C engine's twin: header, tables, records, references; `colibri_validate_ex`'s
    COLIBRI_CHECK_STRUCTURE) from a mapping, before it is renamed into place. It does not re-read
    the payloads: their CRCs are computed from the very bytes written, and mapping them all would
    make the file's pages resident. The logits check of the in-memory export needs the PyTorch
    model, which this path never builds.

    `tokenizer` (default True): the folder's tokenizer.model or tokenizer.json goes into the image
    as its tokenizer section (format v6, docs/lm.md), if the folder has one; a path takes it from
    there instead; False leaves it out. One that cannot be the model's (more tokens than the
    embedding's rows, a kind Colibri does not carry) is refused before anything is written."""
    if max_seq_len is None:
        raise ExportError("a token model needs max_seq_len (the KV cache's positions): "
                          "colibri.export(DIR, path, max_seq_len=N) or --max-seq-len N")
    if path is None:
        raise ExportError("a streamed export writes a file: give the output path")
    ck = Checkpoint(folder)
    graph = build_folder_graph(ck, max_seq_len=max_seq_len, max_batch=max_batch, kv_dtype=kv_dtype)
    if tokenizer is not False:
        from ..runtime import tokenizer_build

        spec = ck.folder if tokenizer is True else tokenizer
        if tokenizer is not True or tokenizer_build.from_folder(ck.folder) is not None:
            graph.tokenizer = tokenizer_build.packed_for(spec, graph.vocab_size, str(spec))
    return export_graph(ck, graph, path, dtype=dtype, compensation=compensation, keep=keep, int8_act=int8_act,
                        int8_blocks=int8_blocks, group=group, q8=q8, check=check, on_tensor=on_tensor,
                        page_aligned=page_aligned)


def export_graph(ck, graph: Graph, path: str | Path, *, dtype: str, compensation: float, keep: Sequence[str],
                 int8_act: Sequence[str], int8_blocks: Sequence[str] | None, group: int, q8: Sequence[str],
                 check: bool,
                 on_tensor: Callable[[int, int, int], None] | None,
                 page_aligned: bool | None = None, dtypes: dict[str, str] | None = None,
                 finish: Callable[[Path], None] | None = None) -> FolderExport:
    """Plan `graph`'s quantisation (its matrices are `ck`'s PlannedWeights) and stream it to `path`:
    what every checkpoint reader (this folder's, `gguf_file`'s) ends with. `page_aligned` as
    `stream.write_file`'s (None: experts on pages of their own once the image would be 16 MiB). `dtypes`
    as `plan_quantisation`'s; `finish(tmp)` runs on the written file after the validation, before it is
    renamed into place (raising there leaves nothing at `path`)."""
    from ..image import stream

    for i, layer in enumerate(graph.layers):
        if isinstance(layer, RMSNorm) and not layer.eps > 0:
            raise ExportError(f"{ck.config_path}: rms_norm_eps={layer.eps:g}, the engine needs eps > 0")
        if isinstance(layer, MoE) and layer.route_count > F.MAX_ROUTES:
            raise ExportError(f"{graph.where(i)}: {layer.route_count} router outputs, the engine allows at most "
                              f"{F.MAX_ROUTES}")
    plan_quantisation(graph, dtype, compensation=compensation, keep=keep, int8_act=int8_act,
                      int8_blocks=int8_blocks or (), group=group, q8=q8, dtypes=dtypes)
    if int8_blocks is None and not int8_act:  # docs/quantization.md "Activation blocks by default"
        Q.set_act_forms(graph, (), Q.linux_int8_blocks(graph, planned_int8), planned_int8)

    def validate(tmp: Path) -> None:
        import mmap

        with open(tmp, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                code = reader.status(view, check="structure")
            finally:
                view.release()
        if code != 0:
            raise ExportError(f"{path}: the written image fails validation ({F.STATUS_TEXT[F.Status(code)]}); "
                              "nothing written")

    def finished(tmp: Path) -> None:
        if check:
            validate(tmp)
        if finish is not None:
            finish(tmp)

    report = stream.write_file(graph, path, on_tensor=on_tensor, finish=finished if check or finish else None,
                               page_aligned=page_aligned)
    return FolderExport(path=report.path, bytes_written=report.bytes_written, tensors=report.tensors,
                        version=report.version, graph=graph)

