"""int4 weights (format v5, docs/model-format.md "Quantised weights: I4 with Q4_PARAMS"): the
writer and reader, the validation of every Q4_PARAMS rule (C validator and Python reader agree
status for status), `quantize_q4`, and the numpy reference's float32 order."""
from __future__ import annotations

import struct
from unittest import mock

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.image import codecs
from colibri.model import format as F
from colibri.model.errors import ExportError
from colibri.model.format import Act, DType, ExpertKind, Routing, Status
from colibri.model.ir import Embedding, Expert, Graph, Linear, MoE, Q4Weight, Q8Weight, dense
from colibri.model.walks import weight_slots
from colibri.quant import quantize as Q
from colibri.quant.quantize import quantize, quantize_q4
from colibri.runtime import _engine
from helpers import lmmodels
from helpers.engine_models import ENGINE_MODELS, assert_engine_matches
from helpers.quant_models import accuracy, graph_of, inputs
from helpers.trained import digits_classifier


def _graph(seed: int = 0, cols: int = 33, hidden: int = 40) -> Graph:
    """Linear (odd columns, bias) → MoE (2 GLU experts, top-1, f32 router) → Linear: square, so a
    relabelled version 4 header still reads as far as the tensors."""
    rng = np.random.default_rng(seed)

    def w(r: int, c: int) -> np.ndarray:
        return (rng.standard_t(3, (r, c)) / np.sqrt(3 * c)).astype(np.float32)

    experts = [Expert(ExpertKind.GLU, Act.SILU, w1=w(hidden, 16), w2=w(16, hidden), w3=w(hidden, 16),
                      b2=rng.standard_normal(16).astype(np.float32) * 0.01) for _ in range(2)]
    moe = MoE(Routing.TOP1, 1, w(2, 16), experts, np.arange(2, dtype=np.int32))
    layers = [Linear(w(16, cols), rng.standard_normal(16).astype(np.float32) * 0.01), moe, Linear(w(cols, 16))]
    return Graph(layers, cols, cols, max_batch=4)


@pytest.fixture(scope="module")
def q4_graph() -> Graph:
    return quantize(_graph(), "q4", compensation=0.02)


@pytest.fixture(scope="module")
def q4_image(q4_graph: Graph) -> bytes:
    return image.write(q4_graph)


def both(data: bytes) -> int:
    """The status of the C validator and of the Python reader, which must agree."""
    c, py = _engine.validate(data), image.status(data)
    assert c == py, f"C validator {Status(c).name}, Python reader {Status(py).name}"
    return c


def records(data: bytes) -> list[tuple]:
    n_t, t_off = struct.unpack_from("<II", data, 32)
    return [F.TENSOR.unpack_from(data, t_off + i * F.TENSOR.size) for i in range(n_t)]


def first(data: bytes, dtype: DType, odd: bool | None = None) -> int:
    """Index of the first tensor of this dtype (with odd cols, when asked)."""
    return next(i for i, r in enumerate(records(data)) if r[4] == dtype and (odd is None or r[3] % 2 == odd))


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, at, value)
    image.set_tensor_crcs(buf)
    return bytes(buf)


def record_at(data: bytes, index: int, field: int) -> int:
    """Byte offset of field `field` of tensor record `index` (TENSOR = <IIIIBBHI)."""
    t_off = struct.unpack_from("<I", data, 36)[0]
    return t_off + index * F.TENSOR.size + [0, 4, 8, 12, 16, 17, 18, 20][field]


def companion(data: bytes, i4: int) -> tuple[int, dict[str, int], tuple]:
    """(payload offset, field offsets, record) of the Q4_PARAMS companion of I4 tensor i4."""
    recs = records(data)
    rec = recs[recs[i4][7]]
    nnz, g_log2, flags, _ = struct.unpack_from("<IBBH", data, rec[0])
    return rec[0], F.q4_layout(rec[2], rec[3], nnz, g_log2, bool(flags & 1)), rec


# --- writer and reader ----------------------------------------------------------------------------


def test_q4_image_round_trips(q4_graph: Graph, q4_image: bytes) -> None:
    assert q4_image[4] == F.Q4_VERSION and both(q4_image) == 0
    assert F.V4_FIELDS.unpack_from(q4_image, F.V4_FIELDS_OFFSET)[0] == 0  # a feature model: no attention table
    back = image.read(q4_image)
    assert not back.is_token_model
    for (name, o1, a1), (_, o2, a2) in zip(weight_slots(q4_graph), weight_slots(back), strict=True):
        w1, w2 = getattr(o1, a1), getattr(o2, a2)
        assert type(w1) is type(w2), name
        np.testing.assert_array_equal(dense(w1), dense(w2))
        if isinstance(w1, Q4Weight):
            assert w2.group == w1.group and np.array_equal(w1.q, w2.q)
            assert (w1.bias is None) == (w2.bias is None)


def test_packing_is_the_spec_nibble_order() -> None:
    q = np.array([[1, -2, 7], [-8, 0, 3]], dtype=np.int8)
    packed = image.q4_pack(q)
    # column c: byte c >> 1, low nibble for even c; the odd row's last high nibble zero
    assert packed == bytes([0xE1, 0x07, 0x08, 0x03])
    np.testing.assert_array_equal(image.q4_unpack(np.frombuffer(packed, np.uint8).reshape(2, 2), 3), q)


def test_non_int4_graphs_keep_their_versions() -> None:
    g = _graph()
    assert image.write(g)[4] == 1 and image.write(quantize(g, "q8"))[4] == F.VERSION
    assert image.write(lmmodels.token_model(0))[4] == F.LM_VERSION
    with pytest.raises(ValueError, match="int4 weights"):
        image.write(g, version=F.Q4_VERSION)
    with pytest.raises(ValueError, match="format version 5"):
        image.write(quantize(g, "q4"), version=3)


