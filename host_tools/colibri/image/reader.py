"""The model image reader: `read(bytes) -> Graph` and `status(bytes) -> int`.

`read` validates as the C engine does and raises `ImageError` with the same status code the
engine would return, in the same order (docs/model-format.md "Validation order"), in time
linear in the image size.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ..model import format as F
from ..model.errors import ColibriError, error_for
from ..model.format import NONE, Act, DType, ExpertKind, Op, Routing, Status
from ..model.ir import (
    Activation, Attention, Embedding, Expert, F16Weight, Graph, LayerNorm, Linear, MoE, Q4Weight, Q8Weight,
    QuantWeight, ResidualAdd, ResidualPush, RMSNorm, Weight,
)
from .codecs import crc_of, q4_unpack
from . import tokenizer_section


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
    def __init__(self, data: bytes | bytearray | memoryview, work: Work | None = None, full: bool = True,
                 max_image_bytes: int | None = None):
        self.buf = memoryview(data).cast("B")
        self.n = len(self.buf)
        self.work = Work() if work is None else work
        self.full = full  # check the payload CRCs (version 3)
        self.meta = 0  # version 3: the metadata ends here, payloads start at or after it
        self.tokenizer: int | None = None  # version 6: the TOKENIZER tensor's index
        self.crc_off = 0
        self.max_image_bytes = max_image_bytes  # a build's COLIBRI_MAX_IMAGE_BYTES (SIZE_MAX: None on 64 bits)
        self.unpack_int4 = True  # Q4Weight.q unpacked (else zeros of its shape: `status` drops the graph)

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
        self.header_size = F.header_size(version)
        if header_size != self.header_size:
            _fail(Status.BAD_HEADER, f"header_size {header_size} (version {version}: {self.header_size})")
        wide_reserved = False
        if version >= F.WIDE_VERSION:  # v7: image_size is the u64 at 80, the u32 at 12 its value up to 4 GiB - 1
            if self.n < F.WIDE_HEADER_SIZE:
                _fail(Status.TRUNCATED, f"{self.n} bytes, a version {version} header alone is {F.WIDE_HEADER_SIZE}")
            low = size
            (size,) = F.WIDE_FIELDS.unpack_from(self.buf, F.WIDE_FIELDS_OFFSET)
            wide_reserved = any(self.buf[F.WIDE_FIELDS_OFFSET + 8 : F.WIDE_HEADER_SIZE])
            if low != min(size, F.NARROW_LIMIT):
                _fail(Status.BAD_HEADER, f"image_size field {low} at 12 for a {size}-byte image "
                                         f"(min(image_size, 0x{F.NARROW_LIMIT:08X}))")
        if size < self.header_size:
            _fail(Status.BAD_HEADER, f"image_size {size}")
        if self.max_image_bytes is not None and size > self.max_image_bytes:
            _fail(Status.IMAGE_TOO_LARGE, f"image_size {size} bytes, this build addresses at most "
                                          f"{self.max_image_bytes}")
        if size > self.n:
            _fail(Status.TRUNCATED, f"image_size {size} but only {self.n} bytes")
        v3 = version >= F.TENSOR_CRC_VERSION  # v4 keeps v3's metadata CRC and CRC table
        self.version = version
        if v3:
            self.meta, self.crc_off = F.V3_FIELDS.unpack_from(self.buf, F.V3_FIELDS_OFFSET)
            if self.meta % 4 or not self.header_size <= self.meta <= size:
                _fail(Status.BAD_HEADER, f"meta_size {self.meta} (4-aligned, {self.header_size}..image_size {size})")
        if crc != crc_of(self.buf):
            _fail(Status.BAD_CRC, f"stored 0x{crc:08x}, computed 0x{crc_of(self.buf):08x}")
        reserved_from = {1: 64, 2: 64, 3: 72}.get(version, 80)  # v4: 72..80 hold the attention table's place
        if any(self.buf[reserved_from : 80]) or wide_reserved or flags & ~int(F.Flag.PAGE_ALIGNED):
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
        if offset % 4 or offset < self.header_size or end > limit:
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


def status(data: bytes | bytearray | memoryview, *, work: Work | None = None, check: str = "full",
           max_image_bytes: int | None = None) -> int:
    """What colibri_validate returns for this image: 0 (OK) or the negative Status of the first
    failure, found in the same order (the differential tests and fuzzer compare the two);
    check="structure" is colibri_validate_ex(..., COLIBRI_CHECK_STRUCTURE)."""
    try:
        # the int4 values are not unpacked: what a validation (of a streamed export's multi-GB file, say)
        # needs of them is in their packed bytes, and the graph is dropped
        _read(data, work=work, check=check, max_image_bytes=max_image_bytes, unpack_int4=False)
    except ColibriError as exc:
        return int(exc.status)
    return 0


def read(data: bytes | bytearray | memoryview, *, work: Work | None = None, check: str = "full",
         max_image_bytes: int | None = None, unpack_int4: bool = True) -> Graph:
    """Parse and validate an image. Weights are numpy views into `data` (zero copy), except int4
    values, unpacked into one int8 each (`Q4Weight.packed` is the view of their bytes).

    `work`, if given, is increased by the records and payload entries visited. `check="structure"`
    leaves out the per-tensor payload CRCs of a version-3 image, as COLIBRI_CHECK_STRUCTURE.
    `max_image_bytes` is the engine build's COLIBRI_MAX_IMAGE_BYTES (a 32-bit target: 2**32 - 1): a
    larger image_size is IMAGE_TOO_LARGE; None (a 64-bit build) sets no limit below the format's.

    `unpack_int4=False` is for readers of the structure alone (`colibri info`): each Q4Weight's `q`
    is then a zero-stride array of zeros of its shape, not its values (`packed` still holds them), so
    an int4 image costs no memory per parameter; validated exactly as with the values."""
    return _read(data, work=work, check=check, max_image_bytes=max_image_bytes, unpack_int4=unpack_int4)


def _read(data: bytes | bytearray | memoryview, *, work: Work | None, check: str, max_image_bytes: int | None,
          unpack_int4: bool) -> Graph:
    """`read`; without `unpack_int4` each Q4Weight's `q` is a zero-stride array of zeros of its shape
    (for `status`, which drops the graph)."""
    if check not in ("full", "structure"):
        raise ValueError(f"check must be 'full' or 'structure', got {check!r}")
    work = Work() if work is None else work
    r = _Reader(data, work, full=check == "full", max_image_bytes=max_image_bytes)
    r.unpack_int4 = unpack_int4
    h = r.header()
    (_, _, _, _, size, flags, n_in, n_out, max_batch, n_t, t_off, n_l, l_off, n_m, m_off, n_e, e_off) = h
    size = r.size  # version 7: the u64 at 80
    t_recs = r.table(n_t, t_off, F.tensor_record(h[1]))
    l_recs = r.table(n_l, l_off, F.LAYER)
    m_recs = r.table(n_m, m_off, F.MOE)
    e_recs = r.table(n_e, e_off, F.EXPERT)
    token_model = r.token
    a_recs: list[tuple] = []
    if h[1] >= F.LM_VERSION:
        n_a, a_off = F.V4_FIELDS.unpack_from(r.buf, F.V4_FIELDS_OFFSET)
        a_recs = r.table(n_a, a_off, F.ATTENTION)
        a_reserved = [bytes(r.buf[a_off + i * F.ATTENTION.size + F.ATTENTION_RESERVED : a_off + (i + 1) * F.ATTENTION.size])
                      for i in range(n_a)]
    if r.meta:  # the CRC table: bounds as the other tables', entries read as each payload is checked
        if r.crc_off % 4 or r.crc_off < r.header_size or r.crc_off + 4 * n_t > r.meta:
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
        d, heads, kv_heads, hd, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, q_n, k_n, theta, eps, msl, kv, a_flags = a_recs[j]
        work.visits += 1

        def bad(why: str) -> None:
            _fail(Status.BAD_ATTENTION, f"{where} (attention record {j}): {why}")

        if any(a_reserved[j]):
            bad("reserved bytes set")
        if a_flags & ~int(F.AttentionFlag.INT8_BLOCKS):
            bad(f"flags {a_flags:#x} (only INT8_BLOCKS, bit 1)")
        if kv not in (DType.F32, DType.F16):
            bad(f"kv_dtype {kv} (F32 or F16)")
        if d != width:
            bad(f"d_model {d}, the layer's width is {width}")
        if heads == 0 or kv_heads == 0 or heads % kv_heads:
            bad(f"{heads} heads over {kv_heads} kv heads (kv heads must divide heads, both >= 1)")
        if hd == 0 or hd % 2:
            bad(f"head_dim {hd} (even, >= 2: RoPE rotates pairs)")
        if not (math.isfinite(theta) and theta >= F.ROPE_THETA_MIN):
            bad(f"rope_theta {theta} (finite and >= {F.ROPE_THETA_MIN:g}: RoPE's angles stay below 2^20)")
        if msl == 0 or msl > F.MAX_SEQ_LEN or (seq_len and msl != seq_len[0]):
            bad(f"max_seq_len {msl}" + (f", an earlier record has {seq_len[0]}" if seq_len else
                                        f" (1 .. {F.MAX_SEQ_LEN})"))
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
        a = Attention(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=hd,
            q_w=matrix(q_w, (q_out, d), "q_w"), q_b=vector(q_b, (q_out,), "q_b"),
            k_w=matrix(k_w, (kv_out, d), "k_w"), k_b=vector(k_b, (kv_out,), "k_b"),
            v_w=matrix(v_w, (kv_out, d), "v_w"), v_b=vector(v_b, (kv_out,), "v_b"),
            o_w=matrix(o_w, (d, q_out), "o_w"), o_b=vector(o_b, (d,), "o_b"),
            q_norm=vector(q_n, (hd, q_out), "q_norm"), k_norm=vector(k_n, (hd, kv_out), "k_norm"),
            rope_theta=theta, qk_norm_eps=eps, max_seq_len=msl, kv_dtype=DType(kv),
            int8_blocks=bool(a_flags & F.AttentionFlag.INT8_BLOCKS),
        )
        if a.int8_blocks:
            work.visits += 4
            if not all(isinstance(w, QuantWeight) for w in (a.q_w, a.k_w, a.v_w, a.o_w)):
                bad("INT8_BLOCKS needs int8 or int4 q, k, v and o projections")
        return a

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
    section = None
    if r.tokenizer is not None:  # after the program, as colibri_check_level: BAD_TOKENIZER
        off, nbytes = t_recs[r.tokenizer][:2]
        section = bytes(r.buf[off : off + nbytes])
        tokenizer_section.parse(section, n_in, work)
    return Graph(layers=layers, input_size=n_in, output_size=n_out, max_batch=max_batch, tokenizer=section)


class _Section:
    """The tokenizer section's place among the tensors: no layer may name it (BAD_REF)."""


