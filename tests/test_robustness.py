"""Bad images never crash and never read out of bounds; each fault has its own status.

Every case goes through tests/c/colibri_check, which copies each image into a
buffer of exactly its length, so the AddressSanitizer build catches any read
past the end; UBSan aborts on undefined behaviour. The same cases also run
through the Python reader (the executable specification), which must give the
same status as the engine.
"""
from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from colibri import format as F
from colibri import image
from colibri import nn as cnn
from colibri.errors import ColibriError
from colibri.exporter import export
from colibri.format import Status

END = 0xFFFFFFFF


def check(drivers: Path, images: list[bytes]) -> list[dict[str, str]]:
    """Runs colibri_check over a batch of images; one dict of fields per image."""
    stream = b"".join(struct.pack("<I", len(b)) + b for b in images) + struct.pack("<I", END)
    r = subprocess.run([str(drivers / "colibri_check")], input=stream, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    lines = r.stdout.decode().splitlines()
    assert len(lines) == len(images), r.stderr.decode()[-3000:]
    return [dict(f.split("=", 1) for f in line.split()) for line in lines]


def python_status(data: bytes) -> int:
    try:
        image.read(data)
    except ColibriError as exc:
        return int(exc.status)
    return 0


@pytest.fixture(scope="module")
def small_image() -> bytes:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.LayerNorm(8),
        cnn.Residual(cnn.MoE(8, 4, 6, top_k=2, routing="softmax_topk", renormalize=True, gated=True,
                             num_shared=1, shared_gate=True, router_bias=True)),
        torch.nn.RMSNorm(8, eps=1e-6),
        torch.nn.Linear(8, 3),
    )
    return export(model, None, max_batch=3, prune=[2]).image


def status(fields: dict[str, str], key: str = "validate") -> int:
    return int(fields[key].split(":")[0])


def test_good_image_runs(c_drivers: Path, small_image: bytes) -> None:
    (f,) = check(c_drivers, [small_image])
    assert status(f) == 0 and status(f, "size") == 0 and status(f, "init") == 0
    assert status(f, "fwd1") == 0 and status(f, "fwdN") == 0
    # Exactly colibri_model_size bytes work, one byte less is refused.
    assert status(f, "short") == Status.ARENA_TOO_SMALL


def test_every_truncation(c_drivers: Path, small_image: bytes) -> None:
    cases = [small_image[:n] for n in range(len(small_image))]
    for n, f in enumerate(check(c_drivers, cases)):
        assert status(f) == Status.TRUNCATED, n
        assert f["init"] == "-" or status(f, "init") == Status.TRUNCATED


def _table_span(data: bytes) -> int:
    """Bytes from 0 to the end of the last table (header + all records)."""
    h = F.HEADER.unpack_from(data, 0)
    return h[16] + h[15] * F.EXPERT.size


def test_every_single_byte_corruption_of_header_and_tables(c_drivers: Path, small_image: bytes) -> None:
    """Without fixing the CRC: the image is refused (CRC or an earlier header check)."""
    cases, where = [], []
    for off in range(_table_span(small_image)):
        for flip in (0x01, 0x80, 0xFF):
            b = bytearray(small_image)
            b[off] ^= flip
            cases.append(bytes(b))
            where.append((off, flip))
    for (off, flip), data, f in zip(where, cases, check(c_drivers, cases)):
        got = status(f)
        assert got < 0, (off, flip)
        assert got == python_status(data), (off, flip, got)
        if off >= F.CRC_START and off not in range(12, 16):
            assert got == Status.BAD_CRC, (off, flip, got)


def test_corruptions_past_the_crc_get_specific_statuses(c_drivers: Path, small_image: bytes) -> None:
    """Corrupt a byte and fix the CRC: structural checks must catch it or the image must still run safely."""
    cases, where = [], []
    for off in range(F.CRC_START, _table_span(small_image)):
        for flip in (0x01, 0x02, 0x10, 0x80, 0xFF):
            b = bytearray(small_image)
            b[off] ^= flip
            image.set_crc(b)
            cases.append(bytes(b))
            where.append((off, flip))
    results = check(c_drivers, cases)
    seen = set()
    for (off, flip), data, f in zip(where, cases, results):
        got = status(f)
        assert got == python_status(data), (off, flip, got, python_status(data))
        if got == 0:  # still a valid image (e.g. a weight-free field such as eps): it must run
            assert status(f, "init") == 0 and status(f, "fwd1") == 0 and status(f, "fwdN") == 0
        seen.add(got)
    # The sweep reaches every structural check, not only one catch-all.
    for expected in (Status.BAD_HEADER, Status.TABLE_BOUNDS, Status.TENSOR_BOUNDS, Status.BAD_TENSOR,
                     Status.BAD_REF, Status.BAD_LAYER, Status.BAD_MOE):
        assert expected in seen, Status(expected).name


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    image.set_crc(b)
    return bytes(b)