def test_token_model_with_int4_is_version_5() -> None:
    lm = quantize(lmmodels.token_model(1), "q4", group=8)
    data = image.write(lm)
    assert data[4] == F.Q4_VERSION and both(data) == 0
    back = image.read(data)
    assert back.is_token_model and isinstance(back.layers[0].table, Q8Weight)  # tables have no int4 form
    kinds = {type(getattr(o, a)) for n, o, a in weight_slots(back) if not n.endswith(".router")}
    assert Q4Weight in kinds



def test_q4_token_model_keeps_attention_k_and_v_in_q8() -> None:
    """k and v (their rounding reaches every cached position) are q8 in a q4 model; q, o and the
    experts int4; a q8 pattern still widens more, and the C engine runs the mixed attention."""
    lm = quantize(lmmodels.token_model(1), "q4", group=8)
    kinds = {n: type(getattr(o, a)) for n, o, a in weight_slots(lm)}
    attention = [n for n in kinds if n.rsplit(".", 1)[-1] in "qkvo" and n.count(".") == 2]
    assert attention and {kinds[n] for n in attention if n.endswith((".k", ".v"))} == {Q8Weight}
    assert {kinds[n] for n in attention if n.endswith((".q", ".o"))} == {Q4Weight}
    assert Q4Weight in {t for n, t in kinds.items() if ".experts." in n}
    wider = quantize(lmmodels.token_model(1), "q4", group=8, q8=["layers.*.q"])
    assert {type(getattr(o, a)) for n, o, a in weight_slots(wider) if n.endswith(".q")} == {Q8Weight}
    data = image.write(lm)
    ids = np.array([3, 1, 4, 1, 5], np.int32)
    got = colibri.LM(data, reference_kernels=True).forward_tokens(ids)
    np.testing.assert_allclose(got, reference.LMState(image.read(data)).forward_tokens(ids), rtol=1e-4, atol=1e-5)


# --- validation: every Q4_PARAMS rule, C and Python alike -------------------------------------------


def test_int4_dtypes_before_version_5_are_bad_tensor(q4_image: bytes) -> None:
    assert both(patched(q4_image, 4, "<H", F.LM_VERSION)) == Status.BAD_TENSOR


@pytest.mark.parametrize("g_log2,status", [(2, Status.BAD_QUANT), (9, Status.BAD_QUANT), (0, Status.BAD_QUANT),
                                           (255, Status.BAD_QUANT)])
def test_group_log2_outside_3_to_8_is_bad_quant(q4_image: bytes, g_log2: int, status: Status) -> None:
    off, _, _ = companion(q4_image, first(q4_image, DType.I4))
    assert both(patched(q4_image, off + 4, "<B", g_log2)) == status


def test_group_log2_that_changes_the_size_is_bad_tensor(q4_image: bytes) -> None:
    off, _, _ = companion(q4_image, first(q4_image, DType.I4))  # 33 columns: group 8 has 5 scales a row, 32 has 2
    assert both(patched(q4_image, off + 4, "<B", 3)) == Status.BAD_TENSOR


@pytest.mark.parametrize("flags", [2, 0x80, 3])
def test_unknown_flags_are_bad_quant(q4_image: bytes, flags: int) -> None:
    off, _, _ = companion(q4_image, first(q4_image, DType.I4))
    assert both(patched(q4_image, off + 5, "<B", flags)) == Status.BAD_QUANT


def test_reserved_nonzero_is_bad_quant(q4_image: bytes) -> None:
    off, _, _ = companion(q4_image, first(q4_image, DType.I4))
    assert both(patched(q4_image, off + 6, "<H", 1)) == Status.BAD_QUANT


def test_wrong_nbytes_is_bad_tensor(q4_image: bytes) -> None:
    i4 = first(q4_image, DType.I4)
    nbytes = records(q4_image)[i4][1]
    assert both(patched(q4_image, record_at(q4_image, i4, 1), "<I", nbytes - 1)) == Status.BAD_TENSOR
    q = records(q4_image)[i4][7]
    assert both(patched(q4_image, record_at(q4_image, q, 1), "<I", 4)) == Status.BAD_TENSOR  # < the header
    off, _, _ = companion(q4_image, i4)
    assert both(patched(q4_image, off, "<I", 1000)) == Status.BAD_TENSOR  # nnz: another size


def test_companion_references_are_bad_quant(q4_image: bytes) -> None:
    recs = records(q4_image)
    i4 = first(q4_image, DType.I4)
    at = record_at(q4_image, i4, 7)
    assert both(patched(q4_image, at, "<I", len(recs))) == Status.BAD_QUANT  # out of range
    assert both(patched(q4_image, at, "<I", i4)) == Status.BAD_QUANT  # not a Q4_PARAMS
    other = next(i for i, r in enumerate(recs) if r[4] == DType.Q4_PARAMS and r[2:4] != recs[i4][2:4])
    assert both(patched(q4_image, at, "<I", other)) == Status.BAD_QUANT  # another shape
    # a companion on a tensor that takes none: BAD_TENSOR (pass 1)
    f32 = next(i for i, r in enumerate(recs) if r[4] == DType.F32)
    assert both(patched(q4_image, record_at(q4_image, f32, 7), "<I", recs[i4][7])) == Status.BAD_TENSOR


def test_companion_of_another_shape_with_the_same_size_is_bad_quant(q4_image: bytes) -> None:
    i4 = first(q4_image, DType.I4, odd=True)  # 16 x 33, group 32: 2 scales a row, so 34 columns fit too
    q = records(q4_image)[i4][7]
    assert both(patched(q4_image, record_at(q4_image, q, 3), "<I", 34)) == Status.BAD_QUANT