def _describe(obj, ref: int, n_t: int) -> str:
    if ref >= n_t:
        return f"tensor {ref} of {n_t}"
    if isinstance(obj, _Section):
        return "the tokenizer section"
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
        if (off % F.PAYLOAD_ALIGN or off < r.header_size or off < prev_end or off < r.meta or off >= size
                or off + nbytes > size):
            _fail(Status.TENSOR_BOUNDS, f"tensor {i} at {off}+{nbytes}" + (
                f" overlaps the previous payload (ends at {prev_end})" if off < prev_end else "") + (
                f" inside the metadata (ends at {r.meta})" if off < r.meta else ""))
        if r.meta and r.full and zlib.crc32(buf[off : off + nbytes]) & 0xFFFFFFFF != r.crcs[i][0]:
            _fail(Status.BAD_PAYLOAD_CRC, f"tensor {i} at {off}+{nbytes}")
        if dtype not in iter(DType) or (dtype in (DType.I4, DType.Q4_PARAMS) and version < F.Q4_VERSION) or (
                dtype == DType.TOKENIZER and version < F.TOKENIZER_VERSION):
            _fail(Status.BAD_TENSOR, f"tensor {i} dtype {dtype}" + (
                f" (this dtype is not in format version {version})" if dtype in iter(DType) else ""))
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
        elif dtype == DType.TOKENIZER:
            # One section of `rows` bytes, in a token model only (docs/lm.md "Tokenizer section").
            if nbytes != rows or ndim != 1 or not r.token or r.tokenizer is not None:
                _fail(Status.BAD_TENSOR, f"tensor {i}: a tokenizer section of {nbytes} bytes, rows {rows}" + (
                    ", a second one" if r.tokenizer is not None else "" if r.token else ", in a feature model"))
            r.tokenizer = i
        elif rows * cols > F.MAX_TENSOR_ELEMENTS or nbytes != rows * cols * F.DTYPE_SIZE[DType(dtype)]:
            _fail(Status.BAD_TENSOR, f"tensor {i} nbytes {nbytes} != {rows}x{cols}" + (
                f" (at most {F.MAX_TENSOR_ELEMENTS} elements)" if rows * cols > F.MAX_TENSOR_ELEMENTS else ""))
        prev_end = off + nbytes

    objs: list = []
    for i, (off, nbytes, rows, cols, dtype, ndim, _, aux) in enumerate(t_recs):
        r.work.visits += 1
        shape = (rows, cols) if ndim == 2 else (rows,)
        if dtype in (DType.Q8_PARAMS, DType.Q4_PARAMS):
            objs.append(None)
        elif dtype == DType.TOKENIZER:
            objs.append(_Section())
        elif dtype == DType.I4:
            packed = np.frombuffer(buf, dtype=np.uint8, count=rows * F.q4_row_bytes(cols), offset=off)
            objs.append(_q4(buf, t_recs, i, packed.reshape(rows, F.q4_row_bytes(cols)), r.work, r.unpack_int4))
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


def _q4(buf: memoryview, t_recs: list[tuple], i: int, packed: np.ndarray, work: Work, unpack: bool) -> Q4Weight:
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
    q = q4_unpack(packed, cols) if unpack else np.broadcast_to(np.int8(0), (rows, cols))
    return Q4Weight(q=q, scale=scale.reshape(rows, groups), group=1 << g_log2,
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
