"""The model image: `write(graph) -> bytes` and `read(bytes) -> Graph`.

The layout is docs/model-format.md. `read` validates as the C engine does and
raises `ImageError` with the same status code the engine would return, in the
same order ("Validation order"), in time linear in the image size.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from . import format as F
from .errors import ColibriError, error_for
from .format import Act, DType, ExpertKind, Op, Routing, Status
from .ir import (
    Activation, Attention, Embedding, Expert, F16Weight, Graph, LayerNorm, Linear, MoE, Q4Weight, Q8Weight,
    QuantWeight, ResidualAdd, ResidualPush, RMSNorm, Weight,
)

NONE = F.NONE


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class _Entry:
    """One tensor record to be written: its payload and record fields."""

    payload: bytes
    dtype: DType
    rows: int
    cols: int
    ndim: int
    aux: int = NONE
    page: bool = False  # starts a 4 KiB page (first tensor of an expert)


def q8_params_payload(w: Q8Weight, version: int = F.VERSION) -> bytes:
    """The Q8_PARAMS blob (docs/model-format.md "Quantised weights"): its header, the scales
    (and in v2 the bias) of `w`'s parameter dtype, then the CSR compensation if any, the row
    pointers as wide as the format version gives for its nnz."""
    rows = w.q.shape[0]
    f16 = w.scale.dtype == np.float16
    if w.bias is not None and w.bias.dtype != w.scale.dtype:
        raise ValueError(f"bias dtype {w.bias.dtype} differs from the scales' {w.scale.dtype}")
    if version < 2:
        if w.bias is not None:
            raise ValueError("format version 1 holds no bias in Q8_PARAMS: quantise with compact=False")
        f16 = False  # f16 scales widen to f32 exactly
        header = struct.pack("<II", w.nnz, 0)
    else:
        flags = F.Q8Flag.BIAS if w.bias is not None else 0
        header = struct.pack("<IBBH", w.nnz, int(DType.F16 if f16 else DType.F32), int(flags), 0)
    param = "<f2" if f16 else "<f4"
    at = F.q8_layout(version, rows, w.nnz, 2 if f16 else 4, w.bias is not None)
    buf = bytearray(at["size"])
    buf[0:8] = header
    fields = [("scale", w.scale.astype(param))]
    if w.bias is not None:
        fields.append(("bias", w.bias.astype(param)))
    if w.nnz:
        width = F.q8_row_ptr_bytes(version, w.nnz)
        fields += [("row_ptr", w.row_ptr.astype(f"<u{width}")), ("col", w.col.astype("<u2")),
                   ("val", w.val.astype("<f2"))]
    for name, arr in fields:
        data = arr.tobytes()
        buf[at[name] : at[name] + len(data)] = data
    return bytes(buf)


def q4_pack(q: np.ndarray) -> bytes:
    """An I4 payload: row-major, ceil(cols/2) bytes a row, column c in byte c >> 1, the low nibble
    for even c, the high nibble for odd c, two's complement; an odd row's last high nibble zero."""
    q = np.asarray(q)
    if q.ndim != 2 or q.size == 0:
        raise ValueError(f"int4 weights must be a non-empty matrix, got shape {q.shape}")
    if q.min() < -8 or q.max() > 7:
        raise ValueError(f"int4 weights must lie in -8..7, got {int(q.min())}..{int(q.max())}")
    rows, cols = q.shape
    nib = np.zeros((rows, cols + cols % 2), dtype=np.uint8)
    nib[:, :cols] = q.astype(np.int16) & 0xF
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8).tobytes()


def q4_unpack(packed: np.ndarray, cols: int) -> np.ndarray:
    """The int4 values [rows, cols] (as int8) of packed I4 rows [rows, ceil(cols/2)] (uint8)."""
    lo = (packed & 0xF).astype(np.int8)
    hi = (packed >> 4).astype(np.int8)
    both = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.int8)
    both[:, 0::2], both[:, 1::2] = lo, hi
    both = np.where(both >= 8, both - 16, both).astype(np.int8)
    return np.ascontiguousarray(both[:, :cols])


def q4_params_payload(w: Q4Weight) -> bytes:
    """The Q4_PARAMS blob (docs/model-format.md "Quantised weights: I4 with Q4_PARAMS"): its header,
    the f16 group scales [rows·G] (row o's G scales contiguous), the f16 bias with BIAS, then the CSR
    compensation as a v2 Q8_PARAMS holds it."""
    rows, cols = w.q.shape
    g_log2 = w.group_log2
    if w.group != 1 << g_log2 or not F.Q4_GROUP_LOG2_MIN <= g_log2 <= F.Q4_GROUP_LOG2_MAX:
        raise ValueError(f"int4 group must be a power of two from {1 << F.Q4_GROUP_LOG2_MIN} to "
                         f"{1 << F.Q4_GROUP_LOG2_MAX}, got {w.group}")
    if w.scale.dtype != np.float16 or w.scale.shape != (rows, F.q4_groups(cols, g_log2)):
        raise ValueError(f"int4 scales must be float16 [{rows}, {F.q4_groups(cols, g_log2)}], "
                         f"got {w.scale.dtype} {w.scale.shape}")
    if w.bias is not None and (w.bias.dtype != np.float16 or w.bias.shape != (rows,)):
        raise ValueError(f"an int4 weight's bias must be float16 [{rows}], got {w.bias.dtype} {w.bias.shape}")
    at = F.q4_layout(rows, cols, w.nnz, g_log2, w.bias is not None)
    buf = bytearray(at["size"])
    flags = F.Q4Flag.BIAS if w.bias is not None else 0
    buf[0:F.Q4_PARAMS_HEADER] = F.Q4_PARAMS_FIELDS.pack(w.nnz, g_log2, int(flags), 0)
    fields = [("scale", w.scale.astype("<f2"))]
    if w.bias is not None:
        fields.append(("bias", w.bias.astype("<f2")))
    if w.nnz:
        width = F.q8_row_ptr_bytes(2, w.nnz)
        fields += [("row_ptr", w.row_ptr.astype(f"<u{width}")), ("col", w.col.astype("<u2")),
                   ("val", w.val.astype("<f2"))]
    for name, arr in fields:
        data = arr.tobytes()
        buf[at[name] : at[name] + len(data)] = data
    return bytes(buf)


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
    from .quantize import weight_slots

    kinds = {type(getattr(o, a)) for _, o, a in weight_slots(graph)}
    return F.Q4_VERSION if Q4Weight in kinds else F.VERSION if Q8Weight in kinds else 1


def has_int4(graph: Graph) -> bool:
    from .quantize import weight_slots

    return any(isinstance(getattr(o, a), Q4Weight) for _, o, a in weight_slots(graph))


def write(graph: Graph, *, page_aligned: bool = False, version: int | None = None,
          tensor_crc: bool | None = None) -> bytes:
    """Serialise a graph to a model image of format `version`: by default the lowest that holds it
    (`needed_version`); 1 also for a q8 graph quantised with compact=False, for engines that read
    only version 1.

    `tensor_crc` (default: with `page_aligned`, or when version 3 is asked for) writes format
    version 3: one CRC-32 per tensor payload, the header CRC over the metadata only, so a mapped
    file opens without reading its weights (docs/model-format.md "Integrity"). `page_aligned` starts
    every expert on a 4 KiB page and the tensor after an expert's last one on the next page, so each
    expert's payloads are pages of their own (one madvise / mlock range)."""
    if not 1 <= graph.max_batch <= F.MAX_BATCH_LIMIT:
        raise ValueError(f"max_batch must be 1..{F.MAX_BATCH_LIMIT}, got {graph.max_batch}")
    token_model = any(isinstance(layer, (Embedding, Attention)) for layer in graph.layers)
    if has_int4(graph):  # int4 weights are format version 5, which keeps v4's header and CRCs
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

    n_t = len(tensors.entries)
    tensor_off = F.HEADER_SIZE
    layer_off = tensor_off + n_t * F.TENSOR.size
    moe_off = layer_off + len(layer_recs) * F.LAYER.size
    expert_off = moe_off + len(moe_recs) * F.MOE.size
    attention_off = expert_off + len(expert_recs) * F.EXPERT.size
    pos = attention_off + len(attention_recs) * F.ATTENTION.size
    crc_off = meta_size = 0
    if tensor_crc:  # v3: the CRC table ends the metadata, which the header CRC covers
        crc_off = pos
        pos = meta_size = crc_off + 4 * n_t

    tensor_recs = []
    placed: list[tuple[int, bytes]] = []
    for t in tensors.entries:
        pos = _align(pos, F.PAGE_SIZE if t.page and page_aligned else F.PAYLOAD_ALIGN)
        tensor_recs.append(F.TENSOR.pack(pos, len(t.payload), t.rows, t.cols, int(t.dtype), t.ndim, 0, t.aux))
        placed.append((pos, t.payload))
        pos += len(t.payload)
    image_size = _align(pos, 4)

    buf = bytearray(image_size)
    flags = F.Flag.PAGE_ALIGNED if page_aligned else 0
    buf[0 : F.HEADER_SIZE] = F.HEADER.pack(
        F.MAGIC, version, F.HEADER_SIZE, 0, image_size, int(flags),
        graph.input_size, graph.output_size, graph.max_batch,
        n_t, tensor_off, len(layer_recs), layer_off, len(moe_recs), moe_off, len(expert_recs), expert_off,
    )
    for off, recs in ((tensor_off, tensor_recs), (layer_off, layer_recs), (moe_off, moe_recs), (expert_off, expert_recs),
                      (attention_off, attention_recs)):
        blob = b"".join(recs)
        buf[off : off + len(blob)] = blob
    for off, data in placed:
        buf[off : off + len(data)] = data
    if tensor_crc:
        F.V3_FIELDS.pack_into(buf, F.V3_FIELDS_OFFSET, meta_size, crc_off)
        for i, (off, data) in enumerate(placed):
            struct.pack_into("<I", buf, crc_off + 4 * i, zlib.crc32(data) & 0xFFFFFFFF)
    if version >= F.LM_VERSION:  # v5 feature models too: an empty attention table
        F.V4_FIELDS.pack_into(buf, F.V4_FIELDS_OFFSET, len(attention_recs), attention_off)
    set_crc(buf)
    return bytes(buf)


def _attention_record(a: Attention, tensors: _Tensors) -> bytes:
    refs = [tensors.add(w) for w in (a.q_w, a.q_b, a.k_w, a.k_b, a.v_w, a.v_b, a.o_w, a.o_b, a.q_norm, a.k_norm)]
    return F.ATTENTION.pack(a.d_model, a.n_heads, a.n_kv_heads, a.head_dim, *refs, a.rope_theta, a.qk_norm_eps,
                            a.max_seq_len, int(a.kv_dtype))


def set_tensor_crcs(buf: bytearray) -> None:
    """Recompute a version-3 image's CRC table from its payloads and then the header CRC, in place
    (after editing a payload); for versions 1 and 2 the header CRC only."""
    if int.from_bytes(bytes(buf[4:6]), "little") >= F.TENSOR_CRC_VERSION:
        n_t, t_off = struct.unpack_from("<II", buf, 32)
        _, crc_off = F.V3_FIELDS.unpack_from(buf, F.V3_FIELDS_OFFSET)
        for i in range(n_t):
            off, nbytes = struct.unpack_from("<II", buf, t_off + i * F.TENSOR.size)
            struct.pack_into("<I", buf, crc_off + 4 * i, zlib.crc32(memoryview(buf)[off : off + nbytes]) & 0xFFFFFFFF)
    set_crc(buf)


def crc_end(image: bytes | bytearray | memoryview) -> int:
    """Where the header CRC's range ends: image_size, or meta_size in a version-3 or later image."""
    if int.from_bytes(bytes(image[4:6]), "little") >= F.TENSOR_CRC_VERSION:
        return F.V3_FIELDS.unpack_from(bytes(image[F.V3_FIELDS_OFFSET : F.V3_FIELDS_OFFSET + 8]))[0]
    return int.from_bytes(bytes(image[12:16]), "little")


def crc_of(image: bytes | bytearray | memoryview) -> int:
    """The header CRC-32: of [12, image_size), in version 3 of [12, meta_size) (the metadata)."""
    return zlib.crc32(memoryview(image)[F.CRC_START : crc_end(image)]) & 0xFFFFFFFF


def set_crc(buf: bytearray) -> None:
    """Recompute the header CRC in place (after editing an image)."""
    buf[F.HEADER_CRC_OFFSET : F.HEADER_CRC_OFFSET + 4] = crc_of(buf).to_bytes(4, "little")


# ---------------------------------------------------------------------------
# Reader


def version_text(version: int, accepted: tuple[int, int] = (F.MIN_READ_VERSION, F.MAX_READ_VERSION),
                 reader: str = "this engine") -> str:
    """Why an image of `version` cannot run on a reader of the `accepted` (min, max) versions."""
    lo, hi = accepted
    age = "newer" if version > hi else "older"
    return f"image format version {version} is {age} than {reader} reads ({lo}..{hi})"


def check_version(data: bytes | bytearray | memoryview, accepted: tuple[int, int], reader: str) -> None:
    """Raises ImageError(UNSUPPORTED_VERSION) when a firmware reading the `accepted` (min, max) format
    versions would refuse `data` for its version; anything else wrong is left to `read`."""
    if len(data) >= 6 and bytes(data[:4]) == F.MAGIC.to_bytes(4, "little"):
        version = int.from_bytes(bytes(data[4:6]), "little")
        if version not in F.INVALID_VERSIONS and not accepted[0] <= version <= accepted[1]:
            _fail(Status.UNSUPPORTED_VERSION, version_text(version, accepted, reader))


def _fail(status: Status, detail: str) -> None:
    raise error_for(status, detail)


@dataclass
class Work:
    """What `read` visited: table records read plus payload entries scanned.

    Pass one to `read(data, work=...)` to bound the reader's work by a count
    (the C validator's twin is colibri_check_work, tests/c/colibri_work.c)."""

    visits: int = 0


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview, work: Work | None = None, full: bool = True):
        self.buf = memoryview(data).cast("B")
        self.n = len(self.buf)
        self.work = Work() if work is None else work
        self.full = full  # check the payload CRCs (version 3)
        self.meta = 0  # version 3: the metadata ends here, payloads start at or after it
        self.crc_off = 0

    def header(self) -> tuple:
        if self.n < F.HEADER_SIZE:
            _fail(Status.TRUNCATED, f"{self.n} bytes, the header alone is {F.HEADER_SIZE}")
        h = F.HEADER.unpack_from(self.buf, 0)
        (magic, version, header_size, crc, size, flags, n_in, n_out, max_batch, *_) = h
        if magic != F.MAGIC:
            _fail(Status.BAD_MAGIC, f"magic 0x{magic:08x}")
        if version in F.INVALID_VERSIONS:
            _fail(Status.BAD_VERSION, f"version field 0x{version:04x}")
        if not F.MIN_READ_VERSION <= version <= F.MAX_READ_VERSION:
            _fail(Status.UNSUPPORTED_VERSION, version_text(version))
        if header_size != F.HEADER_SIZE:
            _fail(Status.BAD_HEADER, f"header_size {header_size}")
        if size < F.HEADER_SIZE:
            _fail(Status.BAD_HEADER, f"image_size {size}")
        if size > self.n:
            _fail(Status.TRUNCATED, f"image_size {size} but only {self.n} bytes")
        v3 = version >= F.TENSOR_CRC_VERSION  # v4 keeps v3's metadata CRC and CRC table
        self.version = version
        if v3:
            self.meta, self.crc_off = F.V3_FIELDS.unpack_from(self.buf, F.V3_FIELDS_OFFSET)
            if self.meta % 4 or not F.HEADER_SIZE <= self.meta <= size:
                _fail(Status.BAD_HEADER, f"meta_size {self.meta} (4-aligned, {F.HEADER_SIZE}..image_size {size})")
        if crc != crc_of(self.buf):
            _fail(Status.BAD_CRC, f"stored 0x{crc:08x}, computed 0x{crc_of(self.buf):08x}")
        reserved_from = {1: 64, 2: 64, 3: 72}.get(version, 80)  # v4: 72..80 hold the attention table's place
        if any(self.buf[reserved_from : 80]) or flags & ~int(F.Flag.PAGE_ALIGNED):
            _fail(Status.BAD_HEADER, "reserved bits set")
        if n_in == 0 or n_out == 0:
            _fail(Status.BAD_HEADER, "input_size and output_size must be >= 1")
        if not 1 <= max_batch <= F.MAX_BATCH_LIMIT:
            _fail(Status.BAD_HEADER, f"max_batch {max_batch}")
        if h[11] == 0:
            _fail(Status.BAD_HEADER, "no layers")
        self.token = is_token_model(version, self.buf)
        if self.token and n_in != n_out:
            _fail(Status.BAD_HEADER, f"a token model's input_size and output_size are both vocab_size, got {n_in} "
                                     f"and {n_out}")
        self.size = size
        return h

    def table(self, count: int, offset: int, rec) -> list[tuple]:
        end = offset + count * rec.size
        limit = self.meta or self.size  # version 3: inside the metadata
        if offset % 4 or offset < F.HEADER_SIZE or end > limit:
            _fail(Status.TABLE_BOUNDS, f"table at {offset} x {count} records exceeds the "
                                       + (f"metadata of {limit} bytes" if self.meta else f"image of {limit} bytes"))
        self.work.visits += count
        return [rec.unpack_from(self.buf, offset + i * rec.size) for i in range(count)]


