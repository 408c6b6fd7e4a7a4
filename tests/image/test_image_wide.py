"""Format version 7: 64-bit image size, tensor offsets and sizes (docs/model-format.md "Version 7").

Small images forced to version 7 run exactly as their version 1..5 twins (C engine and numpy
reference, bit for bit); the writers switch to version 7 exactly when the narrow image would pass
4 GiB (the boundary moved with writer.NARROW_LIMIT, not by writing 4 GiB); the C validator and the
Python reader agree status for status on mutated version-7 images, with a 64-bit engine and with
one built for a 32-bit target's limit (IMAGE_TOO_LARGE); and a real image past 4 GiB (a sparse
file whose last payloads lie past 4 GiB) opens through the POSIX layer and runs.
"""
from __future__ import annotations

import mmap
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import image
from colibri import nn as cnn
from colibri.frontends.exporter import build_graph
from colibri.image import stream, writer
from colibri.model import format as F
from colibri.model.errors import ImageError
from colibri.model.format import Status
from colibri.model.ir import Graph
from colibri.quant.quantize import quantize
from colibri.reference import executor as reference
from colibri.runtime import _engine
from helpers import lmmodels
from helpers.c_drivers import check, status
from helpers.wide_images import LIMIT_32, every_field_at_every_edge, fix_crcs, limited_check_driver, mutated


def _feature_graph() -> Graph:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.LayerNorm(8),
        cnn.Residual(cnn.MoE(8, 4, 6, top_k=2, routing="softmax_topk", renormalize=True, gated=True,
                             num_shared=1, shared_gate=True, router_bias=True)),
        torch.nn.RMSNorm(8, eps=1e-6),
        torch.nn.Linear(8, 3),
    )
    graph, _ = build_graph(model.eval(), max_batch=3)
    return graph


# name -> (graph, write options): one twin per narrow version the writer picks.
def _graphs() -> dict[str, tuple[Graph, dict]]:
    g = _feature_graph()
    q8 = quantize(g, "q8", compensation=0.05, int8_act=["layers.6", "layers.3.experts.*"])
    return {
        "f32-v1": (g, {}),
        "f16-v1": (quantize(g, "f16"), {}),
        "q8-v2": (q8, {}),
        "q8-page-aligned-v3": (q8, {"page_aligned": True}),
        "q4-v5": (quantize(g, "q4", group=8), {}),
        "lm-f32-v4": (lmmodels.token_model(1), {}),
        "lm-q8-v4": (quantize(lmmodels.token_model(2, tied=True), "q8"), {}),
        "lm-q4-v5": (quantize(lmmodels.token_model(3, qk_norm="head"), "q4", group=8), {}),
        "lm-q4-blocks-v5": (quantize(lmmodels.token_model(4), "q4", int8_blocks=["layers.*"]), {}),
    }


GRAPHS = _graphs()


@pytest.fixture(scope="module", params=list(GRAPHS))
def twins(request) -> tuple[bytes, bytes]:
    """(the narrow image the writer picks, the same graph forced to version 7)."""
    graph, opts = GRAPHS[request.param]
    narrow = image.write(graph, **opts)
    assert narrow[4] == int(request.param[-1])
    return narrow, image.write(graph, version=F.WIDE_VERSION, **opts)


def _records(data: bytes) -> list[tuple]:
    version = struct.unpack_from("<H", data, 4)[0]
    n_t, t_off = struct.unpack_from("<II", data, 32)
    rec = F.tensor_record(version)
    return [rec.unpack_from(data, t_off + i * rec.size) for i in range(n_t)]


def test_version_7_layout(twins) -> None:
    """The 96-byte header holds image_size twice (u32 at 12, u64 at 80), tensor records are 32 bytes,
    and every payload is its narrow twin's, byte for byte, in the same order."""
    narrow, wide = twins
    assert struct.unpack_from("<HH", wide, 4) == (F.WIDE_VERSION, F.WIDE_HEADER_SIZE)
    assert struct.unpack_from("<I", wide, 12)[0] == len(wide) == F.WIDE_FIELDS.unpack_from(wide, 80)[0]
    assert wide[88:96] == bytes(8)
    assert struct.unpack_from("<I", wide, 36)[0] == F.WIDE_HEADER_SIZE  # the tensor table follows the header
    assert struct.unpack_from("<I", wide, 16)[0] == struct.unpack_from("<I", narrow, 16)[0]  # flags
    a, b = _records(narrow), _records(wide)
    assert len(a) == len(b)
    for i, (ra, rb) in enumerate(zip(a, b)):
        assert ra[2:] == rb[2:], i  # rows, cols, dtype, ndim, reserved, aux
        assert narrow[ra[0] : ra[0] + ra[1]] == wide[rb[0] : rb[0] + rb[1]], i
    assert image.status(wide) == 0 and _engine.validate(wide) == 0 and _engine.validate_structure(wide) == 0


