"""Format version 7 (64-bit sizes) in the tests: field-level mutations of an image with its CRCs made
right, and the C check driver built with a 32-bit image limit (COLIBRI_MAX_IMAGE_BYTES), the host
stand-in for a 32-bit target's engine."""
from __future__ import annotations

import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

from colibri.model import format as F
from helpers.build import CORE, ROOT

LIMIT_32 = 0xFFFFFFFF  # what size_t holds on a 32-bit target


def fix_crcs(data: bytes) -> bytes:
    """`data` with every CRC made right that its (possibly mutated) fields let one compute: each
    payload's CRC table entry where record, entry and payload lie inside the input (v3 on), then the
    header CRC over [12, meta_size) (v3 on) or [12, image_size), if that lies inside the input."""
    if len(data) < F.HEADER_SIZE:
        return data
    buf = bytearray(data)
    version = int.from_bytes(buf[4:6], "little")
    end = int.from_bytes(buf[12:16], "little")
    if F.TENSOR_CRC_VERSION <= version <= F.MAX_READ_VERSION:
        end = int.from_bytes(buf[64:68], "little")
        if F.CRC_START <= end <= len(buf):
            rec = F.tensor_record(version)
            n_t, t_off = struct.unpack_from("<II", buf, 32)
            crc_off = int.from_bytes(buf[68:72], "little")
            for i in range(min(n_t, 4096)):
                at, slot = t_off + i * rec.size, crc_off + 4 * i
                if at + rec.size > len(buf) or slot + 4 > end or slot < F.HEADER_SIZE:
                    break
                off, nbytes = rec.unpack_from(buf, at)[:2]
                if off + nbytes <= len(buf) and off >= end:
                    buf[slot : slot + 4] = (zlib.crc32(buf[off : off + nbytes]) & 0xFFFFFFFF).to_bytes(4, "little")
    if F.CRC_START <= end <= len(buf):
        buf[F.HEADER_CRC_OFFSET : F.HEADER_CRC_OFFSET + 4] = (
            zlib.crc32(buf[F.CRC_START : end]) & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(buf)


def fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width in bytes) of every integer field of the header and of every tensor record."""
    version = int.from_bytes(data[4:6], "little")
    out = [(4, 2), (6, 2), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4)] + [(o, 4) for o in range(32, 80, 4)]
    if version >= F.WIDE_VERSION:
        out += [(F.WIDE_FIELDS_OFFSET, 8), (88, 4), (92, 4)]
    n_t, t_off = struct.unpack_from("<II", data, 32)
    widths = (8, 8, 4, 4, 1, 1, 2, 4) if version >= F.WIDE_VERSION else (4, 4, 4, 4, 1, 1, 2, 4)
    for i in range(n_t):
        at = t_off + i * F.tensor_record(version).size
        for w in widths:
            out.append((at, w))
            at += w
    return out


def values(old: int, width: int, size: int) -> list[int]:
    """Values a mutated field takes: the edges of its width, of 32 bits, and of the image."""
    top = (1 << (8 * width)) - 1
    near = [0, 1, old - 1, old + 1, old + 32, old - 32, old ^ 0x80, size, size - 32, size + 4, 0x7FFFFFFF,
            0xFFFFFFFF, 1 << 32, (1 << 32) + old, old | 1 << 40, 1 << 63, top, top - 31, (1 << 64) - size]
    return sorted({v for v in near if 0 <= v <= top and v != old})


def mutated(data: bytes, rng: np.random.Generator, count: int, *, fields_at_once: int = 3) -> list[bytes]:
    """`count` images, each with 1..fields_at_once integer fields set to edge values, CRCs made right."""
    spots = fields(data)
    size = len(data)
    out = []
    for _ in range(count):
        buf = bytearray(data)
        for k in rng.choice(len(spots), int(rng.integers(1, fields_at_once + 1)), replace=False):
            off, width = spots[int(k)]
            old = int.from_bytes(buf[off : off + width], "little")
            choice = values(old, width, size)
            buf[off : off + width] = int(choice[int(rng.integers(len(choice)))]).to_bytes(width, "little")
        out.append(fix_crcs(bytes(buf)))
    return out


def every_field_at_every_edge(data: bytes) -> list[bytes]:
    """One image per (field, edge value): the whole single-field neighbourhood, CRCs made right. In
    version 7 the u64 image_size at 80 is also set with the u32 at 12 kept coherent
    (min(size, 2^32 - 1)), which reaches the checks after their agreement (TRUNCATED, IMAGE_TOO_LARGE)."""
    out = []
    for off, width in fields(data):
        old = int.from_bytes(data[off : off + width], "little")
        for v in values(old, width, len(data)):
            buf = bytearray(data)
            buf[off : off + width] = v.to_bytes(width, "little")
            out.append(fix_crcs(bytes(buf)))
            if (off, width) == (F.WIDE_FIELDS_OFFSET, 8):
                buf[12:16] = min(v, LIMIT_32).to_bytes(4, "little")
                out.append(fix_crcs(bytes(buf)))
    return out


def limited_check_driver(out_dir: Path, limit: int = LIMIT_32, *, sanitize: bool = True) -> Path:
    """tests/c/colibri_check linked against an engine built with -DCOLIBRI_MAX_IMAGE_BYTES=limit and
    the reference kernels: a 64-bit process that answers as an engine for a 32-bit target does.
    Returns its folder, for helpers.c_drivers.check."""
    folder = out_dir / f"limit-{limit:x}"
    out = folder / "colibri_check"
    if out.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sources = [str(CORE / s) for s in (CORE / "sources.txt").read_text().split()]
    flags = ["-std=c11", "-O1" if sanitize else "-O0", "-ffp-contract=off", "-fno-math-errno", "-DCOLIBRI_KERNELS_REF",
             f"-DCOLIBRI_MAX_IMAGE_BYTES=0x{limit:X}ull", f"-I{CORE / 'include'}", f"-I{CORE / 'posix'}"]
    if sanitize:
        flags += ["-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    r = subprocess.run(["gcc", *flags, str(ROOT / "tests" / "c" / "colibri_check.c"), *sources, "-lm", "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return folder