def is_token_model(version: int, header: bytes | bytearray | memoryview) -> bool:
    """Whether an image is a token model (docs/lm.md): every version 4 image; a version 5 image when
    its attention table is not empty (v5 holds feature models with int4 weights too)."""
    if version == F.LM_VERSION:
        return True
    return version >= F.Q4_VERSION and F.V4_FIELDS.unpack_from(header, F.V4_FIELDS_OFFSET)[0] != 0


class _Owners:
    """The next MOE layer must name a MoE record, experts and an expert map
    that no earlier MOE layer owns: indices from these on."""

    moe = expert = emap = attention = 0


def status(data: bytes | bytearray | memoryview, *, work: Work | None = None, check: str = "full") -> int:
    """What colibri_validate returns for this image: 0 (OK) or the negative Status of the first
    failure, found in the same order (the differential tests and fuzzer compare the two);
    check="structure" is colibri_validate_ex(..., COLIBRI_CHECK_STRUCTURE)."""
    try:
        read(data, work=work, check=check)
    except ColibriError as exc:
        return int(exc.status)
    return 0


def read(data: bytes | bytearray | memoryview, *, work: Work | None = None, check: str = "full") -> Graph:
    """Parse and validate an image. Weights are numpy views into `data` (zero copy), except int4
    values, unpacked into one int8 each (`Q4Weight.packed` is the view of their bytes).

    `work`, if given, is increased by the records and payload entries visited. `check="structure"`
    leaves out the per-tensor payload CRCs of a version-3 image, as COLIBRI_CHECK_STRUCTURE."""
    if check not in ("full", "structure"):
        raise ValueError(f"check must be 'full' or 'structure', got {check!r}")
    work = Work() if work is None else work
    r = _Reader(data, work, full=check == "full")
    h = r.header()
    (_, _, _, _, size, flags, n_in, n_out, max_batch, n_t, t_off, n_l, l_off, n_m, m_off, n_e, e_off) = h
    t_recs = r.table(n_t, t_off, F.TENSOR)
    l_recs = r.table(n_l, l_off, F.LAYER)
    m_recs = r.table(n_m, m_off, F.MOE)
    e_recs = r.table(n_e, e_off, F.EXPERT)
    token_model = r.token
    a_recs: list[tuple] = []
    if h[1] >= F.LM_VERSION:
        n_a, a_off = F.V4_FIELDS.unpack_from(r.buf, F.V4_FIELDS_OFFSET)
        a_recs = r.table(n_a, a_off, F.ATTENTION)
        a_reserved = [bytes(r.buf[a_off + i * F.ATTENTION.size + 65 : a_off + (i + 1) * F.ATTENTION.size])
                      for i in range(n_a)]
    if r.meta:  # the CRC table: bounds as the other tables', entries read as each payload is checked
        if r.crc_off % 4 or r.crc_off < F.HEADER_SIZE or r.crc_off + 4 * n_t > r.meta:
            _fail(Status.TABLE_BOUNDS, f"CRC table at {r.crc_off} x {n_t} exceeds the metadata of {r.meta} bytes")
        r.crcs = [(c,) for c in struct.unpack_from(f"<{n_t}I", r.buf, r.crc_off)]

    objs = _tensors(r, t_recs, size, h[1])

    def tensor(ref: int, shape: tuple[int, ...], what: str, *, optional: bool = False, dtype: str = "<f4"):
        """A vector/bias (f32) or the expert map (i32) of exactly this shape."""
        if ref == NONE and optional:
            return None
        obj = objs[ref] if ref < n_t else None
        work.visits += ref < n_t
        if not isinstance(obj, np.ndarray) or obj.shape != shape or obj.dtype != np.dtype(dtype):
            _fail(Status.BAD_REF, f"{what}: expected {shape} {np.dtype(dtype)}, got {_describe(obj, ref, n_t)}")
        return obj

    def weight(ref: int, shape: tuple[int, int], what: str, *, optional: bool = False,
               int4: bool = True) -> Weight | None:
        """A weight matrix: f32, f16, int8 with its companion, or int4 with its companion where
        `int4` (not routers, shared gates or embedding tables: BAD_REF)."""
        if ref == NONE and optional:
            return None
        obj = objs[ref] if ref < n_t else None
        work.visits += ref < n_t
        is_f32 = isinstance(obj, np.ndarray) and obj.dtype == np.dtype("<f4")
        # The record's rank, not the array's: int8 payloads are always viewed as [rows, cols].
        kinds = (F16Weight, Q8Weight, Q4Weight) if int4 else (F16Weight, Q8Weight)
        if not (is_f32 or isinstance(obj, kinds)) or obj.shape != shape or t_recs[ref][5] != 2:
            _fail(Status.BAD_REF, f"{what}: expected weight {shape}" + ("" if int4 else " (f32, f16 or int8)")
                  + f", got {_describe(obj, ref, n_t)}")
        return obj

    def expert(j: int, d: int, where: str) -> Expert:
        kind, act, e_flags, hidden, w1, b1, w2, b2, w3, b3 = e_recs[j]
        work.visits += 1
        both = int(F.ExpertFlag.INT8_ACT | F.ExpertFlag.INT8_BLOCKS)
        if (kind not in iter(ExpertKind) or act not in iter(Act) or e_flags & ~both or e_flags == both
                or hidden == 0):
            _fail(Status.BAD_MOE, f"{where}: kind {kind} activation {act} flags {e_flags} hidden {hidden}")
        glu = kind == ExpertKind.GLU
        if (w3 != NONE) != glu or (not glu and b3 != NONE):
            _fail(Status.BAD_MOE, f"{where}: w3/b3 do not match expert kind")
        if page and w1 < n_t:
            work.visits += 1
            if t_recs[w1][0] % F.PAGE_SIZE:
                _fail(Status.TENSOR_BOUNDS, f"{where}: not page aligned")
        e = Expert(
            kind=ExpertKind(kind), act=Act(act),
            w1=weight(w1, (hidden, d), f"{where} w1"),
            b1=tensor(b1, (hidden,), f"{where} b1", optional=True),
            w2=weight(w2, (d, hidden), f"{where} w2"),
            b2=tensor(b2, (d,), f"{where} b2", optional=True),
            w3=weight(w3, (hidden, d), f"{where} w3", optional=True),
            b3=tensor(b3, (hidden,), f"{where} b3", optional=True),
            int8_act=bool(e_flags & F.ExpertFlag.INT8_ACT),
            int8_blocks=bool(e_flags & F.ExpertFlag.INT8_BLOCKS),
        )
        if e.int8_act or e.int8_blocks:
            work.visits += 2 + glu
        if (e.int8_act or e.int8_blocks) and not all(isinstance(w, QuantWeight) for w in (e.w1, e.w2, e.w3)
                                                     if w is not None):
            _fail(Status.BAD_MOE, f"{where}: INT8_ACT and INT8_BLOCKS need int8 or int4 weights")
        return e

    seq_len: list[int] = []  # max_seq_len of the first attention record read: every other must match

    def attention(j: int, width: int, where: str) -> Attention:
        """Attention record j, every field checked (docs/lm.md "Attention record"): BAD_ATTENTION."""
        d, heads, kv_heads, hd, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, q_n, k_n, theta, eps, msl, kv = a_recs[j]
        work.visits += 1

        def bad(why: str) -> None:
            _fail(Status.BAD_ATTENTION, f"{where} (attention record {j}): {why}")

        if any(a_reserved[j]):
            bad("reserved bytes set")
        if kv not in (DType.F32, DType.F16):
            bad(f"kv_dtype {kv} (F32 or F16)")
        if d != width:
            bad(f"d_model {d}, the layer's width is {width}")
        if heads == 0 or kv_heads == 0 or heads % kv_heads:
            bad(f"{heads} heads over {kv_heads} kv heads (kv heads must divide heads, both >= 1)")
        if hd == 0 or hd % 2:
            bad(f"head_dim {hd} (even, >= 2: RoPE rotates pairs)")
        if not (math.isfinite(theta) and theta > 0):
            bad(f"rope_theta {theta}")
        if msl == 0 or (seq_len and msl != seq_len[0]):
            bad(f"max_seq_len {msl}" + (f", an earlier record has {seq_len[0]}" if seq_len else ""))
        has_norm = q_n != NONE or k_n != NONE
        if (has_norm and not (math.isfinite(eps) and eps > 0)) or (not has_norm and eps != 0):
            bad(f"qk_norm_eps {eps} (finite and > 0 with a q/k norm, 0 without)")
        seq_len[:1] = [msl]

        def matrix(ref: int, shape: tuple[int, int], what: str) -> Weight:
            obj = objs[ref] if ref < n_t else None
            work.visits += ref < n_t
            is_f32 = isinstance(obj, np.ndarray) and obj.dtype == np.dtype("<f4")
            if not (is_f32 or isinstance(obj, (F16Weight, Q8Weight, Q4Weight))) or obj.shape != shape or t_recs[ref][5] != 2:
                bad(f"{what}: expected a weight {shape}, got {_describe(obj, ref, n_t)}")
            return obj

        def vector(ref: int, sizes: tuple[int, ...], what: str) -> np.ndarray | None:
            if ref == NONE:
                return None
            obj = objs[ref] if ref < n_t else None
            work.visits += ref < n_t
            if not (isinstance(obj, np.ndarray) and obj.dtype == np.dtype("<f4") and obj.ndim == 1
                    and obj.shape[0] in sizes):
                bad(f"{what}: expected an f32 vector of {' or '.join(map(str, sizes))}, got {_describe(obj, ref, n_t)}")
            return obj

        q_out, kv_out = heads * hd, kv_heads * hd
        return Attention(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=hd,
            q_w=matrix(q_w, (q_out, d), "q_w"), q_b=vector(q_b, (q_out,), "q_b"),
            k_w=matrix(k_w, (kv_out, d), "k_w"), k_b=vector(k_b, (kv_out,), "k_b"),
            v_w=matrix(v_w, (kv_out, d), "v_w"), v_b=vector(v_b, (kv_out,), "v_b"),
            o_w=matrix(o_w, (d, q_out), "o_w"), o_b=vector(o_b, (d,), "o_b"),
            q_norm=vector(q_n, (hd, q_out), "q_norm"), k_norm=vector(k_n, (hd, kv_out), "k_norm"),
            rope_theta=theta, qk_norm_eps=eps, max_seq_len=msl, kv_dtype=DType(kv),
        )

    page = bool(flags & F.Flag.PAGE_ALIGNED)
    layers = []
    width = n_in
    depth_widths: list[int] = []
    owners = _Owners()
    for i, (op, kind, l_flags, in_f, out_f, t0, t1, eps, res1, res2) in enumerate(l_recs):
        where = f"layer {i}"
        work.visits += 1
        both = int(F.LayerFlag.INT8_ACT | F.LayerFlag.INT8_BLOCKS)
        bad_flags = l_flags & ~both or l_flags == both
        if op not in iter(Op) or bad_flags or res1 or res2 or (kind != 0) != (op == Op.ACTIVATION):
            _fail(Status.BAD_LAYER, f"{where}: op {op} kind {kind}")
        if op in (Op.EMBED, Op.ATTENTION) and not token_model:
            _fail(Status.BAD_LAYER, f"{where}: {Op(op).name} in a version {h[1]} image (token models are version "
                                    f"{F.LM_VERSION})")
        if token_model and (i == 0) != (op == Op.EMBED):
            _fail(Status.BAD_LAYER, f"{where}: a token model's layer 0 is EMBED, and no other layer is")
        if l_flags and op != Op.LINEAR:
            _fail(Status.BAD_LAYER, f"{where}: INT8_ACT or INT8_BLOCKS on a {Op(op).name} layer (LINEAR only)")
        if in_f != width:
            _fail(Status.BAD_LAYER, f"{where}: in_features {in_f}, current width {width}")
        if op not in (Op.LINEAR, Op.EMBED) and out_f != in_f:
            _fail(Status.BAD_LAYER, f"{where}: out_features {out_f} != in_features {in_f}")
        is_norm = op in (Op.LAYERNORM, Op.RMSNORM)
        if (is_norm and not (math.isfinite(eps) and eps > 0)) or (not is_norm and eps != 0):
            _fail(Status.BAD_LAYER, f"{where}: eps {eps}")
        takes = {Op.LINEAR: 2, Op.LAYERNORM: 2, Op.RMSNORM: 1, Op.MOE: 1, Op.EMBED: 1, Op.ATTENTION: 1}.get(Op(op), 0)
        if (takes < 1 and t0 != NONE) or (takes < 2 and t1 != NONE):
            _fail(Status.BAD_LAYER, f"{where}: unexpected tensor reference")
        if op == Op.LINEAR:
            w = weight(t0, (out_f, in_f), f"{where} weight")
            b = tensor(t1, (out_f,), f"{where} bias", optional=True)
            layers.append(Linear(w, b, int8_act=bool(l_flags & F.LayerFlag.INT8_ACT),
                                 int8_blocks=bool(l_flags & F.LayerFlag.INT8_BLOCKS)))
        elif op == Op.EMBED:
            table = weight(t0, (in_f, out_f), f"{where} table", int4=False)
            if isinstance(table, Q8Weight) and table.bias is not None:
                _fail(Status.BAD_REF, f"{where} table: an int8 table whose Q8_PARAMS holds a bias (rows have none)")
            layers.append(Embedding(table))
        elif op == Op.ATTENTION:
            if t0 >= len(a_recs):
                _fail(Status.BAD_REF, f"{where}: attention record {t0} of {len(a_recs)}")
            if t0 < owners.attention:
                _fail(Status.BAD_REF, f"{where}: attention record {t0} belongs to an earlier ATTENTION layer")
            layers.append(attention(t0, in_f, where))
            owners.attention = t0 + 1
        elif op == Op.ACTIVATION:
            if kind not in iter(Act):
                _fail(Status.BAD_LAYER, f"{where}: activation {kind}")
            layers.append(Activation(Act(kind)))
        elif op == Op.LAYERNORM:
            layers.append(LayerNorm(in_f, eps, tensor(t0, (in_f,), f"{where} weight", optional=True), tensor(t1, (in_f,), f"{where} bias", optional=True)))
        elif op == Op.RMSNORM:
            layers.append(RMSNorm(in_f, eps, tensor(t0, (in_f,), f"{where} weight", optional=True)))
        elif op == Op.RESIDUAL_PUSH:
            if len(depth_widths) >= F.MAX_RESIDUAL_DEPTH:
                _fail(Status.BAD_LAYER, f"{where}: residual nesting deeper than {F.MAX_RESIDUAL_DEPTH}")
            depth_widths.append(width)
            layers.append(ResidualPush())
        elif op == Op.RESIDUAL_ADD:
            if not depth_widths or depth_widths.pop() != width:
                _fail(Status.BAD_LAYER, f"{where}: residual add without a matching push of width {width}")
            layers.append(ResidualAdd())
        else:  # MOE
            if t0 >= n_m:
                _fail(Status.BAD_REF, f"{where}: MoE record {t0} of {n_m}")
            if t0 < owners.moe:
                _fail(Status.BAD_REF, f"{where}: MoE record {t0} belongs to an earlier MOE layer")
            work.visits += 1
            layers.append(_moe(m_recs[t0], in_f, where, tensor, weight, expert, n_e, owners, work))
            owners.moe = t0 + 1
        if l_flags:
            work.visits += 1
            if not isinstance(layers[-1].weight, QuantWeight):
                _fail(Status.BAD_LAYER, f"{where}: INT8_ACT and INT8_BLOCKS need an int8 or int4 weight")
        width = out_f
    if depth_widths:
        _fail(Status.BAD_LAYER, "residual push without add at end of program")
    if token_model and owners.attention == 0:
        _fail(Status.BAD_LAYER, "a token model without an ATTENTION layer")
    if width != n_out:
        _fail(Status.BAD_LAYER, f"program ends at width {width}, output_size is {n_out}")
    return Graph(layers=layers, input_size=n_in, output_size=n_out, max_batch=max_batch)