def test_version_7_runs_as_its_twin_bit_for_bit(twins, tmp_path) -> None:
    """C engine (reference and optimised kernels, from bytes and through the POSIX layer) and numpy
    reference: the version-7 image gives its twin's outputs bit for bit."""
    narrow, wide = twins
    path = tmp_path / "wide.clb"
    path.write_bytes(wide)
    token = image.is_token_model(wide[4], wide)
    rng = np.random.default_rng(0)
    if token:
        ids = rng.integers(0, F.HEADER.unpack_from(wide)[6], 6)
        runs = [lambda src, ref=ref: colibri.LM(src, reference_kernels=ref).forward_tokens(ids)
                for ref in (False, True)]
        numpy_run = lambda data: reference.LMState(image.read(data)).forward_tokens(ids)  # noqa: E731
    else:
        x = rng.standard_normal((3, F.HEADER.unpack_from(wide)[6])).astype(np.float32)
        runs = [lambda src, ref=ref: colibri.Model(src, reference_kernels=ref).forward(x) for ref in (False, True)]
        numpy_run = lambda data: reference.run(image.read(data), x)  # noqa: E731
    for run in runs:
        want = np.asarray(run(narrow))
        for src in (wide, str(path)):
            got = np.asarray(run(src))
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert np.asarray(numpy_run(wide)).tobytes() == np.asarray(numpy_run(narrow)).tobytes()


def test_writer_switches_exactly_past_the_narrow_limit(monkeypatch) -> None:
    """The writer's decision with the limit moved: an image of exactly NARROW_LIMIT bytes stays
    narrow, one byte over it is version 7, byte for byte `write(version=7)`; a narrow version asked
    for explicitly is refused rather than widened."""
    graph, _ = GRAPHS["q8-v2"]
    narrow, wide = image.write(graph), image.write(graph, version=F.WIDE_VERSION)
    f32, _ = GRAPHS["f32-v1"]
    small = image.write(f32)
    monkeypatch.setattr(writer, "NARROW_LIMIT", len(narrow))
    assert image.write(graph) == narrow
    monkeypatch.setattr(writer, "NARROW_LIMIT", len(narrow) - 1)
    assert image.write(graph) == wide
    with pytest.raises(ValueError, match="past format version 2's 32-bit sizes"):
        image.write(graph, version=2)
    # A feature model without per-tensor CRCs (v1) gains them with version 7
    monkeypatch.setattr(writer, "NARROW_LIMIT", len(small) - 1)
    assert image.write(f32) == image.write(f32, version=F.WIDE_VERSION)


@pytest.mark.parametrize("name", ["lm-q8-v4", "lm-q4-v5"])
def test_streamed_writer_switches_as_write_does(name, monkeypatch, tmp_path) -> None:
    """image.stream: the same file as `write` on either side of the boundary. Past it by the records
    alone the layout is version 7 from the start; past it only once the companions are made (their
    size is not in the records), the narrow file is dropped and the image written again."""
    graph, _ = GRAPHS[name]
    narrow, wide = image.write(graph), image.write(graph, version=F.WIDE_VERSION)
    least = stream.least_size(writer.layout(graph))
    assert least < len(narrow)  # q8 and q4 companions are larger than their lower bound
    cases = {"at the limit": (len(narrow), narrow, 1), "one byte over, seen late": (len(narrow) - 1, wide, 2),
             "under the lower bound": (least - 1, wide, 1)}
    for what, (limit, want, passes) in cases.items():
        monkeypatch.setattr(writer, "NARROW_LIMIT", limit)
        calls: list[int] = []
        out = tmp_path / f"{limit}.clb"
        report = stream.write_file(graph, out, on_tensor=lambda i, n, b, calls=calls: calls.append(i))
        assert out.read_bytes() == want, what
        assert report.version == want[4] and report.bytes_written == len(want), what
        assert calls.count(0) == passes, what  # the payloads were made twice only when the switch came late
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], what


