"""Token-model images (format version 4) edited in place: an attention record's offset, a patched field
with the metadata CRC made good again, and the broken attention records each reader must refuse."""
from __future__ import annotations

import math
import struct

from colibri.model import format as F
from colibri import image
from colibri.model.format import DType


def attention_offset(data: bytes, j: int = 0) -> int:
    return F.V4_FIELDS.unpack_from(data, F.V4_FIELDS_OFFSET)[1] + j * F.ATTENTION.size


def patched(data: bytes, offset: int, fmt: str, *values) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, *values)
    image.set_crc(buf)  # metadata only: the payload CRCs still hold
    return bytes(buf)


# (what, offset within the attention record, struct format, value)
BAD_RECORDS = [
    ("d_model", 0, "<I", 15),
    ("no heads", 4, "<H", 0),
    ("no kv heads", 6, "<H", 0),
    ("kv heads do not divide heads", 6, "<H", 3),
    ("odd head_dim", 8, "<I", 5),
    ("zero head_dim", 8, "<I", 0),
    ("q_w missing", 12, "<I", F.NONE),
    ("q_w out of range", 12, "<I", 10**6),
    ("q_w names a bias", 12, "<I", 1),
    ("k_w names q_w (wrong shape)", 20, "<I", 0),
    ("o_b names a matrix", 40, "<I", 0),
    ("q_norm of the wrong size", 44, "<I", 1),
    ("rope_theta zero", 52, "<f", 0.0),
    ("rope_theta negative", 52, "<f", -1.0),
    ("rope_theta inf", 52, "<f", math.inf),
    ("rope_theta NaN", 52, "<f", math.nan),
    ("rope_theta below 1", 52, "<f", 0.99999994),
    ("rope_theta 1e-20", 52, "<f", 1e-20),
    ("rope_theta 1e-30", 52, "<f", 1e-30),
    ("rope_theta subnormal", 52, "<f", 1e-45),
    ("qk_norm_eps zero with norms", 56, "<f", 0.0),
    ("qk_norm_eps NaN", 56, "<f", math.nan),
    ("max_seq_len zero", 60, "<I", 0),
    ("max_seq_len past 2^20", 60, "<I", F.MAX_SEQ_LEN + 1),
    ("max_seq_len 2^32-1", 60, "<I", 0xFFFFFFFF),
    ("kv_dtype I8", 64, "<B", int(DType.I8)),
    ("kv_dtype zero", 64, "<B", 0),
    ("reserved byte", 79, "<B", 1),
]