def _describe(obj, ref: int, n_t: int) -> str:
    if ref >= n_t:
        return f"tensor {ref} of {n_t}"
    if obj is None:
        return "a quantisation companion"
    return f"{type(obj).__name__} {obj.shape}" + (f" {obj.dtype}" if isinstance(obj, np.ndarray) else "")


def _q8_header(buf: memoryview, off: int, version: int) -> tuple[int, int, bool, bool]:
    """(nnz, bytes per parameter, BIAS, header codes valid) of the Q8_PARAMS payload at off."""
    nnz, dtype, flags, reserved = struct.unpack_from("<IBBH", buf, off)
    if version < 2:
        return nnz, 4, False, True  # v1's reserved word is checked with the scales
    ok = dtype in (DType.F32, DType.F16) and not flags & ~int(F.Q8Flag.BIAS) and not reserved
    return nnz, 2 if dtype == DType.F16 else 4, bool(flags & F.Q8Flag.BIAS), ok


def _tensors(r: _Reader, t_recs: list[tuple], size: int, version: int) -> list:
    """Checks every tensor record, then every int8 tensor's companion; returns the
    tensors as arrays / F16Weight / Q8Weight (None for Q8_PARAMS companions)."""
    buf = r.buf
    prev_end = 0  # payloads lie in table order and never overlap
    for i, (off, nbytes, rows, cols, dtype, ndim, res, aux) in enumerate(t_recs):
        r.work.visits += 1
        if (off % F.PAYLOAD_ALIGN or off < F.HEADER_SIZE or off < prev_end or off < r.meta or off >= size
                or off + nbytes > size):
            _fail(Status.TENSOR_BOUNDS, f"tensor {i} at {off}+{nbytes}" + (
                f" overlaps the previous payload (ends at {prev_end})" if off < prev_end else "") + (
                f" inside the metadata (ends at {r.meta})" if off < r.meta else ""))
        if r.meta and r.full and zlib.crc32(buf[off : off + nbytes]) & 0xFFFFFFFF != r.crcs[i][0]:
            _fail(Status.BAD_PAYLOAD_CRC, f"tensor {i} at {off}+{nbytes}")
        if dtype not in iter(DType) or (dtype in (DType.I4, DType.Q4_PARAMS) and version < F.Q4_VERSION):
            _fail(Status.BAD_TENSOR, f"tensor {i} dtype {dtype}" + (
                f" (int4 tensors are format version {F.Q4_VERSION})" if dtype in iter(DType) else ""))
        if ndim not in (1, 2) or (ndim == 1 and cols != 1) or rows == 0 or cols == 0 or res:
            _fail(Status.BAD_TENSOR, f"tensor {i} shape {rows}x{cols} ndim {ndim}")
        if aux != NONE and dtype not in (DType.I8, DType.I4):
            _fail(Status.BAD_TENSOR, f"tensor {i}: only int8 and int4 tensors have a companion")
        if dtype == DType.Q4_PARAMS:
            if nbytes < F.Q4_PARAMS_HEADER:
                _fail(Status.BAD_TENSOR, f"tensor {i}: Q4_PARAMS of {nbytes} bytes")
            nnz, g_log2, bias, ok = _q4_header(buf, off)
            if not ok:
                _fail(Status.BAD_QUANT, f"tensor {i}: Q4_PARAMS header {bytes(buf[off + 4 : off + 8]).hex()} (group_log2 "
                                        f"{F.Q4_GROUP_LOG2_MIN}..{F.Q4_GROUP_LOG2_MAX}, flags BIAS only, reserved zero)")
            want = F.q4_layout(rows, cols, nnz, g_log2, bias)["size"]
            if want != nbytes or (nnz and cols > 65536):
                _fail(Status.BAD_TENSOR, f"tensor {i}: Q4_PARAMS of {nbytes} bytes for {rows}x{cols}, nnz {nnz}, "
                                         f"group {1 << g_log2}")
        elif dtype == DType.I4:
            if nbytes != rows * F.q4_row_bytes(cols):
                _fail(Status.BAD_TENSOR, f"tensor {i}: I4 of {nbytes} bytes for {rows}x{cols}")
        elif dtype == DType.Q8_PARAMS:
            if nbytes < F.Q8_PARAMS_HEADER:
                _fail(Status.BAD_TENSOR, f"tensor {i}: Q8_PARAMS of {nbytes} bytes")
            nnz, param, bias, ok = _q8_header(buf, off, version)
            if not ok:
                _fail(Status.BAD_QUANT, f"tensor {i}: Q8_PARAMS header {bytes(buf[off + 4 : off + 8]).hex()} "
                                        "(parameter dtype F32 or F16, flags BIAS only, reserved zero)")
            want = F.q8_layout(version, rows, nnz, param, bias)["size"]
            if want != nbytes or (nnz and cols > 65536):
                _fail(Status.BAD_TENSOR, f"tensor {i}: Q8_PARAMS of {nbytes} bytes for {rows}x{cols}, nnz {nnz}")
        elif nbytes != rows * cols * F.DTYPE_SIZE[DType(dtype)]:
            _fail(Status.BAD_TENSOR, f"tensor {i} nbytes {nbytes} != {rows}x{cols}")
        prev_end = off + nbytes

    objs: list = []
    for i, (off, nbytes, rows, cols, dtype, ndim, _, aux) in enumerate(t_recs):
        r.work.visits += 1
        shape = (rows, cols) if ndim == 2 else (rows,)
        if dtype in (DType.Q8_PARAMS, DType.Q4_PARAMS):
            objs.append(None)
        elif dtype == DType.I4:
            packed = np.frombuffer(buf, dtype=np.uint8, count=rows * F.q4_row_bytes(cols), offset=off)
            objs.append(_q4(buf, t_recs, i, packed.reshape(rows, F.q4_row_bytes(cols)), r.work))
        elif dtype == DType.I8:
            q = np.frombuffer(buf, dtype=np.int8, count=rows * cols, offset=off).reshape(rows, cols)
            objs.append(_q8(buf, t_recs, i, q, r.work, version))
        else:
            np_dtype = {DType.F32: "<f4", DType.F16: "<f2", DType.I32: "<i4"}[DType(dtype)]
            a = np.frombuffer(buf, dtype=np_dtype, count=rows * cols, offset=off).reshape(shape)
            objs.append(F16Weight(a) if dtype == DType.F16 else a)
    return objs


