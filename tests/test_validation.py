"""The C validator and the Python reader agree, and both validate in linear time.

Images here are built record by record (the writer only makes well-formed
ones). Each goes through the engine (tests/c/colibri_check, plain and under
ASan+UBSan; tests/c/colibri_work for the validator's work count) and through
`colibri.image.read`; the status must be the same and the one
docs/model-format.md ("Validation order") gives.
"""
from __future__ import annotations

import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from colibri.model import format as F
from colibri import image
from colibri.model.format import DType, Op, Routing, Status

from test_robustness import check, status

NONE = F.NONE
END = 0xFFFFFFFF


@dataclass
class T:
    """A tensor record to place: payload and fields; `at` reuses another tensor's offset."""

    payload: bytes
    dtype: DType
    rows: int
    cols: int
    ndim: int = 2
    aux: int = NONE
    at: int | None = None


def f32(*shape: int) -> T:
    a = np.linspace(-1, 1, int(np.prod(shape)), dtype="<f4")
    return T(a.tobytes(), DType.F32, shape[0], shape[1] if len(shape) == 2 else 1, len(shape))


def build(*, n_in: int, n_out: int, layers: list[bytes], tensors: list[T] = (), moes: list[bytes] = (),
          experts: list[bytes] = (), max_batch: int = 2, version: int = F.VERSION) -> bytes:
    """An image from records, tables back to back, payloads 32-aligned in table order."""
    t_off = F.HEADER_SIZE
    l_off = t_off + len(tensors) * F.TENSOR.size
    m_off = l_off + len(layers) * F.LAYER.size
    e_off = m_off + len(moes) * F.MOE.size
    pos = e_off + len(experts) * F.EXPERT.size
    offsets = []
    for t in tensors:
        pos = (pos + F.PAYLOAD_ALIGN - 1) // F.PAYLOAD_ALIGN * F.PAYLOAD_ALIGN
        offsets.append(offsets[t.at] if t.at is not None else pos)
        pos = max(pos, offsets[-1] + len(t.payload))
    size = (pos + 3) // 4 * 4
    buf = bytearray(size)
    F.HEADER.pack_into(buf, 0, F.MAGIC, version, F.HEADER_SIZE, 0, size, 0, n_in, n_out, max_batch,
                       len(tensors), t_off, len(layers), l_off, len(moes), m_off, len(experts), e_off)
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        F.TENSOR.pack_into(buf, t_off + i * F.TENSOR.size, off, len(t.payload), t.rows, t.cols, int(t.dtype),
                           t.ndim, 0, t.aux)
        buf[off:off + len(t.payload)] = t.payload
    for off, recs in ((l_off, layers), (m_off, moes), (e_off, experts)):
        buf[off:off + len(b"".join(recs))] = b"".join(recs)
    image.set_crc(buf)
    return bytes(buf)


def layer(op: Op, n_in: int, n_out: int, t0: int = NONE, t1: int = NONE, *, kind: int = 0, flags: int = 0,
          eps: float = 0.0) -> bytes:
    return F.LAYER.pack(int(op), kind, flags, n_in, n_out, t0, t1, eps, 0, 0)


def agree(c_drivers: Path, data: bytes) -> int:
    """The engine's status, after checking the Python reader gives the same one."""
    (f,) = check(c_drivers, [data])
    got = status(f)
    assert image.status(data) == got, f"C {Status(got).name}, Python {Status(image.status(data)).name}"
    return got


# ---- The two known disagreements --------------------------------------------------------------

@pytest.mark.parametrize("op", [Op.MOE, Op.LAYERNORM, Op.RMSNORM])
def test_int8_act_on_a_non_linear_layer_is_bad_layer(c_drivers: Path, op: Op) -> None:
    """INT8_ACT belongs to a LINEAR: refused with the layer's fields, before its references
    (the smallest case is 112 bytes: one MOE layer, flags INT8_ACT, no MoE records)."""
    eps = 1e-5 if op in (Op.LAYERNORM, Op.RMSNORM) else 0.0
    data = build(n_in=1, n_out=1, layers=[layer(op, 1, 1, t0=0, flags=int(F.LayerFlag.INT8_ACT), eps=eps)])
    assert len(data) == 112
    assert agree(c_drivers, data) == Status.BAD_LAYER


