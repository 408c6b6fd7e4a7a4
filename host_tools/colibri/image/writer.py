"""The model image writer: `write(graph) -> bytes` in the layout of docs/model-format.md, at the
lowest format version that holds the graph unless asked for another."""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..model import format as F
from ..model.format import NONE, DType, Op, Routing
from ..model.ir import (
    Activation, Attention, Embedding, Expert, F16Weight, Graph, LayerNorm, Linear, MoE, Q4Weight, Q8Weight,
    ResidualAdd, ResidualPush, RMSNorm, Weight,
)
from ..model.walks import weight_slots
from .codecs import q4_pack, q4_params_payload, q8_params_payload, set_crc


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# The largest image of versions 1..5 (u32 image_size, offsets and sizes); past it the writer
# uses version 7. A module attribute so that tests move the boundary instead of writing 4 GiB.
NARROW_LIMIT = F.NARROW_LIMIT


@dataclass
class _Entry:
    """One tensor record to be written: its payload and record fields."""

    payload: bytes | Callable[[], bytes]  # a callable when the payload is made as it is written (image.stream)
    dtype: DType
    rows: int
    cols: int
    ndim: int
    aux: int = NONE
    page: bool = False  # starts a 4 KiB page (first tensor of an expert)


class _Tensors:
    """Collects tensors in reference order."""

    def __init__(self, version: int = F.VERSION) -> None:
        self.entries: list[_Entry] = []
        self.version = version
        self.page_next = False  # the next tensor starts a page (the one after an expert's last)

    def _push(self, entry: _Entry) -> int:
        if self.page_next:
            entry.page, self.page_next = True, False
        self.entries.append(entry)
        return len(self.entries) - 1

    def add(self, arr: Weight | None, dtype: DType = DType.F32, *, page: bool = False) -> int:
        if arr is None:
            return NONE
        planned = getattr(arr, "image_entries", None)
        if planned is not None:  # a weight made when written (image.stream): its records now, payloads later
            index = NONE
            for payload, kind, rows, cols, ndim in planned(self.version):
                at = self._push(_Entry(payload, kind, rows, cols, ndim, page=page and index == NONE))
                if index == NONE:
                    index = at
                else:
                    self.entries[index].aux = at
            return index
        if isinstance(arr, Q8Weight):
            rows, cols = arr.shape
            index = self._push(_Entry(np.ascontiguousarray(arr.q, dtype=np.int8).tobytes(), DType.I8, rows, cols, 2, page=page))
            self.entries[index].aux = self._push(_Entry(q8_params_payload(arr, self.version), DType.Q8_PARAMS, rows, cols, 2))
            return index
        if isinstance(arr, Q4Weight):
            rows, cols = arr.shape
            index = self._push(_Entry(q4_pack(arr.q), DType.I4, rows, cols, 2, page=page))
            self.entries[index].aux = self._push(_Entry(q4_params_payload(arr), DType.Q4_PARAMS, rows, cols, 2))
            return index
        if isinstance(arr, F16Weight):
            dtype, arr = DType.F16, arr.data
        np_dtype = {DType.F32: "<f4", DType.F16: "<f2", DType.I32: "<i4"}[dtype]
        a = np.ascontiguousarray(np.asarray(arr, dtype=np_dtype))
        if a.ndim not in (1, 2) or a.size == 0:
            raise ValueError(f"tensor must be a non-empty vector or matrix, got shape {a.shape}")
        rows, cols = (a.shape[0], 1) if a.ndim == 1 else a.shape
        return self._push(_Entry(a.tobytes(), dtype, rows, cols, a.ndim, page=page))


def needed_version(graph: Graph) -> int:
    """The lowest format version that holds `graph`: 1 without int8 weights (such an image is the
    same in versions 1 and 2, so engines and firmware that read only version 1 run it), else
    F.VERSION (compact Q8_PARAMS); F.Q4_VERSION with an int4 weight."""
    kinds = {type(getattr(o, a)) for _, o, a in weight_slots(graph)}
    return F.Q4_VERSION if Q4Weight in kinds else F.VERSION if Q8Weight in kinds else 1


def has_int4(graph: Graph) -> bool:
    return any(isinstance(w, Q4Weight) or getattr(w, "image_dtype", None) == DType.I4
               for w in (getattr(o, a) for _, o, a in weight_slots(graph)))