def _subnormal(h: np.ndarray) -> bool:
    """Whether an f16 array holds a subnormal number (exponent 0, fraction nonzero)."""
    bits = h.view("<u2")
    return bool(np.any(((bits & 0x7C00) == 0) & ((bits & 0x03FF) != 0)))


def _q8(buf: memoryview, t_recs: list[tuple], i: int, q: np.ndarray, work: Work, version: int) -> Q8Weight:
    """The int8 tensor i with its Q8_PARAMS companion, validated."""
    rows, cols = q.shape
    aux = t_recs[i][7]
    if aux >= len(t_recs) or t_recs[aux][4] != DType.Q8_PARAMS or t_recs[aux][2:4] != (rows, cols):
        _fail(Status.BAD_QUANT, f"tensor {i}: companion {aux} is not a Q8_PARAMS tensor of {rows}x{cols}")
    work.visits += 1
    off = t_recs[aux][0]
    nnz, param, has_bias, _ = _q8_header(buf, off, version)
    if version < 2 and struct.unpack_from("<I", buf, off + 4)[0]:
        _fail(Status.BAD_QUANT, f"tensor {i}: companion reserved word {struct.unpack_from('<I', buf, off + 4)[0]}")
    at = F.q8_layout(version, rows, nnz, param, has_bias)
    p_dtype = "<f2" if param == 2 else "<f4"
    work.visits += rows
    scale = np.frombuffer(buf, dtype=p_dtype, count=rows, offset=off + at["scale"])
    if not np.all(np.isfinite(scale)) or np.any(scale < 0) or (param == 2 and _subnormal(scale)):
        _fail(Status.BAD_QUANT, f"tensor {i}: scales must be finite and >= 0" + (", f16 ones 0 or normal" if param == 2 else ""))
    bias = np.frombuffer(buf, dtype=p_dtype, count=rows, offset=off + at["bias"]) if has_bias else None
    if bias is not None and param == 2:
        work.visits += rows
        if not np.all(np.isfinite(bias)) or _subnormal(bias):
            _fail(Status.BAD_QUANT, f"tensor {i}: f16 biases must be 0 or normal numbers")
    params_end = at["bias" if has_bias else "scale"] + param * rows
    row_ptr, col, val = _compensation(buf, off, at, i, rows, cols, nnz, F.q8_row_ptr_bytes(version, nnz),
                                      params_end, work)
    return Q8Weight(q=q, scale=scale, row_ptr=row_ptr, col=col, val=val, bias=bias)