def q8_header(version: int, nnz: int = 0, dtype: DType = DType.F32, flags: int = 0) -> bytes:
    """A Q8_PARAMS header: v1 nnz and a reserved word, v2 nnz, parameter dtype, flags, reserved."""
    return struct.pack("<II", nnz, 0) if version < 2 else struct.pack("<IBBH", nnz, int(dtype), flags, 0)


def _q8_linear(ndim: int, version: int = F.VERSION) -> bytes:
    """A LINEAR 1 -> 2 whose int8 weight record has rank `ndim`."""
    q = T(bytes([3, 250]), DType.I8, 2, 1, ndim, aux=1)
    params = T(q8_header(version) + struct.pack("<2f", 0.5, 0.25), DType.Q8_PARAMS, 2, 1, 2)
    return build(n_in=1, n_out=2, tensors=[q, params], layers=[layer(Op.LINEAR, 1, 2, t0=0)], version=version)


@pytest.mark.parametrize("version", [1, 2])
def test_int8_weight_of_rank_one_is_bad_ref(c_drivers: Path, version: int) -> None:
    """A LINEAR's weight is a matrix: an I8 vector [2] is not a [2, 1] weight (the reader used to
    view every int8 payload as [rows, cols] and accept it)."""
    assert agree(c_drivers, _q8_linear(ndim=2, version=version)) == Status.OK
    assert agree(c_drivers, _q8_linear(ndim=1, version=version)) == Status.BAD_REF


# ---- One owner per record: linear-time validation ---------------------------------------------

def moe_program(n_layers: int, n_experts: int, *, moe_of: list[int] | None = None,
                first_of: list[int] | None = None, map_of: list[int] | None = None) -> bytes:
    """n_layers MOE layers of width 1 over MoE records of n_experts tiny experts each (by default
    one record, expert range and expert map per layer; the lists say which each layer names)."""
    moe_of = list(range(n_layers)) if moe_of is None else moe_of
    n_records = max(moe_of) + 1
    first_of = [j * n_experts for j in range(n_records)] if first_of is None else first_of
    map_of = list(range(n_records)) if map_of is None else map_of
    ident = np.arange(n_experts, dtype="<i4").tobytes()
    tensors = [f32(1, 1), f32(1, 1), f32(n_experts, 1)]
    tensors += [T(ident, DType.I32, n_experts, 1, 1) for _ in range(max(map_of) + 1)]
    moes = [F.MOE.pack(1, n_experts, n_experts, 1, int(Routing.TOP1), 0, 0, 2, NONE, 3 + map_of[j], first_of[j],
                       NONE, 0, 0) for j in range(n_records)]
    expert = F.EXPERT.pack(1, int(F.Act.RELU), 0, 1, 0, NONE, 1, NONE, NONE, NONE)
    experts = [expert] * (max(first_of) + n_experts)
    layers = [layer(Op.MOE, 1, 1, t0=moe_of[i]) for i in range(n_layers)]
    return build(n_in=1, n_out=1, tensors=tensors, layers=layers, moes=moes, experts=experts)


