"""Format version 4, token models (docs/lm.md): the writer's layout, the reader's round trip, and
every status the reader gives a broken attention table, EMBED layer or header."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import colibri
from colibri.model import format as F
from colibri import image, reference
from colibri.quant import quantize
from colibri.model.errors import ImageError
from colibri.model.format import DType, Op, Status
from colibri.model.ir import Attention, Embedding, Graph, Linear, Q8Weight

from helpers import lmmodels
from helpers.lm_records import BAD_RECORDS, attention_offset, patched


def _arrays_equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, Q8Weight):
        return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("q", "scale", "row_ptr", "col", "val"))
    if hasattr(a, "data") and not isinstance(a, np.ndarray):
        return np.array_equal(a.data, b.data)
    return np.array_equal(a, b)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8"])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip(dtype: str, tied: bool) -> None:
    g = quantize.quantize(lmmodels.token_model(4, tied=tied, bias=True, qk_norm="head", kv_dtype=DType.F16), dtype)
    data = image.write(g)
    assert struct.unpack_from("<H", data, 4)[0] == F.LM_VERSION
    back = image.read(data)
    assert back.is_token_model and back.vocab_size == 40 and back.max_seq_len == 24 and back.max_batch == 8
    assert (back.layers[-1].weight is back.layers[0].table) == tied
    for want, got in zip(g.attention_layers(), back.attention_layers()):
        for f in ("n_heads", "n_kv_heads", "head_dim", "rope_theta", "max_seq_len", "kv_dtype", "qk_norm_eps"):
            assert getattr(want, f) == pytest.approx(getattr(got, f)), f
        for f in ("q_w", "k_w", "v_w", "o_w", "q_b", "k_b", "v_b", "o_b", "q_norm", "k_norm"):
            assert _arrays_equal(getattr(want, f), getattr(got, f)), f
    assert _arrays_equal(g.layers[0].table, back.layers[0].table)
    assert image.write(back) == data  # a read graph writes the same bytes
    ids = [3, 1, 4, 1, 5]
    np.testing.assert_array_equal(reference.LMState(g).forward_tokens(ids), reference.LMState(back).forward_tokens(ids))


def test_tied_head_stores_the_table_once() -> None:
    untied = image.write(lmmodels.token_model(4, tied=False))
    tied = image.write(lmmodels.token_model(4, tied=True))
    n_untied, n_tied = struct.unpack_from("<I", untied, 32)[0], struct.unpack_from("<I", tied, 32)[0]
    assert n_tied == n_untied - 1
    layers = _layer_records(tied)
    assert layers[0][0] == Op.EMBED and layers[-1][0] == Op.LINEAR and layers[-1][5] == layers[0][5]


def test_version_rules() -> None:
    g = lmmodels.token_model(1)
    with pytest.raises(ValueError, match="token model"):
        image.write(g, version=3)
    with pytest.raises(ValueError, match="per-tensor CRCs"):
        image.write(g, tensor_crc=False)
    feature = Graph(layers=[Linear(np.eye(3, dtype=np.float32))], input_size=3, output_size=3)
    with pytest.raises(ValueError, match="token models only"):
        image.write(feature, version=F.LM_VERSION)
    assert image.write(feature)[4] < F.LM_VERSION  # feature models stay readable by older engines
    n_a, a_off = F.V4_FIELDS.unpack_from(image.write(g), F.V4_FIELDS_OFFSET)
    assert n_a == 2 and a_off % 4 == 0


# ---------------------------------------------------------------------------
# Validation


def _header(data: bytes) -> tuple:
    return F.HEADER.unpack_from(data, 0)


def _layer_records(data: bytes) -> list[tuple]:
    h = _header(data)
    return [F.LAYER.unpack_from(data, h[12] + i * F.LAYER.size) for i in range(h[11])]


def _status(data: bytes) -> Status:
    with pytest.raises(ImageError) as exc:
        image.read(data)
    return exc.value.status


@pytest.fixture(scope="module")
def lm_image() -> bytes:
    return image.write(lmmodels.token_model(6, qk_norm="head", bias=True))


def _layer_field(data: bytes, index: int, field: int) -> int:
    """Byte offset of field `field` of layer record `index` (LAYER = <BBHIIIIfII)."""
    at = [0, 1, 2, 4, 8, 12, 16, 20, 24, 28][field]
    return _header(data)[12] + index * F.LAYER.size + at




@pytest.mark.parametrize("what,at,fmt,value", BAD_RECORDS, ids=[b[0] for b in BAD_RECORDS])
def test_bad_attention_fields(lm_image: bytes, what: str, at: int, fmt: str, value) -> None:
    assert _status(patched(lm_image, attention_offset(lm_image) + at, fmt, value)) == Status.BAD_ATTENTION


def test_max_seq_len_differs_between_records(lm_image: bytes) -> None:
    assert _status(patched(lm_image, attention_offset(lm_image, 1) + 60, "<I", 25)) == Status.BAD_ATTENTION


def test_eps_without_norms() -> None:
    data = image.write(lmmodels.token_model(6))
    assert _status(patched(data, attention_offset(data) + 56, "<f", 1e-6)) == Status.BAD_ATTENTION


def test_attention_table_bounds(lm_image: bytes) -> None:
    meta = F.V3_FIELDS.unpack_from(lm_image, F.V3_FIELDS_OFFSET)[0]
    assert _status(patched(lm_image, 76, "<I", attention_offset(lm_image) + 2)) == Status.TABLE_BOUNDS
    assert _status(patched(lm_image, 76, "<I", meta - F.ATTENTION.size + 4)) == Status.TABLE_BOUNDS
    assert _status(patched(lm_image, 72, "<I", 10**6)) == Status.TABLE_BOUNDS


def test_attention_layer_references(lm_image: bytes) -> None:
    attention_layers = [i for i, rec in enumerate(_layer_records(lm_image)) if rec[0] == Op.ATTENTION]
    second = attention_layers[1]
    assert _status(patched(lm_image, _layer_field(lm_image, second, 5), "<I", 2)) == Status.BAD_REF
    assert _status(patched(lm_image, _layer_field(lm_image, second, 5), "<I", 0)) == Status.BAD_REF  # record reused
    assert _status(patched(lm_image, _layer_field(lm_image, second, 6), "<I", 0)) == Status.BAD_LAYER  # t1 set
    assert _status(patched(lm_image, _layer_field(lm_image, second, 7), "<f", 1e-5)) == Status.BAD_LAYER  # eps set
    assert _status(patched(lm_image, _layer_field(lm_image, second, 4), "<I", 17)) == Status.BAD_LAYER  # out != in


def test_embed_layer_rules(lm_image: bytes) -> None:
    # EMBED only as layer 0, and layer 0 always EMBED
    assert _status(patched(lm_image, _layer_field(lm_image, 1, 0), "<B", int(Op.EMBED))) == Status.BAD_LAYER
    assert _status(patched(lm_image, _layer_field(lm_image, 0, 0), "<B", int(Op.LINEAR))) == Status.BAD_LAYER
    # the table's shape is [vocab, d_model]
    assert _status(patched(lm_image, _layer_field(lm_image, 0, 4), "<I", 15)) in (Status.BAD_REF, Status.BAD_LAYER)
    assert _status(patched(lm_image, _layer_field(lm_image, 0, 5), "<I", 1)) == Status.BAD_REF
    assert _status(patched(lm_image, _layer_field(lm_image, 0, 6), "<I", 0)) == Status.BAD_LAYER  # t1
    assert _status(patched(lm_image, _layer_field(lm_image, 0, 2), "<H", 1)) == Status.BAD_LAYER  # INT8_ACT


def test_embed_table_q8_without_bias() -> None:
    g = quantize.quantize(lmmodels.token_model(6), "q8")
    g.layers[0].table.bias = np.zeros(g.vocab_size, dtype=g.layers[0].table.scale.dtype)
    assert _status(image.write(g)) == Status.BAD_REF


def test_token_model_header(lm_image: bytes) -> None:
    assert _status(patched(lm_image, 24, "<I", 41)) == Status.BAD_HEADER  # output_size != input_size
    # a newer format than this reader: UNSUPPORTED_VERSION
    assert _status(patched(lm_image, 4, "<H", F.MAX_READ_VERSION + 1)) == Status.UNSUPPORTED_VERSION
    # version 5 (int4 weights) keeps v4's header: a token model relabelled v5 is still one
    relabelled = patched(lm_image, 4, "<H", F.Q4_VERSION)
    assert image.read(relabelled).is_token_model and colibri.validate(relabelled) is None


def test_token_ops_need_version_4() -> None:
    feature = image.write(Graph(layers=[Linear(np.eye(3, dtype=np.float32)), Linear(np.eye(3, dtype=np.float32))],
                                input_size=3, output_size=3), version=3)
    for op in (Op.EMBED, Op.ATTENTION):
        assert _status(patched(feature, _layer_field(feature, 1, 0), "<B", int(op))) == Status.BAD_LAYER


def test_token_model_needs_attention() -> None:
    table = np.ones((8, 4), np.float32)
    g = Graph(layers=[Embedding(table), Linear(table)], input_size=8, output_size=8)
    assert _status(image.write(g)) == Status.BAD_LAYER


def test_statuses_match_image_status(lm_image: bytes) -> None:
    assert image.status(lm_image) == 0
    bad = patched(lm_image, attention_offset(lm_image) + 52, "<f", 0.0)
    assert image.status(bad) == int(Status.BAD_ATTENTION)


RANGE_CASES = [("rope_theta", 52, "<f"), ("max_seq_len", 60, "<I")]


@pytest.mark.parametrize("field,at,fmt", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_rope_range_is_the_same_in_c_and_python(lm_image: bytes, field: str, at: int, fmt: str) -> None:
    """The admissible RoPE range (docs/lm.md: rope_theta >= 1, max_seq_len <= 2^20, so every angle is
    below 2^20): the C validator and image.read give the same status on both sides of each edge."""
    from colibri.runtime import _engine

    edges = ([1.0, 0.99999994, 1e-20, 1e-30, 1e6, 3.4e38] if field == "rope_theta" else
             [F.MAX_SEQ_LEN, F.MAX_SEQ_LEN + 1, 1 << 31])
    for value in edges:
        data = bytearray(lm_image)
        for j in range(2):  # both records: max_seq_len must agree between them
            struct.pack_into(fmt, data, attention_offset(lm_image, j) + at, value)
        image.set_crc(data)
        python = image.status(bytes(data))
        assert _engine.validate(bytes(data)) == python, (field, value)
        ok = value >= 1.0 if field == "rope_theta" else value <= F.MAX_SEQ_LEN
        assert python == (0 if ok else int(Status.BAD_ATTENTION)), (field, value, python)