# ---- Validation: named faults, then structured mutations, C against Python ----


def _patched(data: bytes, *edits: tuple[int, str, int], crc: bool = True) -> bytes:
    b = bytearray(data)
    for off, fmt, value in edits:
        struct.pack_into(fmt, b, off, value)
    return fix_crcs(bytes(b)) if crc else bytes(b)


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Path:
    """colibri_check from an engine built with COLIBRI_MAX_IMAGE_BYTES = 2^32 - 1 (a 32-bit target's
    SIZE_MAX), built once for the module."""
    return limited_check_driver(tmp_path_factory.mktemp("limited"), sanitize=False)


@pytest.fixture(scope="module")
def wide_q8() -> bytes:
    return image.write(GRAPHS["q8-v2"][0], version=F.WIDE_VERSION)


def _named(wide: bytes) -> dict[str, tuple[bytes, Status, Status]]:
    """name -> (image, status of a 64-bit engine, status of one limited to 32 bits)."""
    n = len(wide)
    t_off = struct.unpack_from("<I", wide, 36)[0]
    off0 = struct.unpack_from("<Q", wide, t_off)[0]
    v5 = image.write(GRAPHS["q4-v5"][0])
    big = 5 << 30
    ok = Status.OK
    return {
        "as written": (wide, ok, ok),
        "trailing slot bytes": (wide + b"\xff" * 64, ok, ok),
        "header_size 80": (_patched(wide, (6, "<H", 80)), Status.BAD_HEADER, Status.BAD_HEADER),
        "a v5 header_size 96": (_patched(v5, (6, "<H", 96)), Status.BAD_HEADER, Status.BAD_HEADER),
        "buffer ends inside the v7 header": (wide[:90], Status.TRUNCATED, Status.TRUNCATED),
        "u32 image_size disagrees": (_patched(wide, (12, "<I", n - 4)), Status.BAD_HEADER, Status.BAD_HEADER),
        "u32 image_size saturated, small image": (_patched(wide, (12, "<I", LIMIT_32)), Status.BAD_HEADER,
                                                  Status.BAD_HEADER),
        "reserved bytes 88..96": (_patched(wide, (92, "<I", 1)), Status.BAD_HEADER, Status.BAD_HEADER),
        "image_size below the header": (_patched(wide, (12, "<I", 90), (80, "<Q", 90)), Status.BAD_HEADER,
                                        Status.BAD_HEADER),
        "image_size past the buffer": (_patched(wide, (12, "<I", n + 32), (80, "<Q", n + 32)), Status.TRUNCATED,
                                       Status.TRUNCATED),
        "image_size of 5 GiB": (_patched(wide, (12, "<I", LIMIT_32), (80, "<Q", big)), Status.TRUNCATED,
                                Status.IMAGE_TOO_LARGE),
        "image_size of 4 GiB exactly": (_patched(wide, (12, "<I", LIMIT_32), (80, "<Q", 1 << 32)),
                                        Status.TRUNCATED, Status.IMAGE_TOO_LARGE),
        "image_size of 4 GiB - 1": (_patched(wide, (12, "<I", LIMIT_32), (80, "<Q", LIMIT_32)),
                                    Status.TRUNCATED, Status.TRUNCATED),
        "image_size 2^64 - 1": (_patched(wide, (12, "<I", LIMIT_32), (80, "<Q", (1 << 64) - 1)), Status.TRUNCATED,
                                Status.IMAGE_TOO_LARGE),
        "meta_size past the image": (_patched(wide, (64, "<I", n + 4)), Status.BAD_HEADER, Status.BAD_HEADER),
        "tensor table inside the v7 header": (_patched(wide, (36, "<I", 80)), Status.TABLE_BOUNDS,
                                              Status.TABLE_BOUNDS),
        "tensor offset past 4 GiB": (_patched(wide, (t_off, "<Q", off0 | 1 << 40)), Status.TENSOR_BOUNDS,
                                     Status.TENSOR_BOUNDS),
        "tensor nbytes past 4 GiB": (_patched(wide, (t_off + 8, "<Q", 1 << 32)), Status.TENSOR_BOUNDS,
                                     Status.TENSOR_BOUNDS),
        "offset + nbytes wraps to 0": (_patched(wide, (t_off + 8, "<Q", (1 << 64) - off0)), Status.TENSOR_BOUNDS,
                                       Status.TENSOR_BOUNDS),
        "nbytes 2^64 - 1": (_patched(wide, (t_off + 8, "<Q", (1 << 64) - 1)), Status.TENSOR_BOUNDS,
                            Status.TENSOR_BOUNDS),
        "narrow record read as wide": (_patched(image.write(GRAPHS["q8-v2"][0], tensor_crc=True), (4, "<H", 7)),
                                       Status.BAD_HEADER, Status.BAD_HEADER),
    }