def write(graph: Graph, *, page_aligned: bool = False, version: int | None = None,
          tensor_crc: bool | None = None) -> bytes:
    """Serialise a graph to a model image of format `version`: by default the lowest that holds it
    (`needed_version`); 1 also for a q8 graph quantised with compact=False, for engines that read
    only version 1.

    `tensor_crc` (default: with `page_aligned`, or when version 3 is asked for) writes format
    version 3: one CRC-32 per tensor payload, the header CRC over the metadata only, so a mapped
    file opens without reading its weights (docs/model-format.md "Integrity"). `page_aligned` starts
    every expert on a 4 KiB page and the tensor after an expert's last one on the next page, so each
    expert's payloads are pages of their own (one madvise / mlock range).

    An image that passes 4 GiB (`NARROW_LIMIT`) is written as format version 7 (64-bit sizes and
    offsets, docs/model-format.md "Version 7"); `version=7` asks for it at any size."""
    plan = layout(graph, page_aligned=page_aligned, version=version, tensor_crc=tensor_crc)
    payloads = [t.payload() if callable(t.payload) else t.payload for t in plan.tensors.entries]
    if wide_needed(plan, [len(d) for d in payloads]):
        if version is not None:
            raise ValueError(f"the image passes {NARROW_LIMIT + 1} bytes, past format version {version}'s "
                             f"32-bit sizes and offsets: write it as version {F.WIDE_VERSION} (or let the writer "
                             "choose)")
        plan.widen()
    placed: list[tuple[int, bytes]] = []
    pos = plan.payload_start
    for t, data in zip(plan.tensors.entries, payloads):
        pos = plan.place(pos, t)
        placed.append((pos, data))
        pos += len(data)
    image_size = _align(pos, 4)
    buf = bytearray(image_size)
    for off, data in placed:
        buf[off : off + len(data)] = data
    crcs = [zlib.crc32(data) & 0xFFFFFFFF for _, data in placed] if plan.tensor_crc else []
    meta = plan.metadata([(off, len(data)) for off, data in placed], crcs, image_size)
    buf[: len(meta)] = meta
    if not plan.tensor_crc:  # v1, v2: the header CRC covers the payloads too
        set_crc(buf)
    return bytes(buf)


# Exports meant for Linux (colibri export, colibri.export, the streamed folder export) lay experts out on
# pages of their own, with one CRC per tensor, once the compact image would reach this size: far past any
# microcontroller's model slot (the boards' slots are a few MiB of flash), and where opening a mapped file
# without reading it starts to matter (docs/linux-edge.md "Export defaults"). Smaller images stay compact.
LINUX_LAYOUT_MIN_BYTES = 16 << 20


# Bytes per element of the payloads whose size the records alone give.
_FIXED = {DType.F32: 4, DType.F16: 2, DType.I8: 1, DType.I32: 4}


def least_size(plan: Layout) -> int:
    """A lower bound of the image's size from its records alone (companions at their smallest:
    header and scales), so an image past 4 GiB is laid out as version 7 before a byte is written."""
    pos = plan.payload_start
    for t in plan.tensors.entries:
        if t.dtype in _FIXED:
            size = t.rows * t.cols * _FIXED[t.dtype]
        elif t.dtype == DType.I4:
            size = t.rows * F.q4_row_bytes(t.cols)
        elif t.dtype == DType.Q8_PARAMS:
            size = F.Q8_PARAMS_HEADER + 2 * t.rows
        elif t.dtype == DType.TOKENIZER:
            size = t.rows
        else:  # Q4_PARAMS: at least one f16 scale a row
            size = F.Q4_PARAMS_HEADER + 2 * t.rows
        pos = plan.place(pos, t) + size
    return _align(pos, 4)


def linux_layout(graph: Graph) -> bool:
    """Whether an export of `graph` that names no layout is page-aligned (format v3+, per-tensor CRCs):
    it has experts and its compact image would be at least LINUX_LAYOUT_MIN_BYTES."""
    if not any(isinstance(layer, MoE) and (layer.experts or layer.shared) for layer in graph.layers):
        return False
    return least_size(layout(graph)) >= LINUX_LAYOUT_MIN_BYTES


