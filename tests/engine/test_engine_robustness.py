"""Bad images never crash and never read out of bounds; each fault has its own status.

Every case goes through tests/c/colibri_check, which copies each image into a
buffer of exactly its length, so the AddressSanitizer build catches any read
past the end; UBSan aborts on undefined behaviour. The same cases also run
through the Python reader (the executable specification), which must give the
same status as the engine.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from colibri.model import format as F
from colibri import image
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.model.format import Status

from helpers.c_drivers import check, status


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.LayerNorm(8),
        cnn.Residual(cnn.MoE(8, 4, 6, top_k=2, routing="softmax_topk", renormalize=True, gated=True,
                             num_shared=1, shared_gate=True, router_bias=True)),
        torch.nn.RMSNorm(8, eps=1e-6),
        torch.nn.Linear(8, 3),
    )
    return model


QUANT = {
    "f32": {},
    "f16": {"dtype": "f16"},
    # int8 with compensation, int8 activations in the last Linear and the experts, router kept f32
    "q8": {"dtype": "q8", "compensation": 0.05, "keep": ["*.router"], "int8_act": ["layers.6", "layers.3.experts.*"]},
}


@pytest.fixture(scope="module", params=list(QUANT))
def small_image(request) -> bytes:
    return export(_small_model(), None, max_batch=3, prune=[2], **QUANT[request.param]).image


def q8_image_of(version: int) -> bytes:
    """The small model in q8 (QUANT["q8"]): format v2 as the exporter writes it (compact: f16
    scales, biases in the companions, narrow row pointers), or v1 (f32 scales, u32 row pointers)."""
    if version == F.VERSION:
        return export(_small_model(), None, max_batch=3, **QUANT["q8"]).image
    from colibri.frontends.exporter import build_graph
    from colibri.quant.quantize import quantize

    graph, _ = build_graph(_small_model().eval(), max_batch=3)
    opts = {k: v for k, v in QUANT["q8"].items() if k != "dtype"}
    return image.write(quantize(graph, "q8", compact=False, **opts), version=version)


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def q8_image(request) -> bytes:
    return q8_image_of(request.param)


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
        assert got == image.status(data), (off, flip, got)
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
        assert got == image.status(data), (off, flip, got, image.status(data))
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
        "next version": _patched(small_image, 4, "<H", F.MAX_READ_VERSION + 1),
        "version 0": _patched(small_image, 4, "<H", 0),
        "version erased": _patched(small_image, 4, "<H", 0xFFFF),
        "image_size past end": _patched(small_image, 12, "<I", len(small_image) + 4),
        "absurd tensor count": _patched(small_image, 32, "<I", 0x7FFFFFFF),
        "absurd layer count": _patched(small_image, 40, "<I", 0xFFFFFFFF),
        "tensor table past end": _patched(small_image, 36, "<I", len(small_image) - 8),
        "tensor offset past end": _patched(small_image, t_off, "<I", len(small_image) + 32),
        "tensor nbytes past end": _patched(small_image, t_off + 4, "<I", 0xFFFFFFE0),
        "tensor unaligned": _patched(small_image, t_off, "<I", F.TENSOR.unpack_from(small_image, t_off)[0] + 4),
        "tensor dtype unknown": _patched(small_image, t_off + 16, "<B", 9),
        "tensor dtype 6 unknown": _patched(small_image, t_off + 16, "<B", 6),
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
        "wrong crc": Status.BAD_CRC, "bad magic": Status.BAD_MAGIC, "next version": Status.UNSUPPORTED_VERSION,
        "version 0": Status.BAD_VERSION, "version erased": Status.BAD_VERSION,
        "image_size past end": Status.TRUNCATED, "absurd tensor count": Status.TABLE_BOUNDS,
        "absurd layer count": Status.TABLE_BOUNDS, "tensor table past end": Status.TABLE_BOUNDS,
        "tensor offset past end": Status.TENSOR_BOUNDS, "tensor nbytes past end": Status.TENSOR_BOUNDS,
        "tensor unaligned": Status.TENSOR_BOUNDS, "tensor dtype unknown": Status.BAD_TENSOR,
        "tensor dtype 6 unknown": Status.BAD_TENSOR, "layer weight ref past table": Status.BAD_REF,
        "unknown op": Status.BAD_LAYER, "moe ref past table": Status.BAD_REF,
        "routing mode unknown": Status.BAD_MOE, "top_k above experts": Status.BAD_MOE,
        "expert range past table": Status.BAD_REF, "expert kind unknown": Status.BAD_MOE,
        "max_batch zero": Status.BAD_HEADER, "trailing slot bytes are fine": Status.OK,
        "image_size covers padding": Status.OK,
    }
    results = check(c_drivers, list(cases.values()))
    for (name, data), f in zip(cases.items(), results):
        assert status(f) == expected[name], (name, f)
        assert image.status(data) == expected[name], name


def test_random_garbage(c_drivers: Path) -> None:
    rng = np.random.default_rng(0)
    cases = [rng.bytes(int(n)) for n in rng.integers(0, 400, 200)]
    cases += [struct.pack("<I", F.MAGIC) + rng.bytes(int(n)) for n in rng.integers(0, 400, 200)]
    for f in check(c_drivers, cases):
        assert status(f) < 0


def _q8_companions(data: bytes) -> list[tuple[int, int, int, int, int]]:
    """(payload offset, nbytes, rows, cols, nnz) of every Q8_PARAMS tensor."""
    h = F.HEADER.unpack_from(data, 0)
    out = []
    for i in range(h[9]):
        off, nbytes, rows, cols, dtype, *_ = F.TENSOR.unpack_from(data, h[10] + i * F.TENSOR.size)
        if dtype == F.DType.Q8_PARAMS:
            out.append((off, nbytes, rows, cols, struct.unpack_from("<I", data, off)[0]))
    return out


def _q8_fields(data: bytes, off: int, rows: int) -> dict[str, int]:
    """Absolute offsets of one companion's fields (format.q8_layout of its header), plus `ptr`,
    the row pointer width, `param`, the bytes per scale, and `bias` (0 or 1)."""
    version = struct.unpack_from("<H", data, 4)[0]
    nnz, dtype, flags = struct.unpack_from("<IBB", data, off)
    param = 2 if version >= 2 and dtype == F.DType.F16 else 4
    bias = version >= 2 and bool(flags & F.Q8Flag.BIAS)
    at = {k: off + v for k, v in F.q8_layout(version, rows, nnz, param, bias).items()}
    return at | {"ptr": F.q8_row_ptr_bytes(version, nnz), "param": param, "bias": int(bias), "version": version}


def test_quantised_payload_corruptions(c_drivers: Path, q8_image: bytes) -> None:
    """Every byte of every Q8_PARAMS companion flipped, CRC fixed: C and Python agree, nothing crashes."""
    cases = []
    for off, nbytes, *_ in _q8_companions(q8_image):
        for at in range(off, off + nbytes):
            for flip in (0x01, 0x80, 0xFF):
                b = bytearray(q8_image)
                b[at] ^= flip
                image.set_crc(b)
                cases.append(bytes(b))
    assert len(cases) > 300
    seen = set()
    for data, f in zip(cases, check(c_drivers, cases)):
        got = status(f)
        assert got == image.status(data)
        if got == 0:
            assert status(f, "fwd1") == 0 and status(f, "fwdN") == 0
        seen.add(got)
    assert {Status.BAD_QUANT, Status.BAD_COMPENSATION, Status.BAD_TENSOR} <= seen


def test_named_quantisation_faults(c_drivers: Path, q8_image: bytes) -> None:
    """Each malformed Q8_PARAMS field of a v1 or v2 image: its own status, C and Python alike."""
    h = F.HEADER.unpack_from(q8_image, 0)
    version = h[1]
    # A companion with a row holding at least two E entries, to unsort them.
    for comp in _q8_companions(q8_image):
        off, nbytes, rows, cols, nnz = comp
        at = _q8_fields(q8_image, off, rows)
        code = {1: "B", 2: "H", 4: "I"}.get(at["ptr"])
        ptr = struct.unpack_from(f"<{rows + 1}{code}", q8_image, at["row_ptr"]) if nnz else ()
        wide = [r for r in range(rows) if nnz and ptr[r + 1] - ptr[r] >= 2]
        if wide:
            start = ptr[wide[0]]
            break
    else:
        raise AssertionError("no row with two compensation entries: raise the compensation share")
    col_at, w = at["col"], at["ptr"]
    c0, c1 = struct.unpack_from("<HH", q8_image, col_at + 2 * start)
    i8 = [i for i in range(h[9]) if F.TENSOR.unpack_from(q8_image, h[10] + i * F.TENSOR.size)[4] == F.DType.I8][0]
    i8_rec = h[10] + i8 * F.TENSOR.size
    i8_rows = F.TENSOR.unpack_from(q8_image, i8_rec)[2]
    other_shape = next(c for c in _q8_tensor_indices(q8_image) if _q8_rows(q8_image, c) != i8_rows)
    if at["param"] == 4:
        nan, negative, minus_zero = (_patched(q8_image, at["scale"], "<I", struct.unpack("<I", struct.pack("<f", v))[0])
                                     for v in (float("nan"), -0.5, -0.0))
    else:
        nan, negative, minus_zero = (_patched(q8_image, at["scale"], "<H", v) for v in (0x7E00, 0xB800, 0x8000))
    cases = {
        "NaN scale": (nan, Status.BAD_QUANT),
        "negative scale": (negative, Status.BAD_QUANT),
        "-0 scale is a zero scale": (minus_zero, Status.OK),
        "infinite scale": (_patched(q8_image, at["scale"], "<H" if at["param"] == 2 else "<I",
                                    0x7C00 if at["param"] == 2 else 0x7F800000), Status.BAD_QUANT),
        "scales count != rows (companion of another shape)": (
            _patched(q8_image, i8_rec + 20, "<I", other_shape), Status.BAD_QUANT),
        "companion is not Q8_PARAMS": (_patched(q8_image, i8_rec + 20, "<I", i8), Status.BAD_QUANT),
        "E column out of range": (_patched(q8_image, col_at + 2 * start, "<H", cols), Status.BAD_COMPENSATION),
        "E columns unsorted": (_patched(_patched(q8_image, col_at + 2 * start, "<H", c1), col_at + 2 * start + 2,
                                        "<H", c0), Status.BAD_COMPENSATION),
        "E row pointer past nnz": (_patched(q8_image, at["row_ptr"] + w * rows, f"<{code}", nnz + 1),
                                   Status.BAD_COMPENSATION),
        "E first row pointer not 0": (_patched(q8_image, at["row_ptr"], f"<{code}", 1), Status.BAD_COMPENSATION),
        "E value infinite": (_patched(q8_image, at["val"] + 2 * nnz - 2, "<H", 0x7C00), Status.BAD_COMPENSATION),
        "nnz disagrees with nbytes": (_patched(q8_image, off, "<I", nnz + 1), Status.BAD_TENSOR),
    }
    if version < 2:
        cases["reserved word set"] = (_patched(q8_image, off + 4, "<I", 1), Status.BAD_QUANT)
    else:
        cases |= {
            "parameter dtype I8": (_patched(q8_image, off + 4, "<B", int(F.DType.I8)), Status.BAD_QUANT),
            "parameter dtype 0": (_patched(q8_image, off + 4, "<B", 0), Status.BAD_QUANT),
            "unknown flag": (_patched(q8_image, off + 5, "<B", at["bias"] | 2), Status.BAD_QUANT),
            "reserved bits set": (_patched(q8_image, off + 6, "<H", 0x100), Status.BAD_QUANT),
            "BIAS flag flipped: size disagrees": (_patched(q8_image, off + 5, "<B", at["bias"] ^ 1), Status.BAD_TENSOR),
            "parameter dtype flipped: size disagrees": (
                _patched(q8_image, off + 4, "<B", int(F.DType.F32 if at["param"] == 2 else F.DType.F16)),
                Status.BAD_TENSOR),
        }
    # A nonzero gap byte before the columns or the row pointers, where the layout has one.
    for comp in _q8_companions(q8_image):
        g_off, _, g_rows, _, g_nnz = comp
        g = _q8_fields(q8_image, g_off, g_rows)
        if g_nnz and g["col"] > g["row_ptr"] + g["ptr"] * (g_rows + 1):
            cases["gap before the columns set"] = (_patched(q8_image, g["col"] - 1, "<B", 1), Status.BAD_COMPENSATION)
        if g_nnz and g["val"] > g["col"] + 2 * g_nnz:
            cases["gap before the values set"] = (_patched(q8_image, g["val"] - 1, "<B", 1), Status.BAD_COMPENSATION)
    assert version < 2 or "gap before the columns set" in cases  # u8 row pointers of an even row count
    assert version >= 2 or "gap before the values set" in cases  # v1 pads the columns to 4 bytes
    results = check(c_drivers, [data for data, _ in cases.values()])
    for (name, (data, want)), f in zip(cases.items(), results):
        assert status(f) == want, (name, f)
        assert image.status(data) == want, name


def _q8_tensor_indices(data: bytes) -> list[int]:
    h = F.HEADER.unpack_from(data, 0)
    return [i for i in range(h[9]) if F.TENSOR.unpack_from(data, h[10] + i * F.TENSOR.size)[4] == F.DType.Q8_PARAMS]


def _q8_rows(data: bytes, index: int) -> int:
    h = F.HEADER.unpack_from(data, 0)
    return F.TENSOR.unpack_from(data, h[10] + index * F.TENSOR.size)[2]