def test_named_wide_faults(c_drivers: Path, wide_q8: bytes, limited: Path) -> None:
    """Each fault of a version-7 header or record: its status from C and Python alike, in a 64-bit
    engine and in one built for a 32-bit target (COLIBRI_MAX_IMAGE_BYTES = 2^32 - 1)."""
    cases = _named(wide_q8)
    datas = [d for d, _, _ in cases.values()]
    for (name, (data, want64, want32)), f64, f32 in zip(cases.items(), check(c_drivers, datas), check(limited, datas)):
        assert status(f64) == want64 == image.status(data), name
        assert _engine.validate(data) == want64 == _engine.validate_structure(data), name
        assert status(f32) == want32 == image.status(data, max_image_bytes=LIMIT_32), name
    with pytest.raises(ImageError, match="this build addresses at most 4294967295"):
        image.read(cases["image_size of 5 GiB"][0], max_image_bytes=LIMIT_32)


def _wide_images() -> dict[str, bytes]:
    return {name: image.write(graph, version=F.WIDE_VERSION, **opts) for name, (graph, opts) in GRAPHS.items()
            if name in ("q8-page-aligned-v3", "q4-v5", "lm-q8-v4", "lm-q4-blocks-v5")}


@pytest.mark.slow
def test_every_field_at_every_edge_c_and_python_agree(c_drivers: Path, limited: Path) -> None:
    """Every integer field of the header and of each tensor record, one at a time, at every edge
    value (0, 1, ±1, ±32, 2^31 - 1, 2^32 - 1, 2^32, high words, 2^63, 2^64 - 1, the image's size):
    the 64-bit engine (normal and ASan + UBSan), the 32-bit-limited one and the Python reader at
    its two limits give the same status, full and structure level. An image that still validates
    runs (colibri_check's forwards)."""
    seen64: set[int] = set()
    seen32: set[int] = set()
    total = 0
    for name, wide in _wide_images().items():
        cases = every_field_at_every_edge(wide)
        total += len(cases)
        for data, f64, f32 in zip(cases, check(c_drivers, cases), check(limited, cases)):
            got = status(f64)
            assert got == image.status(data), name
            assert _engine.validate_structure(data) == image.status(data, check="structure"), name
            assert status(f32) == image.status(data, max_image_bytes=LIMIT_32), name
            if got == 0:
                assert status(f64, "init") == 0 and status(f64, "fwd1") == 0, name
            seen64.add(got)
            seen32.add(status(f32))
    assert total > 2000
    for want in (Status.BAD_HEADER, Status.TABLE_BOUNDS, Status.TENSOR_BOUNDS, Status.BAD_TENSOR, Status.BAD_REF,
                 Status.TRUNCATED, Status.BAD_QUANT, Status.UNSUPPORTED_VERSION, Status.OK):
        assert want in seen64, Status(want).name
    assert Status.IMAGE_TOO_LARGE in seen32 and Status.IMAGE_TOO_LARGE not in seen64


def test_random_field_mutations_c_and_python_agree(c_drivers: Path, limited: Path) -> None:
    """1 to 3 fields at once, 400 images per seed model, CRCs made right: same status everywhere."""
    rng = np.random.default_rng(26)
    for name, wide in _wide_images().items():
        cases = mutated(wide, rng, 400)
        for data, f64, f32 in zip(cases, check(c_drivers, cases), check(limited, cases)):
            assert status(f64) == image.status(data), name
            assert _engine.validate_structure(data) == image.status(data, check="structure"), name
            assert status(f32) == image.status(data, max_image_bytes=LIMIT_32), name