@dataclass
class Layout:
    """An image's records before its payloads are placed: what `write` and `image.stream` share.

    `tensors.entries` lists the payloads in file order; `metadata` packs the header and tables
    once every payload's offset and size (and, v3 on, CRC-32) is known."""

    graph: Graph
    version: int
    tensor_crc: bool
    page_aligned: bool
    tensors: _Tensors
    layer_recs: list[bytes]
    moe_recs: list[bytes]
    expert_recs: list[bytes]
    attention_recs: list[bytes]
    offsets: dict[str, int] = field(default_factory=dict)

    def image_size(self, sizes: list[int]) -> int:
        """The image's bytes with payloads of these sizes, in table order."""
        pos = self.payload_start
        for t, size in zip(self.tensors.entries, sizes):
            pos = self.place(pos, t) + size
        return _align(pos, 4)

    def widen(self) -> None:
        """Turn this layout into format version 7's: the 96-byte header, 32-byte tensor records, and
        (as every version from 3 on) per-tensor CRCs. Payloads stay as they are: every version from 2
        on lays out a Q8_PARAMS alike."""
        if self.version < 2 and any(t.dtype == DType.Q8_PARAMS for t in self.tensors.entries):
            raise ValueError("a version-1 Q8_PARAMS layout cannot be widened to version 7: quantise with compact=True")
        self.version, self.tensor_crc = F.WIDE_VERSION, True
        self.tensors.version = F.WIDE_VERSION
        self.offsets = _table_offsets(self.version, True, len(self.tensors.entries), len(self.layer_recs),
                                      len(self.moe_recs), len(self.expert_recs), len(self.attention_recs))

    @property
    def meta_size(self) -> int:
        return self.offsets["payloads"]

    @property
    def payload_start(self) -> int:
        return self.offsets["payloads"]

    def place(self, pos: int, entry: _Entry) -> int:
        return _align(pos, F.PAGE_SIZE if entry.page and self.page_aligned else F.PAYLOAD_ALIGN)

    def metadata(self, placed: list[tuple[int, int]], crcs: list[int], image_size: int) -> bytearray:
        """Header, tables and (v3 on) CRC table: the image's first `payload_start` bytes, its header
        CRC set when it covers only these (v3 on)."""
        graph, at, entries = self.graph, self.offsets, self.tensors.entries
        buf = bytearray(self.payload_start)
        flags = F.Flag.PAGE_ALIGNED if self.page_aligned else 0
        wide = self.version >= F.WIDE_VERSION
        if not wide and image_size > F.NARROW_LIMIT:
            raise ValueError(f"an image of {image_size} bytes needs format version {F.WIDE_VERSION}, "
                             f"not {self.version}")
        buf[0 : F.HEADER_SIZE] = F.HEADER.pack(
            F.MAGIC, self.version, F.header_size(self.version), 0, min(image_size, F.NARROW_LIMIT), int(flags),
            graph.input_size, graph.output_size, graph.max_batch,
            len(entries), at["tensor"], len(self.layer_recs), at["layer"], len(self.moe_recs), at["moe"],
            len(self.expert_recs), at["expert"],
        )
        if wide:  # v7: the image's size in 64 bits (bytes 88..96 stay zero)
            F.WIDE_FIELDS.pack_into(buf, F.WIDE_FIELDS_OFFSET, image_size)
        record = F.tensor_record(self.version)
        tensor_recs = [record.pack(off, size, t.rows, t.cols, int(t.dtype), t.ndim, 0, t.aux)
                       for (off, size), t in zip(placed, entries)]
        for off, recs in ((at["tensor"], tensor_recs), (at["layer"], self.layer_recs), (at["moe"], self.moe_recs),
                          (at["expert"], self.expert_recs), (at["attention"], self.attention_recs)):
            blob = b"".join(recs)
            buf[off : off + len(blob)] = blob
        if self.tensor_crc:
            F.V3_FIELDS.pack_into(buf, F.V3_FIELDS_OFFSET, self.payload_start, at["crc"])
            for i, crc in enumerate(crcs):
                struct.pack_into("<I", buf, at["crc"] + 4 * i, crc)
        if self.version >= F.LM_VERSION:  # v5 feature models too: an empty attention table
            F.V4_FIELDS.pack_into(buf, F.V4_FIELDS_OFFSET, len(self.attention_recs), at["attention"])
        if self.tensor_crc:
            set_crc(buf)
        return buf