def c_work(c_drivers: Path, images: list[bytes]) -> list[tuple[int, int]]:
    """(status, work) of each image from colibri_check_work, the engine's counted validation."""
    stream = b"".join(struct.pack("<I", len(b)) + b for b in images) + struct.pack("<I", END)
    r = subprocess.run([str(c_drivers / "colibri_work")], input=stream, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    out = [dict(f.split("=") for f in line.split()) for line in r.stdout.decode().splitlines()]
    assert len(out) == len(images)
    return [(int(f["validate"]), int(f["work"])) for f in out]


def py_work(data: bytes) -> tuple[int, int]:
    work = image.Work()
    return image.status(data, work=work), work.visits


# Every record or payload entry of an image is at least 2 bytes, and each is visited a bounded
# number of times: a linear validator stays within a small multiple of the image size.
WORK_PER_BYTE = 0.5


def test_many_moe_layers_sharing_one_record_are_refused_in_linear_work(c_drivers: Path) -> None:
    """The issue's case: MOE layers all naming one MoE record used to be checked layers x experts
    times (5.3 s in C, ~27 min in Python for a 516 KB image). A record has one owning layer."""
    data = moe_program(300, 300, moe_of=[0] * 300)
    ((c_st, c_visits),) = c_work(c_drivers, [data])
    py_st, py_visits = py_work(data)
    assert c_st == py_st == Status.BAD_REF
    assert c_visits <= WORK_PER_BYTE * len(data), (c_visits, len(data))
    assert py_visits <= WORK_PER_BYTE * len(data), (py_visits, len(data))


def test_a_valid_model_with_many_moe_layers_validates_in_linear_work(c_drivers: Path) -> None:
    small, large = moe_program(20, 30), moe_program(200, 30)
    results = c_work(c_drivers, [small, large])
    for data, (c_st, c_visits) in zip((small, large), results):
        py_st, py_visits = py_work(data)
        assert c_st == py_st == Status.OK
        assert c_visits <= WORK_PER_BYTE * len(data), (c_visits, len(data))
        assert py_visits <= WORK_PER_BYTE * len(data), (py_visits, len(data))


@pytest.mark.parametrize("case", ["moe records out of order", "expert ranges overlap", "expert map shared"])
def test_each_moe_record_expert_and_map_has_one_owner(c_drivers: Path, case: str) -> None:
    base = moe_program(2, 3)
    assert agree(c_drivers, base) == Status.OK
    data = {
        "moe records out of order": moe_program(2, 3, moe_of=[1, 0]),
        "expert ranges overlap": moe_program(2, 3, first_of=[0, 2]),
        "expert map shared": moe_program(2, 3, map_of=[0, 0]),
    }[case]
    assert agree(c_drivers, data) == Status.BAD_REF


def test_overlapping_payloads_are_tensor_bounds(c_drivers: Path) -> None:
    """Payloads lie in table order without overlap, so each is scanned once (a thousand I8 records
    sharing one large payload and companion would otherwise cost records x rows)."""
    w, b = f32(2, 1), f32(2)
    ok = build(n_in=1, n_out=2, tensors=[w, b], layers=[layer(Op.LINEAR, 1, 2, t0=0, t1=1)])
    assert agree(c_drivers, ok) == Status.OK
    b.at = 0  # the bias payload at the weight's offset
    assert agree(c_drivers, build(n_in=1, n_out=2, tensors=[w, b], layers=[layer(Op.LINEAR, 1, 2, t0=0, t1=1)])) \
        == Status.TENSOR_BOUNDS


# ---- Q8_PARAMS, format v2 and v1: every row pointer width, every field's status -----------------

def _q8_weight(rows: int, cols: int, nnz: int, *, f16: bool, bias: bool, seed: int = 0):
    """A Q8Weight with nnz compensation entries spread over the rows (some rows empty)."""
    from colibri.model.ir import Q8Weight

    rng = np.random.default_rng(seed)
    flat = np.sort(rng.choice(rows * cols, size=nnz, replace=False))
    r, c = np.divmod(flat, cols)
    row_ptr = np.zeros(rows + 1, dtype=np.uint32)
    row_ptr[1:] = np.cumsum(np.bincount(r, minlength=rows))
    p = np.float16 if f16 else np.float32
    return Q8Weight(q=rng.integers(-127, 128, (rows, cols), dtype=np.int8),
                    scale=rng.uniform(0.01, 0.02, rows).astype(p), row_ptr=row_ptr, col=c.astype(np.uint16),
                    val=(rng.standard_normal(nnz) * 0.01).astype(np.float16),
                    bias=rng.standard_normal(rows).astype(p) if bias else None)


def _q8_image(version: int, rows: int, cols: int, nnz: int, *, f16: bool = False, bias: bool = False) -> bytes:
    from colibri.model.ir import Graph, Linear

    graph = Graph([Linear(_q8_weight(rows, cols, nnz, f16=f16, bias=bias))], input_size=cols, output_size=rows)
    return image.write(graph, version=version)


def _companion(data: bytes) -> tuple[int, int, int, dict[str, int]]:
    """(payload offset, rows, nnz, field offsets) of the image's one Q8_PARAMS tensor (index 1)."""
    h = F.HEADER.unpack_from(data, 0)
    off, _, rows, _, dtype, *_ = F.TENSOR.unpack_from(data, h[10] + F.TENSOR.size)
    assert dtype == DType.Q8_PARAMS
    nnz, p_dtype, flags = struct.unpack_from("<IBB", data, off)
    v2 = h[1] >= 2
    at = F.q8_layout(h[1], rows, nnz, 2 if v2 and p_dtype == DType.F16 else 4, v2 and bool(flags & 1))
    return off, rows, nnz, {k: off + v for k, v in at.items()}


def _set(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    image.set_crc(b)
    return bytes(b)


# (rows, cols, nnz): row pointers of 0 (no E), 1, 2 and 4 bytes in v2, and a u8 row_ptr of odd
# length (a gap before col) and of even length.
Q8_SHAPES = {"no E": (5, 7, 0), "u8": (6, 9, 11), "u8 even": (5, 9, 11), "u16": (40, 30, 700),
             "u32": (2, 40000, 70000)}


@pytest.mark.parametrize("f16,bias", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("shape", Q8_SHAPES)
def test_v2_companions_of_every_width_validate_and_run(c_drivers: Path, shape: str, f16: bool, bias: bool) -> None:
    """Each layout validates in C and Python and runs; an f32 bias may be any value (NaN too), as
    an F32 bias tensor."""
    rows, cols, nnz = Q8_SHAPES[shape]
    data = _q8_image(2, rows, cols, nnz, f16=f16, bias=bias)
    if bias and not f16:
        data = _set(data, _companion(data)[3]["bias"], "<f", float("nan"))
    off, _, _, at = _companion(data)
    want_ptr = {"no E": 0, "u8": 1, "u8 even": 1, "u16": 2, "u32": 4}[shape]
    assert F.q8_row_ptr_bytes(2, nnz) == want_ptr
    assert F.TENSOR.unpack_from(data, F.HEADER_SIZE + F.TENSOR.size)[1] == at["size"] - off
    (f,) = check(c_drivers, [data])
    assert status(f) == image.status(data) == Status.OK
    assert status(f, "fwd1") == 0 and status(f, "fwdN") == 0
    back = image.read(data).layers[0].weight
    assert back.scale.dtype == (np.float16 if f16 else np.float32) and (back.bias is not None) == bias
    # The engine's plan reads every field where the reader does: the same outputs (the reference
    # kernels bit for bit as the numpy reference computes them, up to its summation order).
    import colibri
    from colibri import reference

    x = np.random.default_rng(1).standard_normal((2, cols)).astype(np.float32)
    want = reference.run(image.read(data), x)
    for kernels in (True, False):
        got = colibri.Model(data, reference_kernels=kernels).forward(x)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        assert np.abs(got[ok] - want[ok]).max(initial=0) <= 1e-5 * (1 + np.abs(want[ok]).max(initial=0))
    assert back.nnz == nnz and (nnz == 0 or back.row_ptr.dtype == np.dtype(f"<u{want_ptr}"))


@pytest.mark.parametrize("shape", ["u8", "u16", "u32"])
@pytest.mark.parametrize("version", [1, 2])
def test_each_malformed_companion_field_has_its_status(c_drivers: Path, version: int, shape: str) -> None:
    """Built record by record: a v1 or v2 companion (f16 scale and bias in v2), one field broken
    at a time; C and Python give the status docs/model-format.md names."""
    rows, cols, nnz = Q8_SHAPES[shape]
    data = _q8_image(version, rows, cols, nnz, f16=version == 2, bias=version == 2)
    off, rows, nnz, at = _companion(data)
    w = F.q8_row_ptr_bytes(version, nnz)
    ptr_fmt = {1: "<B", 2: "<H", 4: "<I"}[w]
    ptr = [struct.unpack_from(ptr_fmt, data, at["row_ptr"] + w * i)[0] for i in range(rows + 1)]
    r = next(i for i in range(rows) if ptr[i + 1] - ptr[i] >= 2)
    c0, c1 = struct.unpack_from("<HH", data, at["col"] + 2 * ptr[r])
    param = "<e" if version == 2 else "<f"
    cases = {
        "NaN scale": (_set(data, at["scale"], param, float("nan")), Status.BAD_QUANT),
        "negative scale": (_set(data, at["scale"] + (2 if version == 2 else 4), param, -1.0), Status.BAD_QUANT),
        "infinite last scale": (_set(data, at["scale"] + (2 if version == 2 else 4) * (rows - 1), param,
                                     float("inf")), Status.BAD_QUANT),
        "nnz one more": (_set(data, off, "<I", nnz + 1), Status.BAD_TENSOR),
        "row_ptr[0] not 0": (_set(data, at["row_ptr"], ptr_fmt, 1), Status.BAD_COMPENSATION),
        "row_ptr decreasing": (_set(data, at["row_ptr"] + w * (r + 1), ptr_fmt, ptr[r] - 1 if ptr[r] else 0)
                               if ptr[r] else _set(data, at["row_ptr"] + w * r, ptr_fmt, ptr[r + 1] + 1),
                               Status.BAD_COMPENSATION),
        "row_ptr[rows] not nnz": (_set(data, at["row_ptr"] + w * rows, ptr_fmt, nnz - 1), Status.BAD_COMPENSATION),
        "column out of range": (_set(data, at["col"] + 2 * ptr[r], "<H", cols), Status.BAD_COMPENSATION),
        "columns repeated": (_set(data, at["col"] + 2 * ptr[r] + 2, "<H", c0), Status.BAD_COMPENSATION),
        "columns unsorted": (_set(_set(data, at["col"] + 2 * ptr[r], "<H", c1), at["col"] + 2 * ptr[r] + 2, "<H", c0),
                             Status.BAD_COMPENSATION),
        "value NaN": (_set(data, at["val"], "<H", 0x7E00), Status.BAD_COMPENSATION),
        "value -inf": (_set(data, at["val"] + 2 * (nnz - 1), "<H", 0xFC00), Status.BAD_COMPENSATION),
    }
    if version == 2:
        cases |= {
            "parameter dtype I32": (_set(data, off + 4, "<B", int(DType.I32)), Status.BAD_QUANT),
            "flag bit 7": (_set(data, off + 5, "<B", 0x81), Status.BAD_QUANT),
            "reserved low byte": (_set(data, off + 6, "<B", 1), Status.BAD_QUANT),
            "BIAS cleared": (_set(data, off + 5, "<B", 0), Status.BAD_TENSOR),
            "parameter dtype F32": (_set(data, off + 4, "<B", int(DType.F32)), Status.BAD_TENSOR),
            "NaN f16 bias": (_set(data, at["bias"], "<H", 0x7E00), Status.BAD_QUANT),
            "infinite f16 bias": (_set(data, at["bias"] + 2, "<H", 0xFC00), Status.BAD_QUANT),
            "subnormal f16 bias": (_set(data, at["bias"] + 2 * (rows - 1), "<H", 0x8001), Status.BAD_QUANT),
            "-0 f16 bias": (_set(data, at["bias"], "<H", 0x8000), Status.OK),
            "subnormal f16 scale": (_set(data, at["scale"], "<H", 0x03FF), Status.BAD_QUANT),
            "-0 f16 scale": (_set(data, at["scale"], "<H", 0x8000), Status.OK),
        }
        if at["col"] > at["row_ptr"] + w * (rows + 1):
            cases["gap before col"] = (_set(data, at["col"] - 1, "<B", 0x80), Status.BAD_COMPENSATION)
        if at["row_ptr"] > at["bias"] + 2 * rows:
            cases["gap before row_ptr"] = (_set(data, at["row_ptr"] - 1, "<B", 1), Status.BAD_COMPENSATION)
    else:
        cases |= {
            "reserved word": (_set(data, off + 4, "<I", 1 << 24), Status.BAD_QUANT),
            "v1 pad after col": (_set(data, at["val"] - 1, "<B", 1), Status.BAD_COMPENSATION)
            if at["val"] > at["col"] + 2 * nnz else (data, Status.OK),
        }
    results = check(c_drivers, [d for d, _ in cases.values()])
    for (name, (d, want)), f in zip(cases.items(), results):
        assert status(f) == want, (name, f)
        assert image.status(d) == want, name


def test_u32_row_pointers_in_v2_need_a_gap_when_f16_rows_are_odd(c_drivers: Path) -> None:
    """f16 scales of an odd row count end 2 bytes off a 4-byte boundary: v2 puts 2 zero bytes before
    4-byte row pointers, and a nonzero one there is BAD_COMPENSATION."""
    data = _q8_image(2, 3, 40000, 70000, f16=True)
    off, rows, _, at = _companion(data)
    assert at["row_ptr"] - (off + 8 + 2 * rows) == 2
    bad = _set(data, at["row_ptr"] - 2, "<B", 1)
    results = check(c_drivers, [data, bad])
    assert [status(f) for f in results] == [Status.OK, Status.BAD_COMPENSATION]
    assert (image.status(data), image.status(bad)) == (Status.OK, Status.BAD_COMPENSATION)


def test_validation_work_stays_linear_with_compact_companions(c_drivers: Path) -> None:
    """The work count of a v2 image (C and Python) stays within its image size, as for v1."""
    data = _q8_image(2, 40, 30, 700, f16=True, bias=True)
    work = image.Work()
    image.read(data, work=work)
    assert 0 < work.visits <= len(data)