def test_q8_and_q4_companions_do_not_cross() -> None:
    mixed = image.write(quantize(_graph(), "q4", q8=["layers.2"], compensation=0.02))
    recs = records(mixed)
    i8, i4 = first(mixed, DType.I8), first(mixed, DType.I4)
    assert both(mixed) == 0
    assert both(patched(mixed, record_at(mixed, i8, 7), "<I", recs[i4][7])) == Status.BAD_QUANT
    assert both(patched(mixed, record_at(mixed, i4, 7), "<I", recs[i8][7])) == Status.BAD_QUANT


def test_odd_columns_padding_nibble_is_bad_quant(q4_image: bytes) -> None:
    i4 = first(q4_image, DType.I4, odd=True)
    off, _, rows, cols = records(q4_image)[i4][:4]
    stride = (cols + 1) // 2
    last_of_row_3 = off + 3 * stride + stride - 1
    assert both(patched(q4_image, last_of_row_3, "<B", q4_image[last_of_row_3] | 0x10)) == Status.BAD_QUANT
    # the low nibble of the same byte is a real weight: any value is valid
    assert both(patched(q4_image, last_of_row_3, "<B", (q4_image[last_of_row_3] & 0xF0) | 0x9)) == 0


@pytest.mark.parametrize("bits,status", [
    (0x7E00, Status.BAD_QUANT),  # NaN
    (0x7C00, Status.BAD_QUANT),  # inf
    (0xBC00, Status.BAD_QUANT),  # -1
    (0x0001, Status.BAD_QUANT),  # subnormal
    (0x8000, Status.OK),  # -0
    (0x0000, Status.OK),
    (0x0400, Status.OK),  # the smallest normal
    (0x7BFF, Status.OK),  # the largest
])
def test_scale_rules(q4_image: bytes, bits: int, status: Status) -> None:
    i4 = first(q4_image, DType.I4)
    off, at, rec = companion(q4_image, i4)
    groups = F.q4_groups(rec[3], struct.unpack_from("<B", q4_image, off + 4)[0])
    last_scale = off + at["scale"] + 2 * (rec[2] * groups - 1)  # every scale is checked, the last too
    assert both(patched(q4_image, last_scale, "<H", bits)) == status


@pytest.mark.parametrize("bits,status", [(0x7E00, Status.BAD_QUANT), (0xFC00, Status.BAD_QUANT),
                                         (0x8001, Status.BAD_QUANT), (0xBC00, Status.OK), (0x8000, Status.OK)])
def test_bias_rules(q4_image: bytes, bits: int, status: Status) -> None:
    i4 = next(i for i, r in enumerate(records(q4_image)) if r[4] == DType.I4 and "bias" in companion(q4_image, i)[1])
    off, at, rec = companion(q4_image, i4)
    assert both(patched(q4_image, off + at["bias"] + 2 * (rec[2] - 1), "<H", bits)) == status


def test_compensation_rules(q4_image: bytes) -> None:
    i4 = first(q4_image, DType.I4)
    off, at, rec = companion(q4_image, i4)
    nnz = struct.unpack_from("<I", q4_image, off)[0]
    assert nnz >= 2
    width = F.q8_row_ptr_bytes(2, nnz)
    fmt = {1: "<B", 2: "<H", 4: "<I"}[width]
    cases = {
        "row_ptr[0] != 0": (off + at["row_ptr"], fmt, 1),
        "row_ptr[rows] != nnz": (off + at["row_ptr"] + width * rec[2], fmt, nnz - 1),
        "column out of range": (off + at["col"], "<H", rec[3]),
        "value inf": (off + at["val"], "<H", 0x7C00),
    }
    for name, (where, f, value) in cases.items():
        assert both(patched(q4_image, where, f, value)) == Status.BAD_COMPENSATION, name
    # columns not increasing within a row: two entries of one row made equal
    rows_of = np.repeat(np.arange(rec[2]), np.diff(np.frombuffer(q4_image, f"<u{width}", rec[2] + 1,
                                                                 off + at["row_ptr"]).astype(np.int64)))
    k = int(np.flatnonzero(rows_of[1:] == rows_of[:-1])[0])
    col_k = struct.unpack_from("<H", q4_image, off + at["col"] + 2 * k)[0]
    assert both(patched(q4_image, off + at["col"] + 2 * (k + 1), "<H", col_k)) == Status.BAD_COMPENSATION
    gap = at["row_ptr"] - (at["bias"] + 2 * rec[2] if "bias" in at else at["scale"] + 2 * rec[2] * F.q4_groups(
        rec[3], struct.unpack_from("<B", q4_image, off + 4)[0]))
    if gap:  # alignment padding before row_ptr: zero
        assert both(patched(q4_image, off + at["row_ptr"] - 1, "<B", 1)) == Status.BAD_COMPENSATION


def _with(graph: Graph, where: str) -> Graph:
    """`graph` with an int4 weight put where the format has none."""
    moe = graph.layers[1]
    q = lambda w: quantize_q4(w)  # noqa: E731
    if where == "router":
        moe.router_weight = q(moe.router_weight)
    elif where == "shared_gate":
        moe.shared_gate = q(np.ones((1, moe.d_model), np.float32))
        moe.shared = [moe.experts[0]]
        moe.experts = moe.experts[1:]
        moe.expert_map = np.array([-1, 0], dtype=np.int32)
    return graph


@pytest.mark.parametrize("where", ["router", "shared_gate"])
def test_int4_routing_weights_are_bad_ref(where: str) -> None:
    data = image.write(_with(_graph(), where))
    assert data[4] == F.Q4_VERSION and both(data) == Status.BAD_REF


def test_int4_embedding_table_is_bad_ref() -> None:
    lm = lmmodels.token_model(1)
    table = lm.layers[0].table
    lm.layers[0].table = quantize_q4(dense(table), group=8)
    for layer in lm.layers:  # a tied head stays the table's tensor
        if isinstance(layer, Linear) and layer.weight is table:
            layer.weight = lm.layers[0].table
    assert both(image.write(lm)) == Status.BAD_REF