def layout(graph: Graph, *, page_aligned: bool = False, version: int | None = None,
           tensor_crc: bool | None = None) -> Layout:
    """The records of `graph`'s image (see `write`) and where its tables lie; payloads not yet placed."""
    if not 1 <= graph.max_batch <= F.MAX_BATCH_LIMIT:
        raise ValueError(f"max_batch must be 1..{F.MAX_BATCH_LIMIT}, got {graph.max_batch}")
    token_model = any(isinstance(layer, (Embedding, Attention)) for layer in graph.layers)
    if graph.tokenizer is not None:  # format version 6: version 5 plus the tokenizer section (7 past 4 GiB)
        if not token_model:
            raise ValueError("a tokenizer section belongs to a token model (layer 0 an Embedding)")
        if version not in (None, F.TOKENIZER_VERSION, F.WIDE_VERSION):
            raise ValueError(f"a token model with a tokenizer section is format version {F.TOKENIZER_VERSION} "
                             f"(or {F.WIDE_VERSION}), not {version}")
        if tensor_crc is False:
            raise ValueError(f"format version {F.TOKENIZER_VERSION} (a tokenizer section) always has per-tensor CRCs")
        version, tensor_crc = version or F.TOKENIZER_VERSION, True
    elif version == F.TOKENIZER_VERSION:
        raise ValueError(f"format version {F.TOKENIZER_VERSION} is written only with a tokenizer section")
    elif version == F.WIDE_VERSION:  # v7 holds every graph (v5's records), always with per-tensor CRCs
        if tensor_crc is False:
            raise ValueError(f"format version {F.WIDE_VERSION} (64-bit sizes) always has per-tensor CRCs")
        tensor_crc = True
    elif has_int4(graph):  # int4 weights are format version 5, which keeps v4's header and CRCs
        if version not in (None, F.Q4_VERSION):
            raise ValueError(f"a graph with int4 weights is format version {F.Q4_VERSION}, not {version}")
        if tensor_crc is False:
            raise ValueError(f"format version {F.Q4_VERSION} (int4 weights) always has per-tensor CRCs")
        version, tensor_crc = F.Q4_VERSION, True
    elif version == F.Q4_VERSION:
        raise ValueError(f"format version {F.Q4_VERSION} is written only for graphs with int4 weights")
    elif token_model:  # docs/lm.md: token models are version 4, which always has per-tensor CRCs
        if version not in (None, F.LM_VERSION):
            raise ValueError(f"a token model (EMBED/ATTENTION layers) is format version {F.LM_VERSION}, not {version}")
        if tensor_crc is False:
            raise ValueError(f"format version {F.LM_VERSION} (token models) always has per-tensor CRCs")
        version, tensor_crc = F.LM_VERSION, True
    elif version == F.LM_VERSION:
        raise ValueError(f"format version {F.LM_VERSION} holds token models only (layer 0 an Embedding)")
    if tensor_crc is None:
        tensor_crc = page_aligned or version == F.TENSOR_CRC_VERSION
    if version is None:
        version = F.TENSOR_CRC_VERSION if tensor_crc else needed_version(graph)
    if not F.MIN_READ_VERSION <= version <= F.MAX_READ_VERSION:
        raise ValueError(f"format version must be {F.MIN_READ_VERSION}..{F.MAX_READ_VERSION}, got {version}")
    if tensor_crc != (version >= F.TENSOR_CRC_VERSION):
        raise ValueError(f"per-tensor CRCs are format version {F.TENSOR_CRC_VERSION} and later, not {version}")
    tensors = _Tensors(version)
    layer_recs: list[bytes] = []
    moe_recs: list[bytes] = []
    expert_recs: list[bytes] = []
    attention_recs: list[bytes] = []
    table_ref = NONE  # the embedding table's tensor, which a tied head names again
    width = graph.input_size

    def expert_record(e: Expert) -> bytes:
        flags = (F.ExpertFlag.INT8_ACT if e.int8_act else 0) | (F.ExpertFlag.INT8_BLOCKS if e.int8_blocks else 0)
        w1 = tensors.add(e.w1, page=True)
        b1 = tensors.add(e.b1)
        w2 = tensors.add(e.w2)
        b2 = tensors.add(e.b2)
        w3 = tensors.add(e.w3)
        b3 = tensors.add(e.b3)
        tensors.page_next = page_aligned  # the expert's pages are its own
        return F.EXPERT.pack(int(e.kind), int(e.act), int(flags), e.hidden, w1, b1, w2, b2, w3, b3)

    for layer in graph.layers:
        t0 = t1 = NONE
        kind = flags = 0
        eps = 0.0
        in_f = width
        if isinstance(layer, Linear):
            op = Op.LINEAR
            flags = (F.LayerFlag.INT8_ACT if layer.int8_act else 0) | (F.LayerFlag.INT8_BLOCKS if layer.int8_blocks else 0)
            tied = token_model and layer.weight is graph.layers[0].table
            t0 = table_ref if tied else tensors.add(layer.weight)
            t1 = tensors.add(layer.bias)
            in_f, width = layer.in_features, layer.out_features
        elif isinstance(layer, Embedding):
            op = Op.EMBED
            t0 = table_ref = tensors.add(layer.table)
            in_f, width = layer.vocab_size, layer.d_model
        elif isinstance(layer, Attention):
            op = Op.ATTENTION
            in_f = width = layer.d_model
            t0 = len(attention_recs)
            attention_recs.append(_attention_record(layer, tensors))
        elif isinstance(layer, Activation):
            op, kind = Op.ACTIVATION, int(layer.act)
        elif isinstance(layer, LayerNorm):
            op, eps = Op.LAYERNORM, layer.eps
            t0, t1 = tensors.add(layer.weight), tensors.add(layer.bias)
            in_f = width = layer.size
        elif isinstance(layer, RMSNorm):
            op, eps = Op.RMSNORM, layer.eps
            t0 = tensors.add(layer.weight)
            in_f = width = layer.size
        elif isinstance(layer, ResidualPush):
            op = Op.RESIDUAL_PUSH
        elif isinstance(layer, ResidualAdd):
            op = Op.RESIDUAL_ADD
        elif isinstance(layer, MoE):
            op = Op.MOE
            in_f = width = layer.d_model
            rw = tensors.add(layer.router_weight)
            rb = tensors.add(layer.router_bias)
            emap = tensors.add(np.asarray(layer.expert_map, dtype=np.int32), DType.I32)
            gate = tensors.add(layer.shared_gate)
            first = len(expert_recs)
            for e in list(layer.experts) + list(layer.shared):
                expert_recs.append(expert_record(e))
            moe_flags = F.MoEFlag.RENORMALIZE if layer.renormalize else 0
            top_k = 0 if layer.routing == Routing.DENSE else layer.top_k
            t0 = len(moe_recs)
            moe_recs.append(
                F.MOE.pack(
                    layer.d_model, layer.route_count, len(layer.experts), top_k, int(layer.routing),
                    int(moe_flags), len(layer.shared), rw, rb, emap, first, gate, 0, 0,
                )
            )
        else:
            raise TypeError(f"not a layer: {layer!r}")
        layer_recs.append(F.LAYER.pack(int(op), kind, int(flags), in_f, width, t0, t1, eps, 0, 0))

    if graph.tokenizer is not None:  # the last payload: no layer names it
        tensors._push(_Entry(bytes(graph.tokenizer), DType.TOKENIZER, len(graph.tokenizer), 1, 1))
    at = _table_offsets(version, bool(tensor_crc), len(tensors.entries), len(layer_recs), len(moe_recs),
                        len(expert_recs), len(attention_recs))
    return Layout(graph, version, bool(tensor_crc), page_aligned, tensors, layer_recs, moe_recs, expert_recs,
                  attention_recs, at)