def test_narrow_images_are_unaffected_by_the_32_bit_limit(c_drivers: Path, limited: Path) -> None:
    """Versions 1..5 hold at most 4 GiB - 1, so the 32-bit build answers as the 64-bit one on them."""
    cases = [image.write(g, **opts) for g, opts in GRAPHS.values()]
    cases += mutated(cases[2], np.random.default_rng(7), 300)
    for data, f64, f32 in zip(cases, check(c_drivers, cases), check(limited, cases)):
        assert status(f64) == status(f32) == image.status(data) == image.status(data, max_image_bytes=LIMIT_32)


# ---- A real image past 4 GiB ----


def _sparse_image(graph: Graph, path: Path, gap_before: int, **opts) -> int:
    """Write `graph` as a version-7 file in which tensor `gap_before` and those after it lie past
    4 GiB: the gap before it is a hole in a sparse file (padding between payloads is never read).
    Returns the image's size."""
    plan = writer.layout(graph, version=F.WIDE_VERSION, **opts)
    payloads = [t.payload() if callable(t.payload) else t.payload for t in plan.tensors.entries]
    placed, pos = [], plan.payload_start
    for i, (t, data) in enumerate(zip(plan.tensors.entries, payloads)):
        pos = plan.place(pos + ((1 << 32) + F.PAGE_SIZE if i == gap_before else 0), t)
        placed.append((pos, len(data)))
        pos += len(data)
    size = (pos + 3) // 4 * 4
    meta = plan.metadata(placed, [zlib.crc32(d) & 0xFFFFFFFF for d in payloads], size)
    with open(path, "wb") as f:
        f.write(meta)
        for (off, _), data in zip(placed, payloads):
            f.seek(off)
            f.write(data)
        f.truncate(size)
    return size


def _last_expert_w1(graph: Graph) -> int:
    """Index of the last routed expert's first tensor in the writer's order."""
    plan = writer.layout(graph)
    starts = [i for i, t in enumerate(plan.tensors.entries) if t.page]
    if starts:
        return starts[-1]
    return len(plan.tensors.entries) - 4  # not page aligned: the last expert's w1 of a GLU without biases


@pytest.mark.parametrize("name", ["q8-page-aligned-v3", "lm-q8-v4"])
def test_an_image_past_4_gib_opens_through_the_posix_layer_and_runs(name: str, tmp_path) -> None:
    """A sparse file of 4 GiB and more: its last payloads (an expert, or the LM head) lie past 4 GiB.
    Opened by path (mapped; structure at open, each expert's CRC on first use, or every payload's CRC
    for a token model: payloads only, the 4 GiB hole is never read), it runs bit for bit as the
    narrow twin; the Python reader over the mapping agrees (structure level: it does not read the
    hole either)."""
    graph, opts = GRAPHS[name]
    path = tmp_path / "past-4-gib.clb"
    token = name.startswith("lm")
    n_tensors = len(writer.layout(graph).tensors.entries)
    size = _sparse_image(graph, path, n_tensors - 2 if token else _last_expert_w1(graph), **opts)
    assert size > 1 << 32 and path.stat().st_size == size
    assert path.stat().st_blocks * 512 < 1 << 24  # sparse: the hole takes no disk
    narrow = image.write(graph, **opts)
    rng = np.random.default_rng(1)
    if token:
        ids = rng.integers(0, graph.input_size, 5)
        lm = colibri.LM(str(path))
        assert lm.info["image_size"] == size
        got, want = lm.forward_tokens(ids), colibri.LM(narrow).forward_tokens(ids)
    else:
        x = rng.standard_normal((3, graph.input_size)).astype(np.float32)
        model = colibri.Model(str(path))
        assert model.image_size == model.info["image_size"] == size
        got, want = model.forward(x), colibri.Model(narrow).forward(x)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            assert image.status(view, check="structure") == 0
            assert image.status(view, check="structure", max_image_bytes=LIMIT_32) == Status.IMAGE_TOO_LARGE
            assert _engine.validate_structure(view) == 0
        finally:
            view.release()
    os.unlink(path)