def test_int8_act_accepts_int4_and_mixed_weights() -> None:
    g = quantize(_graph(), "q4", q8=["layers.1.experts.0.w2"], int8_act=["layers.0", "layers.1.experts.*"])
    data = image.write(g)
    assert both(data) == 0
    back = image.read(data)
    assert back.layers[0].int8_act and all(e.int8_act for e in back.layers[1].experts)
    with pytest.raises(ExportError, match="int8 activations need int8 weights"):
        quantize(_graph(), "q4", keep=["layers.1.experts.0.w2"], int8_act=["layers.1.experts.*"])


# --- quantize_q4 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [8, 32, 256])
def test_quantize_q4_structure(group: int) -> None:
    rng = np.random.default_rng(group)
    w = (rng.standard_t(3, (24, 100)) * 0.1).astype(np.float32)
    q = quantize_q4(w, 0.01, group=group)
    assert q.q.dtype == np.int8 and q.q.min() >= -8 and q.q.max() <= 7
    assert q.scale.dtype == np.float16 and q.scale.shape == (24, -(-100 // group)) and q.group == group
    assert q.nnz == round(0.01 * w.size)
    # E holds the exact f16 residuals at its entries; elsewhere the error is at most half a step
    # (a clipped weight's, whose group scale the search shrank, is at most the clip's excess)
    approx = dense(q)
    e = q.compensation() != 0
    step = q.scale_per_column()
    err = np.abs(approx - w)
    inside = np.abs(w) <= 7.5 * step
    assert np.all(err[~e & inside] <= step[~e & inside] / 2 + 1e-7)


def test_clip_search_lowers_the_error() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_t(4, (64, 256)).astype(np.float32)
    plain = quantize_q4(w, 0.0, clip_search=False)
    searched = quantize_q4(w, 0.0)
    mse = lambda q: float(np.mean((dense(q) - w) ** 2))  # noqa: E731
    assert mse(searched) < 0.97 * mse(plain)
    # per group the search never does worse than max|w| / 7 (alpha 1 is on the grid)
    per_group = lambda q: ((dense(q) - w) ** 2).reshape(64, 8, 32).sum(axis=2)  # noqa: E731
    assert np.all(per_group(searched) <= per_group(plain) * (1 + 1e-5) + 1e-12)


def test_compensation_helps_int4() -> None:
    rng = np.random.default_rng(2)
    w = (rng.standard_t(2.5, (128, 128)) / 10).astype(np.float32)
    err = {c: float(np.linalg.norm(dense(quantize_q4(w, c)) - w)) for c in (0.0, 0.005, 0.02)}
    assert err[0.02] < err[0.005] < err[0.0]


@pytest.mark.parametrize("bad,message", [
    ({"group": 16 + 1}, "power of two"), ({"group": 4}, "power of two"), ({"group": 512}, "power of two")])
def test_bad_groups_raise(bad: dict, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        quantize(_graph(), "q4", **bad)
    with pytest.raises(ExportError, match=message):
        quantize_q4(np.ones((2, 8), np.float32), **bad)


def test_tiny_and_zero_groups() -> None:
    w = np.zeros((3, 16), np.float32)
    w[1, :8] = 1e-7  # below f16's normal range: the scale becomes the smallest normal
    q = quantize_q4(w, 0.0, group=8)
    assert np.all(q.scale[0] == 0) and q.scale[1, 0] == np.float16(2.0**-14)
    assert both(image.write(Graph([Linear(q)], 16, 3))) == 0


def test_routers_stay_f32_and_biases_move_into_companions(q4_graph: Graph) -> None:
    moe = q4_graph.layers[1]
    assert isinstance(moe.router_weight, np.ndarray)
    assert isinstance(q4_graph.layers[0].weight, Q4Weight) and q4_graph.layers[0].bias is None
    assert q4_graph.layers[0].weight.bias is not None


def _q4_bytes(w: Q4Weight) -> bytes:
    return image.q4_pack(w.q) + codecs.q4_params_payload(w)


def _spec_q4(w: np.ndarray, *args, **kwargs) -> Q4Weight:
    """quantize_q4 with its clip search done by the readable form the fast ones must equal, and the
    int4 values and residuals by numpy."""
    with mock.patch.object(Q, "_q4_scales", Q.q4_scales_spec), mock.patch.object(Q, "_q4_search", None):
        return quantize_q4(w, *args, **kwargs)


# The fast searches: colibri.quant._q4_search with each kernel this CPU runs (the default, the widest,
# last), and the numpy one a checkout without a build uses.
SEARCHES = [f"c-{k}" for k in (Q._q4_search.kernels() if Q._q4_search else ())] + ["numpy"]


@pytest.fixture(params=SEARCHES)
def search(request, monkeypatch):
    """Runs the test with one fast search in place of quantize_q4's default."""
    if request.param == "numpy":
        monkeypatch.setattr(Q, "_q4_search", None)
        yield request.param
        return
    default = Q._q4_search.kernel()
    Q._q4_search.kernel(request.param.removeprefix("c-"))
    try:
        yield request.param
    finally:
        Q._q4_search.kernel(default)


def test_the_c_search_is_built() -> None:
    """A checkout's `make setup` builds the C search: the numpy one is only the unbuilt checkout's."""
    assert Q._q4_search is not None and Q._q4_search.kernel() == Q._q4_search.kernels()[-1]
    with pytest.raises(ValueError, match="no kernel 'sse9'"):
        Q._q4_search.kernel("sse9")


def _edge_matrices():
    rng = np.random.default_rng(7)
    yield "t-tails", rng.standard_t(3, (37, 301)).astype(np.float32) * 0.05
    yield "zeros", np.zeros((5, 40), np.float32)
    w = rng.standard_normal((9, 72)).astype(np.float32)
    w[:, 8:16] = 0  # an all-zero group in every row
    w[3, 40] = 3e4  # one huge outlier: it stretches its group's scale unless E takes it
    w[5] = -0.0
    yield "zero-groups-outlier", w
    yield "ties", rng.integers(-3, 4, (12, 64)).astype(np.float32) * np.float32(0.25)  # exact grid: tied errors
    yield "equal-magnitudes", np.sign(rng.standard_normal((6, 48))).astype(np.float32)
    w = rng.standard_normal((4, 24)).astype(np.float32)
    w[0, :8], w[1, :12] = 1e-42, 3e-39  # subnormal groups: scales that underflow or sit below f16's normals
    w[2, :8] = np.float32(2.0**-14) * 7  # the smallest normal scale exactly
    yield "tiny", w
    w = (rng.standard_normal((40, 96)) * 3e-4).astype(np.float32)  # every scale below f16's normals: 2^-14
    w[::3] *= np.float32(1e-3)  # scales that are subnormal in f32 too, or 0
    yield "subnormal-scales", w
    yield "one-column", rng.standard_normal((7, 1)).astype(np.float32)
    yield "wide", rng.standard_normal((3, 700)).astype(np.float32) * 100
    yield "many-groups", rng.standard_normal((67, 515)).astype(np.float32)  # blocks of 32 groups, a partial last
    yield "half-steps", _half_steps(rng, 24, 512)


def _half_steps(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Weights an ulp from halfway between two steps of their group's α = 1 scale s (a random f16; 7·s
    every 8 columns, the largest |w| of any group): w / s rounds to the nearer step, while a quotient by
    the reciprocal of s often lands on the other side of the half, and another error. The C search must
    divide where it cannot tell (its screen); exactly halfway would not tell, both steps being as far."""
    s = rng.uniform(0.01, 2, (rows, 1)).astype(np.float16).astype(np.float32)
    half = (rng.integers(-7, 7, (rows, cols)) + np.float32(0.5)).astype(np.float32) * s
    w = np.nextafter(half, np.where(rng.random(half.shape) < 0.5, np.float32(0), np.copysign(np.inf, half)))
    w[:, ::8] = 7 * s
    return w.astype(np.float32)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("compensation", [0.0, 0.005, 0.1])
@pytest.mark.parametrize("group", [8, 32, 256])
def test_fast_clip_search_equals_the_spec(group: int, compensation: float, threads: int, search: str,
                                          monkeypatch) -> None:
    """Each fast search (the C one on every kernel: lanes of 32 groups; the numpy one: blocks of groups in
    [group, groups] layout, numpy's summation order replayed), its groups shared among threads, gives
    the spec's bytes on random shapes with ragged tails and on the cases where float details decide:
    zero groups, a huge outlier, tied errors, subnormal and boundary scales. Small blocks make many of
    them, the last one partial."""
    monkeypatch.setattr(Q, "Q4_SEARCH_BLOCK", 3 * 256)
    monkeypatch.setattr(Q, "Q4_SEARCH_THREADS", threads)
    rng = np.random.default_rng(group)
    shapes = [(int(rng.integers(1, 40)), int(rng.integers(1, 600))) for _ in range(6)]
    cases = [(f"random{s}", (rng.standard_normal(s) * rng.uniform(1e-3, 10)).astype(np.float32)) for s in shapes]
    for name, w in cases + list(_edge_matrices()):
        for clip_search in (True, False):
            fast = quantize_q4(w, compensation, group=group, clip_search=clip_search)
            spec = _spec_q4(w, compensation, group=group, clip_search=clip_search)
            assert _q4_bytes(fast) == _q4_bytes(spec), (name, w.shape, clip_search)


def _tied_group(j: int) -> np.ndarray:
    """A group of 8 whose squared error is least, and exactly equal, for two clip ratios of the grid.

    amax = 7 makes α = 1's scale 1; s_j is the j-th ratio's scale. The weights k·s_j (k = 6, 3, 2) are
    exact steps of s_j, and off by k·(1 − s_j) from steps of 1; the 7 is off by 7·(1 − s_j) from 7·s_j.
    So the error under s_j is 49·(1 − s_j)², under 1 it is (36 + 9 + 4)·(1 − s_j)², every term exact in
    float32 (1 − s_j has few bits), and every smaller scale does worse on the 7."""
    s_j = Q._f16_scale(np.float32(7) * Q.Q4_CLIP_GRID[j] / np.float32(7)).astype(np.float32)
    return np.array([7, 6 * s_j, 3 * s_j, 2 * s_j, 0, 0, 0, 0], np.float32)


@pytest.mark.parametrize("j,tied", [(1, (0, 1)), (3, (1, 2))])
def test_a_tie_keeps_the_earlier_clip_ratio(j: int, tied: tuple[int, int], search: str) -> None:
    """Of two clip ratios with the same least error the first is kept (the spec's strict `<`), by every
    search, whichever lane, block and position in its row the group has."""
    group = _tied_group(j)
    g = np.zeros((3, 40, 8), np.float32)
    rng = np.random.default_rng(j)
    g[...] = rng.standard_normal(g.shape)
    g[1, 37] = group  # in the second block of 32 groups, a partial one
    g[2, 0] = group[::-1]
    m = np.ones(g.shape, bool)
    amax = np.abs(group).max(keepdims=True)[None]
    errors = np.array([Q.q4_fit_spec(group[None, None], m[:1, :1], amax, a)[1][0, 0] for a in Q.Q4_CLIP_GRID])
    assert tuple(np.flatnonzero(errors == errors.min())) == tied  # the construction holds
    scales = [Q.q4_fit_spec(group[None, None], m[:1, :1], amax, Q.Q4_CLIP_GRID[i])[0][0, 0] for i in tied]
    assert scales[0] != scales[1]
    got = Q._q4_scales(g, m, True)
    assert got[1, 37] == scales[0] and got[2, 0] == scales[0]
    np.testing.assert_array_equal(got, Q.q4_scales_spec(g, m, True))


@pytest.mark.parametrize("group", [8, 16, 32, 64, 128, 256])
def test_c_search_errors_are_the_specs_sums(group: int) -> None:
    """Every clip ratio's squared error of every group, as the C search compares them, is the spec's
    float32 sum bit for bit (numpy's pairwise order) on every kernel: on heavy-tailed weights, where the
    clipped largest weight's error dwarfs the others', a left-to-right sum differs in many groups; and on
    weights halfway between two steps, where only the division rounds as numpy does."""
    rng = np.random.default_rng(group)
    g = rng.standard_t(2, (2, 700, group)).astype(np.float32)
    g[1, 600:] = _half_steps(rng, 100, group).reshape(100, group)  # ties to even in the division
    m = rng.random(g.shape) > 0.05
    m[1, 600:] = True
    amax = np.where(m, np.abs(g), 0).max(axis=2)
    spec = np.stack([Q.q4_fit_spec(g, m, amax, a)[1].ravel() for a in Q.Q4_CLIP_GRID])
    flat_g, flat_m = g.reshape(-1, group), m.reshape(-1, group)
    default = Q._q4_search.kernel()
    try:
        for kernel in Q._q4_search.kernels():
            Q._q4_search.kernel(kernel)
            out = np.empty(flat_g.shape[0], np.float32)
            errors = np.empty((len(Q.Q4_CLIP_GRID), flat_g.shape[0]), np.float32)
            assert Q._q4_search.errors(flat_g, flat_m, Q.Q4_CLIP_GRID, out, errors) == Q._q4_search.OK
            np.testing.assert_array_equal(errors, spec, err_msg=kernel)
            np.testing.assert_array_equal(out, Q.q4_scales_spec(g, m, True).ravel(), err_msg=kernel)
    finally:
        Q._q4_search.kernel(default)
    # the order matters on these weights: the same squares summed left to right
    sequential = np.stack([np.add.accumulate(np.where(m, (g - _q(g, s) * s[:, :, None]) ** 2, 0), axis=2)[..., -1]
                           .ravel() for s in (Q.q4_fit_spec(g, m, amax, a)[0] for a in Q.Q4_CLIP_GRID)])
    assert np.mean(sequential != spec) > (0.01 if group > 8 else 0.001)


def _q(g: np.ndarray, s: np.ndarray) -> np.ndarray:
    safe = np.where(s > 0, s, np.float32(1))[:, :, None]
    return np.where(s[:, :, None] > 0, np.clip(np.rint(g / safe), -8, 7), 0).astype(np.float32)


def _outcome(fn) -> tuple:
    """The scales' bits fn returns, or the message of the ExportError it raises."""
    try:
        return ("scales", fn().view(np.uint32).tobytes())
    except ExportError as exc:
        return ("refused", str(exc))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_weights_behave_as_before(search: str) -> None:
    """quantize_q4 refuses NaN and inf before the search. Given to the search itself, the C one leaves
    them to the numpy one (whatever it makes of them is what it made before), and a scale beyond f16
    is refused alike."""
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((3, 64), np.float32)
        w[1, 40] = bad
        with pytest.raises(ExportError, match="NaN or inf"):
            quantize_q4(w)
        g, m = w.reshape(3, 2, 32), np.ones((3, 2, 32), bool)
        m[1, 1, 8] = False  # the bad weight unmarked: the numpy search still sees it
        for marks in (np.ones_like(m), m):
            with mock.patch.object(Q, "_q4_search", None):
                before = _outcome(lambda: Q._q4_scales(g, marks, True))  # noqa: B023
            assert _outcome(lambda: Q._q4_scales(g, marks, True)) == before  # noqa: B023
    if Q._q4_search is not None:
        g = np.ones((4, 32), np.float32)
        g[2, 5] = np.nan
        assert Q._q4_search.scales(g, np.ones(g.shape, bool), Q.Q4_CLIP_GRID, np.empty(4, np.float32)) \
            == Q._q4_search.NONFINITE
        g[2, 5] = 1e6
        assert Q._q4_search.scales(g, np.ones(g.shape, bool), Q.Q4_CLIP_GRID, np.empty(4, np.float32)) \
            == Q._q4_search.TOO_LARGE


def test_c_search_refuses_bad_buffers() -> None:
    S = Q._q4_search
    g, m, out = np.ones((4, 32), np.float32), np.ones((4, 32), bool), np.empty(4, np.float32)
    with pytest.raises(ValueError, match="power of two"):
        S.scales(np.ones((4, 12), np.float32), np.ones((4, 12), bool), Q.Q4_CLIP_GRID, out)
    with pytest.raises(ValueError, match="disagree"):
        S.scales(g, m, Q.Q4_CLIP_GRID, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="disagree"):
        S.scales(g, m[:3], Q.Q4_CLIP_GRID, out)
    with pytest.raises(TypeError, match="float32"):
        S.scales(g.astype(np.float64), m, Q.Q4_CLIP_GRID, out)
    with pytest.raises(TypeError, match="bool"):
        S.scales(g, m.astype(np.int32), Q.Q4_CLIP_GRID, out)
    with pytest.raises(ValueError, match="alphas is empty"):
        S.scales(g, m, np.zeros(0, np.float32), out)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        S.scales(np.ones((4, 64), np.float32)[:, ::2], m, Q.Q4_CLIP_GRID, out)
    with pytest.raises(ValueError, match="disagree"):
        S.values(g, out, np.empty((4, 31), np.int8), np.empty((4, 32), np.float32))
    with pytest.raises(TypeError, match="int8"):
        S.values(g, out, np.empty((4, 32), np.uint8), np.empty((4, 32), np.float32))


@pytest.mark.parametrize("n", [8, 16, 32, 64, 128, 256])
def test_pairwise_sum_is_numpys_order(n: int) -> None:
    """The fast search's group sums replay numpy's float32 add.reduce over a contiguous run, the spec's
    `sum(axis=2)`: on values whose rounding depends on the order (a large term among small ones) they
    agree bit for bit where a left-to-right sum does not."""
    rng = np.random.default_rng(n)
    x = rng.uniform(0, 1, (5000, n)).astype(np.float32)
    x[np.arange(5000), rng.integers(0, n, 5000)] = np.float32(2.0**24) * rng.uniform(0.5, 1, 5000).astype(np.float32)
    want = x.sum(axis=1)
    got = Q._pairwise_sum(np.ascontiguousarray(x.T))
    assert np.array_equal(got, want)
    sequential = np.zeros(5000, np.float32)
    for j in range(n):
        sequential += x[:, j]
    assert not np.array_equal(sequential, want)  # the order matters on these values


def test_largest_is_argpartitions_set() -> None:
    """The n largest (E's entries, the weights set aside): the set argpartition picks, also where a
    tie at the boundary, NaN, inf or a tiny or wide n send it to argpartition itself."""
    rng = np.random.default_rng(5)
    cases = []
    for size in (100, 1 << 16, 300_001):
        a = np.abs(rng.standard_normal(size)).astype(np.float32)
        cases += [(a, n) for n in (1, 7, max(1, size // 200), size // 5, size // 3)]
        tied = np.round(a * 4) / 4  # few distinct values: ties straddle the boundary
        cases += [(tied, n) for n in (1, max(1, size // 200), size // 5)]
        spiky = a.copy()
        spiky[rng.integers(0, size, 50)] = np.inf
        cases += [(spiky, 10), (spiky, 200)]
        nan = a.copy()
        nan[3] = np.nan
        cases.append((nan, max(1, size // 200)))
    cases.append((np.zeros(1 << 17, np.float32), 500))
    for a, n in cases:
        want = np.sort(np.argpartition(a, a.size - n)[a.size - n :])
        assert np.array_equal(np.sort(Q._largest(a, n)), want), (a.size, n)


def test_fast_clip_search_refuses_what_the_spec_refuses(search: str) -> None:
    w = np.ones((3, 64), np.float32)
    w[2, 50] = 1e6  # a group scale beyond f16, with no E to take the weight
    with pytest.raises(ExportError, match="too large for q4") as fast:
        quantize_q4(w, 0.0)
    with pytest.raises(ExportError, match="too large for q4") as spec:
        _spec_q4(w, 0.0)
    assert str(fast.value) == str(spec.value)


# --- the reference's float32 order -------------------------------------------------------------------


def test_reference_sums_groups_in_order() -> None:
    """One output of the f32 path by hand: per group Σ q·x ascending, times the scale, groups in order."""
    rng = np.random.default_rng(3)
    w = quantize_q4(rng.standard_normal((2, 24)).astype(np.float32), 0.0, group=8)
    x = rng.standard_normal((1, 24)).astype(np.float32)
    y = reference.run(Graph([Linear(w)], 24, 2), x)
    for o in range(2):
        v = np.float32(0)
        for g in range(3):
            p = np.float32(0)
            for c in range(8 * g, 8 * g + 8):
                p = np.float32(p + np.float32(w.q[o, c]) * x[0, c])
            v = np.float32(v + p * np.float32(w.scale[o, g]))
        assert abs(float(y[0, o] - v)) <= 1e-6 * (1 + abs(float(v)))


def test_reference_int8_path_is_exact_integer_groups() -> None:
    rng = np.random.default_rng(4)
    w = quantize_q4(rng.standard_normal((3, 40)).astype(np.float32), 0.0, group=8)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    y = reference.run(Graph([Linear(w, int8_act=True)], 40, 3), x)
    xq, a = reference.quantize_rows(x)
    for i in range(2):
        for o in range(3):
            v = np.float32(0)
            for g in range(5):
                acc = int(np.dot(xq[i, 8 * g : 8 * g + 8], w.q[o, 8 * g : 8 * g + 8].astype(np.int64)))
                v = np.float32(v + np.float32(acc) * np.float32(w.scale[o, g]))
            assert y[i, o] == np.float32(v * a[i])


# --- the C engine (CPython binding) against the reference ------------------------------------------
Q4_VARIANTS: dict[str, dict] = {
    "q4": {},
    "q4-g8-noE": {"group": 8, "compensation": 0.0},
    "q4-g256-E2%": {"group": 256, "compensation": 0.02},
    "q4-int8act": {"int8_act": ["layers.*"]},
    "q4-q8-mixed-int8act": {"q8": ["layers.0"], "int8_act": ["layers.*"]},
}


@pytest.mark.parametrize("variant", Q4_VARIANTS)
@pytest.mark.parametrize("model", ["quickstart", "random-0", "random-1", "random-2", "odd"])
def test_engine_matches_reference(model: str, variant: str) -> None:
    graph = _graph(5) if model == "odd" else ENGINE_MODELS[model]()
    img = image.write(quantize(graph, "q4", **Q4_VARIANTS[variant]))
    assert img[4] == F.Q4_VERSION
    for batch in sorted({1, graph.max_batch}):
        x = inputs(batch, graph.input_size, seed=6 + batch)
        assert_engine_matches(img, x)
        want = reference.run(image.read(img), x)
        for kernels in (colibri.Model(img), colibri.Model(img, reference_kernels=True)):
            got = kernels.forward(x)
            assert np.abs(got - want).max() <= 1e-5 * (1 + np.abs(want).max())


def test_reference_kernels_on_linear_layers_with_compensation() -> None:
    """With E on several entries a row the numpy reference adds E as a matrix product, the engine
    entry by entry: within a few ulps, f32 and int8 activations alike."""
    rng = np.random.default_rng(7)
    layers = [Linear(rng.standard_normal((24, 45)).astype(np.float32), rng.standard_normal(24).astype(np.float32)),
              Linear(rng.standard_normal((9, 24)).astype(np.float32))]
    for int8_act in ([], ["layers.*"]):
        g = quantize(Graph(layers, 45, 9, max_batch=8), "q4", group=16, compensation=0.05, int8_act=int8_act)
        img = image.write(g)
        x = rng.standard_normal((8, 45)).astype(np.float32)
        got, want = colibri.Model(img, reference_kernels=True).forward(x), reference.run(image.read(img), x)
        assert np.abs(got - want).max() <= 1e-5 * (1 + np.abs(want).max())


def test_int8_path_bit_exact_without_compensation() -> None:
    rng = np.random.default_rng(8)
    g = quantize(Graph([Linear(rng.standard_normal((17, 70)).astype(np.float32),
                               rng.standard_normal(17).astype(np.float32))], 70, 17, max_batch=4),
                 "q4", group=32, compensation=0.0, int8_act=["layers.0"])
    img = image.write(g)
    x = rng.standard_normal((4, 70)).astype(np.float32)
    for m in (colibri.Model(img, reference_kernels=True), colibri.Model(img)):
        np.testing.assert_array_equal(m.forward(x), reference.run(image.read(img), x))


@pytest.mark.parametrize("int8_act", [[], ["layers.*"]])
def test_token_model_runs_q4(int8_act: list[str]) -> None:
    data = image.write(quantize(lmmodels.token_model(2), "q4", group=8, int8_act=int8_act))
    assert data[4] == F.Q4_VERSION
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    for reference_kernels in (False, True):
        got = colibri.LM(data, reference_kernels=reference_kernels).forward_tokens(ids)
        want = reference.LMState(image.read(data)).forward_tokens(ids)
        assert np.abs(got - want).max() <= 1e-4 * (1 + np.abs(want).max())


# --- issue 14's targets that need no trained cache (the rest: scripts/measure.py group q4) ------------


def test_q4_image_is_at_most_0_16_of_f32_on_wide_layers() -> None:
    """test_image_size_ratios' weight-dominated MoE (d 128, 8 SwiGLU experts of 512): int4 + group
    scales + E (0.5 %) + row pointers."""
    import torch

    from colibri import nn as cnn

    torch.manual_seed(5)
    g = graph_of(cnn.MoE(128, 8, 512, top_k=2, gated=True, activation="silu", expert_bias=False))
    ratio = len(image.write(quantize(g, "q4"))) / len(image.write(g))
    print(f"q4 / f32 image bytes: {ratio:.4f}")
    assert ratio <= 0.16


def test_trained_digits_q4_accuracy_within_one_point() -> None:
    trained = digits_classifier(seed=0)
    acc = {name: accuracy(colibri.Model(image.write(g)).forward(trained.x_test), trained.y_test)
           for name, g in (("f32", trained.graph), ("q4", quantize(trained.graph, "q4")))}
    print(f"digits: f32 {acc['f32']:.4f}, q4 {acc['q4']:.4f}")
    assert acc["f32"] >= 0.93 and acc["q4"] >= acc["f32"] - 0.01


def test_cli_quantize_q4_and_info(tmp_path) -> None:
    from click.testing import CliRunner

    from colibri.cli import main

    src, out = tmp_path / "model.clb", tmp_path / "q4.clb"
    src.write_bytes(image.write(_graph()))
    runner = CliRunner()
    r = runner.invoke(main, ["quantize", str(src), str(out), "--dtype", "q4", "--group", "16", "--q8", "layers.2",
                             "--report"])
    assert r.exit_code == 0, r.output
    assert "int4 group scales" in r.output and "format v5" in r.output
    back = image.read(out.read_bytes())
    assert isinstance(back.layers[0].weight, Q4Weight) and back.layers[0].weight.group == 16
    assert isinstance(back.layers[2].weight, Q8Weight)
    info = runner.invoke(main, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert "q4/g16+E" in info.output and "q8+E" in info.output
    bad = runner.invoke(main, ["quantize", str(src), str(tmp_path / "x.clb"), "--dtype", "q4", "--group", "12"])
    assert bad.exit_code != 0 and "power of two" in bad.output and not (tmp_path / "x.clb").exists()


@pytest.mark.parametrize("name", ["mlp-activations-f32", "softmax-topk-renorm-f16", "softmax-topk-q8",
                                  "softmax-topk-q8-v1", "page-aligned-q8-int8act-v3", "tensor-crc-f16-v3",
                                  "glu-q4-int8act", "mlp-q4-odd-columns", "wide-e-q4", "mixed-q4-q8"])
def test_seed_images_stay_byte_identical(name: str) -> None:
    """Version 5 changes nothing for other images: the committed fuzz seeds (written before int4 existed,
    formats v1, v2 and v3) come out of today's writer byte for byte. The int4 seeds pin the quantiser:
    the clip search's scales, the int4 values and E as they were first written."""
    import sys
    import zlib
    from pathlib import Path

    import torch

    fuzz = Path(__file__).resolve().parents[2] / "fuzz"
    sys.path.insert(0, str(fuzz))
    try:
        import make_seeds
    finally:
        sys.path.remove(str(fuzz))
    factory, opts = make_seeds.MODELS[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    assert make_seeds.seed_image(factory, opts) == (fuzz / "corpus" / "engine" / f"{name}.clb").read_bytes()