def _table_offsets(version: int, tensor_crc: bool, n_t: int, n_l: int, n_m: int, n_e: int, n_a: int) -> dict[str, int]:
    """Where each table starts, the CRC table (v3 on) and the first payload."""
    at = {"tensor": F.header_size(version)}
    at["layer"] = at["tensor"] + n_t * F.tensor_record(version).size
    at["moe"] = at["layer"] + n_l * F.LAYER.size
    at["expert"] = at["moe"] + n_m * F.MOE.size
    at["attention"] = at["expert"] + n_e * F.EXPERT.size
    at["payloads"] = at["attention"] + n_a * F.ATTENTION.size
    if tensor_crc:  # v3: the CRC table ends the metadata, which the header CRC covers
        at["crc"] = at["payloads"]
        at["payloads"] = at["crc"] + 4 * n_t
    return at


def wide_needed(plan: Layout, sizes: list[int]) -> bool:
    """Whether `plan`'s image, with payloads of these sizes, passes what its (narrow) version holds."""
    return plan.version < F.WIDE_VERSION and plan.image_size(sizes) > NARROW_LIMIT


def _attention_record(a: Attention, tensors: _Tensors) -> bytes:
    refs = [tensors.add(w) for w in (a.q_w, a.q_b, a.k_w, a.k_b, a.v_w, a.v_b, a.o_w, a.o_b, a.q_norm, a.k_norm)]
    flags = F.AttentionFlag.INT8_BLOCKS if a.int8_blocks else 0
    return F.ATTENTION.pack(a.d_model, a.n_heads, a.n_kv_heads, a.head_dim, *refs, a.rope_theta, a.qk_norm_eps,
                            a.max_seq_len, int(a.kv_dtype), int(flags))