def _q4_header(buf: memoryview, off: int) -> tuple[int, int, bool, bool]:
    """(nnz, group_log2, BIAS, header codes valid) of the Q4_PARAMS payload at off."""
    nnz, g_log2, flags, reserved = F.Q4_PARAMS_FIELDS.unpack_from(buf, off)
    ok = F.Q4_GROUP_LOG2_MIN <= g_log2 <= F.Q4_GROUP_LOG2_MAX and not flags & ~int(F.Q4Flag.BIAS) and not reserved
    return nnz, g_log2, bool(flags & F.Q4Flag.BIAS), ok


def _q4(buf: memoryview, t_recs: list[tuple], i: int, packed: np.ndarray, work: Work) -> Q4Weight:
    """The int4 tensor i with its Q4_PARAMS companion, validated in the C validator's order: the
    companion (BAD_QUANT), the unused nibbles of odd rows, the group scales and the bias (BAD_QUANT),
    then E (BAD_COMPENSATION)."""
    rows, cols = t_recs[i][2:4]
    aux = t_recs[i][7]
    if aux >= len(t_recs) or t_recs[aux][4] != DType.Q4_PARAMS or t_recs[aux][2:4] != (rows, cols):
        _fail(Status.BAD_QUANT, f"tensor {i}: companion {aux} is not a Q4_PARAMS tensor of {rows}x{cols}")
    work.visits += 1
    if cols % 2:
        work.visits += rows
        if np.any(packed[:, -1] & 0xF0):
            _fail(Status.BAD_QUANT, f"tensor {i}: the unused high nibble of a row's last byte (odd cols {cols}) is not zero")
    off = t_recs[aux][0]
    nnz, g_log2, has_bias, _ = _q4_header(buf, off)
    groups = F.q4_groups(cols, g_log2)
    at = F.q4_layout(rows, cols, nnz, g_log2, has_bias)
    work.visits += rows * groups
    scale = np.frombuffer(buf, dtype="<f2", count=rows * groups, offset=off + at["scale"])
    if not np.all(np.isfinite(scale)) or np.any(scale < 0) or _subnormal(scale):
        _fail(Status.BAD_QUANT, f"tensor {i}: int4 group scales must be finite, >= 0, and 0 or normal f16")
    bias = None
    if has_bias:
        work.visits += rows
        bias = np.frombuffer(buf, dtype="<f2", count=rows, offset=off + at["bias"])
        if not np.all(np.isfinite(bias)) or _subnormal(bias):
            _fail(Status.BAD_QUANT, f"tensor {i}: f16 biases must be 0 or normal numbers")
    params_end = at["bias" if has_bias else "scale"] + 2 * rows * (1 if has_bias else groups)
    row_ptr, col, val = _compensation(buf, off, at, i, rows, cols, nnz, F.q8_row_ptr_bytes(2, nnz), params_end, work)
    return Q4Weight(q=q4_unpack(packed, cols), scale=scale.reshape(rows, groups), group=1 << g_log2,
                    row_ptr=row_ptr, col=col, val=val, bias=bias, packed=packed)


