"""Byte encodings inside a model image, shared by the writer and the reader: the Q8_PARAMS and
Q4_PARAMS payloads, int4 nibble packing, and the header and per-tensor CRC-32s
(docs/model-format.md "Quantised weights", "Integrity (version 3)")."""
from __future__ import annotations

import struct
import zlib

import numpy as np

from ..model import format as F
from ..model.format import DType
from ..model.ir import Q4Weight, Q8Weight


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
    # int8 as its two's complement bytes: the low nibble is the value's, and a uint8 shift by 4 drops the
    # sign bits (a copy of the int8 quantiser's output costs a pass over it, and this runs on every q4 matrix)
    u = q.view(np.uint8) if q.dtype == np.int8 else (q.astype(np.int16) & 0xF).astype(np.uint8)
    packed = u[:, 0::2] & np.uint8(0xF)
    packed[:, : cols // 2] |= u[:, 1::2] << np.uint8(4)
    return packed.tobytes()


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


def set_tensor_crcs(buf: bytearray) -> None:
    """Recompute a version-3 image's CRC table from its payloads and then the header CRC, in place
    (after editing a payload); for versions 1 and 2 the header CRC only."""
    if int.from_bytes(bytes(buf[4:6]), "little") >= F.TENSOR_CRC_VERSION:
        n_t, t_off = struct.unpack_from("<II", buf, 32)
        _, crc_off = F.V3_FIELDS.unpack_from(buf, F.V3_FIELDS_OFFSET)
        rec = F.tensor_record(int.from_bytes(bytes(buf[4:6]), "little"))
        for i in range(n_t):
            off, nbytes = rec.unpack_from(buf, t_off + i * rec.size)[:2]
            struct.pack_into("<I", buf, crc_off + 4 * i, zlib.crc32(memoryview(buf)[off : off + nbytes]) & 0xFFFFFFFF)
    set_crc(buf)


def total_size(image: bytes | bytearray | memoryview) -> int:
    """The image's bytes: the u32 image_size at 12, in version 7 the u64 at 80."""
    if int.from_bytes(bytes(image[4:6]), "little") >= F.WIDE_VERSION:
        return F.WIDE_FIELDS.unpack_from(bytes(image[F.WIDE_FIELDS_OFFSET : F.WIDE_FIELDS_OFFSET + 8]))[0]
    return int.from_bytes(bytes(image[12:16]), "little")


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