def test_named_faults(c_drivers: Path, small_image: bytes) -> None:
    h = F.HEADER.unpack_from(small_image, 0)
    t_off, l_off, m_off, e_off = h[10], h[12], h[14], h[16]
    big = bytearray(small_image + bytes(64))
    struct.pack_into("<I", big, 12, len(small_image) + 64)
    image.set_crc(big)
    cases = {
        "wrong crc": (lambda b: b[:8] + bytes([b[8] ^ 1]) + b[9:])(small_image),
        "bad magic": b"CLBX" + small_image[4:],
        "version 2": _patched(small_image, 4, "<H", 2),
        "image_size past end": _patched(small_image, 12, "<I", len(small_image) + 4),
        "absurd tensor count": _patched(small_image, 32, "<I", 0x7FFFFFFF),
        "absurd layer count": _patched(small_image, 40, "<I", 0xFFFFFFFF),
        "tensor table past end": _patched(small_image, 36, "<I", len(small_image) - 8),
        "tensor offset past end": _patched(small_image, t_off, "<I", len(small_image) + 32),
        "tensor nbytes past end": _patched(small_image, t_off + 4, "<I", 0xFFFFFFE0),
        "tensor unaligned": _patched(small_image, t_off, "<I", F.TENSOR.unpack_from(small_image, t_off)[0] + 4),
        "tensor dtype unknown": _patched(small_image, t_off + 16, "<B", 9),
        "tensor dtype f16 (reserved)": _patched(small_image, t_off + 16, "<B", 2),
        "layer weight ref past table": _patched(small_image, l_off + 12, "<I", 1000),
        "unknown op": _patched(small_image, l_off, "<B", 42),
        "moe ref past table": _patched(small_image, l_off + 3 * F.LAYER.size + 12, "<I", 7),
        "routing mode unknown": _patched(small_image, m_off + 16, "<B", 9),
        "top_k above experts": _patched(small_image, m_off + 12, "<I", 4),
        "expert range past table": _patched(small_image, m_off + 32, "<I", 3),
        "expert kind unknown": _patched(small_image, e_off, "<B", 7),
        "max_batch zero": _patched(small_image, 28, "<I", 0),
        "trailing slot bytes are fine": small_image + b"\xff" * 100,
        "image_size covers padding": bytes(big),
    }
    expected = {
        "wrong crc": Status.BAD_CRC, "bad magic": Status.BAD_MAGIC, "version 2": Status.BAD_VERSION,
        "image_size past end": Status.TRUNCATED, "absurd tensor count": Status.TABLE_BOUNDS,
        "absurd layer count": Status.TABLE_BOUNDS, "tensor table past end": Status.TABLE_BOUNDS,
        "tensor offset past end": Status.TENSOR_BOUNDS, "tensor nbytes past end": Status.TENSOR_BOUNDS,
        "tensor unaligned": Status.TENSOR_BOUNDS, "tensor dtype unknown": Status.BAD_TENSOR,
        "tensor dtype f16 (reserved)": Status.UNSUPPORTED, "layer weight ref past table": Status.BAD_REF,
        "unknown op": Status.BAD_LAYER, "moe ref past table": Status.BAD_REF,
        "routing mode unknown": Status.BAD_MOE, "top_k above experts": Status.BAD_MOE,
        "expert range past table": Status.BAD_REF, "expert kind unknown": Status.BAD_MOE,
        "max_batch zero": Status.BAD_HEADER, "trailing slot bytes are fine": Status.OK,
        "image_size covers padding": Status.OK,
    }
    results = check(c_drivers, list(cases.values()))
    for (name, data), f in zip(cases.items(), results):
        assert status(f) == expected[name], (name, f)
        assert python_status(data) == expected[name], name


def test_random_garbage(c_drivers: Path) -> None:
    rng = np.random.default_rng(0)
    cases = [rng.bytes(int(n)) for n in rng.integers(0, 400, 200)]
    cases += [struct.pack("<I", F.MAGIC) + rng.bytes(int(n)) for n in rng.integers(0, 400, 200)]
    for f in check(c_drivers, cases):
        assert status(f) < 0