def _compensation(buf: memoryview, off: int, at: dict[str, int], i: int, rows: int, cols: int, nnz: int,
                  width: int, params_end: int, work: Work) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR term E of a companion at off (row_ptr, col, val), validated: BAD_COMPENSATION for
    nonzero padding, row pointers not 0 .. nnz non-decreasing, columns out of range or not increasing
    within a row, non-finite values."""
    empty = np.zeros(0, dtype="<u2")
    # No E: all-zero row pointers [rows + 1], as the quantiser makes them (ir.Q8Weight's contract).
    row_ptr = (np.frombuffer(buf, dtype=f"<u{width}", count=rows + 1, offset=off + at["row_ptr"]) if nnz
               else np.zeros(rows + 1, "<u4"))
    col = np.frombuffer(buf, dtype="<u2", count=nnz, offset=off + at["col"]) if nnz else empty
    val = np.frombuffer(buf, dtype="<f2", count=nnz, offset=off + at["val"]) if nnz else empty.view("<f2")
    if nnz:
        work.visits += rows + 1 + 2 * nnz
        gaps = [(params_end, at["row_ptr"]), (at["row_ptr"] + width * (rows + 1), at["col"]),
                (at["col"] + 2 * nnz, at["val"])]
        padded = any(any(buf[off + a : off + b]) for a, b in gaps)
        ptr = row_ptr.astype(np.int64)
        cols_ok = np.all(col < cols)
        starts = np.zeros(nnz, dtype=bool)
        starts[ptr[:-1][ptr[:-1] < nnz]] = True  # first entry of each non-empty row
        increasing = np.all((np.diff(col.astype(np.int64)) > 0) | starts[1:])
        if (padded or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != nnz or not cols_ok or not increasing
                or not np.all(np.isfinite(val))):
            _fail(Status.BAD_COMPENSATION, f"tensor {i}: malformed compensation term")
    return row_ptr, col, val


def _moe(rec: tuple, width: int, where: str, tensor, weight, expert, n_e: int, owners: _Owners, work: Work) -> MoE:
    d, r_count, n, k, routing, flags, n_shared, rw, rb, emap, first, gate, res1, res2 = rec
    if routing not in iter(Routing) or res1 or res2:
        _fail(Status.BAD_MOE, f"{where}: routing mode {routing}")
    if d != width or not 1 <= r_count <= F.MAX_ROUTES or not 1 <= n <= r_count or n_shared > F.MAX_SHARED:
        _fail(Status.BAD_MOE, f"{where}: d_model {d} routes {r_count} experts {n} shared {n_shared}")
    k_ok = {Routing.TOP1: k == 1, Routing.DENSE: k == 0}.get(Routing(routing), 1 <= k <= n)
    if not k_ok:
        _fail(Status.BAD_MOE, f"{where}: top_k {k} for {Routing(routing).name}")
    renorm = bool(flags & F.MoEFlag.RENORMALIZE)
    if flags & ~int(F.MoEFlag.RENORMALIZE) or (renorm and routing != Routing.SOFTMAX_TOPK):
        _fail(Status.BAD_MOE, f"{where}: flags {flags}")
    if first + n + n_shared > n_e:
        _fail(Status.BAD_REF, f"{where}: experts {first}..{first + n + n_shared} of {n_e}")
    if first < owners.expert:
        _fail(Status.BAD_REF, f"{where}: expert {first} belongs to an earlier MOE layer")
    emap_arr = tensor(emap, (r_count,), f"{where} expert_map", dtype="<i4")
    if emap < owners.emap:
        _fail(Status.BAD_REF, f"{where}: expert_map tensor {emap} belongs to an earlier MOE layer")
    work.visits += r_count
    kept = emap_arr[emap_arr != -1]
    if np.any(emap_arr < -1) or sorted(kept.tolist()) != list(range(n)):
        _fail(Status.BAD_MOE, f"{where}: expert_map is not a permutation of 0..{n - 1} plus -1")
    owners.expert, owners.emap = first + n + n_shared, emap + 1
    return MoE(
        routing=Routing(routing), top_k=k,
        router_weight=weight(rw, (r_count, d), f"{where} router weight", int4=False),
        router_bias=tensor(rb, (r_count,), f"{where} router bias", optional=True),
        expert_map=emap_arr,
        renormalize=renorm,
        experts=[expert(first + i, d, f"{where} expert {i}") for i in range(n)],
        shared=[expert(first + n + i, d, f"{where} shared expert {i}") for i in range(n_shared)],
        shared_gate=weight(gate, (1, d), f"{where} shared gate", optional=True, int4=False),
    )
