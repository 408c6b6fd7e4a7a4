"""INT8_BLOCKS (docs/model-format.md): int8 activations with one f32 scale per 32 columns, for I8 and
I4 weights. The numpy reference against the format's definition written out as loops, the C engine
(reference and optimised kernels) against the numpy reference on feature and token models, the
flag's validation in C and Python status for status, the arena with the block scales, and the
quantiser's patterns. The kernels themselves, every x86 level: tests/c/colibri_blocks_test.c."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.model.errors import ExportError
from colibri.model.format import Status
from colibri.model.ir import Graph, Linear
from colibri.quant.quantize import quantize, quantize_q4, quantize_q8

from helpers import lmmodels
from helpers.c_drivers import check
from helpers.engine_models import ENGINE_MODELS
from helpers.quant_models import inputs


def _x(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """Rows whose 32-column blocks differ in magnitude by up to 2^24, one block all zero."""
    x = rng.standard_normal((n, d)).astype(np.float32)
    for b in range(0, d, 32):
        x[:, b : b + 32] *= np.float32(2.0 ** rng.integers(-12, 12))
    x[0, :32] = 0
    return x


@pytest.mark.parametrize("d", [1, 31, 32, 33, 70, 128])
def test_quantize_blocks_is_quantize_rows_per_block(d: int) -> None:
    rng = np.random.default_rng(d)
    x = _x(rng, 3, d)
    x[2, d // 2] = np.nan
    xq, a = reference.quantize_blocks(x)
    assert xq.shape == (3, d) and a.shape == (3, -(-d // 32)) and a.dtype == np.float32
    for b in range(a.shape[1]):
        q1, a1 = reference.quantize_rows(x[:, 32 * b : 32 * b + 32])
        np.testing.assert_array_equal(xq[:, 32 * b : 32 * b + 32], q1)
        np.testing.assert_array_equal(a[:, b], a1)
    assert a[0, 0] == 0 and not xq[0, :32].any()
    assert np.isnan(a[2, (d // 2) // 32]) and not np.isnan(np.delete(a[2], (d // 2) // 32)).any()


def test_reference_q8_blocks_is_the_definition() -> None:
    """v = (Σ_b (f32)(Σ_{j in b} Q·xq) · a_b) · s, blocks in order, each step rounded to f32."""
    rng = np.random.default_rng(1)
    w = quantize_q8(rng.standard_normal((5, 77)).astype(np.float32), 0.0)
    x = _x(rng, 3, 77)
    y = reference.run(Graph([Linear(w, int8_blocks=True)], 77, 5), x)
    xq, a = reference.quantize_blocks(x)
    for i in range(3):
        for o in range(5):
            v = np.float32(0)
            for b in range(3):
                d = int(np.dot(xq[i, 32 * b : 32 * b + 32], w.q[o, 32 * b : 32 * b + 32].astype(np.int64)))
                v = np.float32(v + np.float32(d) * a[i, b])
            assert y[i, o] == np.float32(v * np.float32(w.scale[o]))


@pytest.mark.parametrize("group", [8, 32, 64])
def test_reference_q4_blocks_is_the_definition(group: int) -> None:
    """v = Σ_u (f32)(Σ_{c in u} Q·xq) · (s_g · a_b) over units of min(group, 32) columns."""
    rng = np.random.default_rng(group)
    w = quantize_q4(rng.standard_normal((4, 100)).astype(np.float32), 0.0, group=group)
    x = _x(rng, 2, 100)
    y = reference.run(Graph([Linear(w, int8_blocks=True)], 100, 4), x)
    xq, a = reference.quantize_blocks(x)
    unit = min(group, 32)
    for i in range(2):
        for o in range(4):
            v = np.float32(0)
            for lo in range(0, 100, unit):
                d = int(np.dot(xq[i, lo : lo + unit], w.q[o, lo : lo + unit].astype(np.int64)))
                v = np.float32(v + np.float32(d) * np.float32(np.float32(w.scale[o, lo // group]) * a[i, lo // 32]))
            assert y[i, o] == v


def test_blocks_are_closer_to_f32_activations_than_one_scale_per_row() -> None:
    """The point of the form: one large block (an outlier feature) no longer coarsens the others. The
    outlier's columns meet zero weights, so the error is what the other blocks' quantisation costs;
    the same q8 weights throughout, so only the activations' form differs."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    w[:, :32] = 0
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[:, :32] *= 1000
    g = Graph([Linear(w)], 256, 64, max_batch=16)
    want = reference.run(quantize(g, "q8", compensation=0.0), x)
    err = {}
    for form in ("int8_act", "int8_blocks"):
        got = reference.run(quantize(g, "q8", compensation=0.0, **{form: ["layers.0"]}), x)
        err[form] = float(np.abs(got - want).max() / np.abs(want).max())
    assert err["int8_blocks"] < 0.02 < 0.2 < err["int8_act"], err


ENGINE_VARIANTS = {
    "q8": ("q8", {}),
    "q8-noE": ("q8", {"compensation": 0.0}),
    "q4": ("q4", {}),
    "q4-g8": ("q4", {"group": 8}),
    "q4-g128-noE": ("q4", {"group": 128, "compensation": 0.0}),
    "q4-q8-mixed": ("q4", {"q8": ["layers.0"]}),
}


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
@pytest.mark.parametrize("model", ["quickstart", "random-0", "random-1", "random-2"])
def test_engine_matches_reference_on_feature_models(model: str, variant: str) -> None:
    """Within a few ulps: the numpy reference adds E as a matrix product and runs the models' f32 parts
    (routers, norms) in numpy's summation order. Single layers bit for bit: test_wide_layers_bit_for_bit."""
    dtype, kw = ENGINE_VARIANTS[variant]
    graph = ENGINE_MODELS[model]()
    img = image.write(quantize(graph, dtype, int8_blocks=["layers.*"], **kw))
    back = image.read(img)
    assert any(getattr(layer, "int8_blocks", False) for layer in back.layers) or any(
        e.int8_blocks for layer in back.layers for e in getattr(layer, "experts", []))
    for batch in sorted({1, graph.max_batch}):
        x = inputs(batch, graph.input_size, seed=11 + batch)
        want = reference.run(image.read(img), x)
        for kernels in (colibri.Model(img), colibri.Model(img, reference_kernels=True)):
            got = kernels.forward(x)
            assert np.abs(got - want).max() <= 1e-5 * (1 + np.abs(want).max())


def test_wide_layers_bit_for_bit() -> None:
    """The expert shapes of the benchmark's model (512 -> 1408 -> 512), q8 and q4, batch 1 and 8."""
    rng = np.random.default_rng(9)
    layers = [Linear(rng.standard_normal((1408, 512)).astype(np.float32) * 0.05),
              Linear(rng.standard_normal((512, 1408)).astype(np.float32) * 0.05)]
    for dtype in ("q8", "q4"):
        img = image.write(quantize(Graph(layers, 512, 512, max_batch=8), dtype, compensation=0.0,
                                   int8_blocks=["layers.*"]))
        for n in (1, 8):
            x = rng.standard_normal((n, 512)).astype(np.float32)
            want = reference.run(image.read(img), x)
            for m in (colibri.Model(img), colibri.Model(img, reference_kernels=True)):
                np.testing.assert_array_equal(m.forward(x), want)


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_token_model_with_blocks_matches_the_reference(dtype: str) -> None:
    """Experts and the head with INT8_BLOCKS: logits over prefill and decode steps."""
    g = quantize(lmmodels.token_model(4, d=40), dtype, int8_blocks=["layers.*"])
    data = image.write(g)
    assert image.read(data).layers[-1].int8_blocks
    rng = np.random.default_rng(4)
    calls = [list(rng.integers(0, 40, 8))] + [[int(rng.integers(0, 40))] for _ in range(6)]
    for reference_kernels in (False, True):
        lm, twin = colibri.LM(data, reference_kernels=reference_kernels), reference.LMState(image.read(data))
        for ids in calls:
            got, want = lm.forward_tokens(ids), twin.forward_tokens(ids)
            assert np.abs(got - want).max() <= 1e-4 * (1 + np.abs(want).max()), (reference_kernels, ids)


def test_arena_holds_the_block_scales(c_drivers: Path) -> None:
    """colibri_check: the arena of colibri_model_size() runs the model, one byte less is ARENA_TOO_SMALL;
    the block scales [B, ceil(Q / 32)] make it larger than the per-row form's [B]."""
    rng = np.random.default_rng(5)
    g = Graph([Linear(rng.standard_normal((20, 200)).astype(np.float32))], 200, 20, max_batch=4)
    rows, blocks = (image.write(quantize(g, "q8", **{k: ["layers.0"]})) for k in ("int8_act", "int8_blocks"))
    lm = image.write(quantize(lmmodels.token_model(6, d=40), "q4", int8_blocks=["layers.*"]))
    for f in check(c_drivers, [rows, blocks, lm]):
        assert f["validate"] == "0" and f["short"] == str(int(Status.ARENA_TOO_SMALL)), f
        assert f["init"] == "0" and f["fwd1"] == "0" and f["sum"] != "nan", f
    grow = colibri.arena_size(blocks) - colibri.arena_size(rows)
    assert grow == 4 * 4 * (7 - 1)  # B = 4 tokens, 7 blocks of 200 columns instead of 1 scale


def _flags_offset(data: bytes, layer: int) -> int:
    """Byte offset of layer record `layer`'s u16 flags (docs/model-format.md "Layer record")."""
    table = struct.unpack_from("<I", data, 44)[0]
    return table + 32 * layer + 2


def _patched(data: bytes, pos: int, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into("<H", buf, pos, value)
    image.set_crc(buf)
    return bytes(buf)


def _status(data: bytes) -> tuple[int, int]:
    return colibri.runtime._engine.validate(data), int(image.status(data))


def test_validation_of_the_flag_agrees() -> None:
    rng = np.random.default_rng(6)
    w = rng.standard_normal((6, 40)).astype(np.float32)
    q8 = image.write(quantize(Graph([Linear(w)], 40, 6), "q8"))
    f32 = image.write(Graph([Linear(w)], 40, 6))
    pos = _flags_offset(q8, 0)
    assert struct.unpack_from("<H", q8, pos)[0] == 0
    assert _status(_patched(q8, pos, 2)) == (0, 0)  # INT8_BLOCKS on an int8 LINEAR
    assert _status(_patched(q8, pos, 3)) == (Status.BAD_LAYER, Status.BAD_LAYER)  # both forms
    assert _status(_patched(q8, pos, 4)) == (Status.BAD_LAYER, Status.BAD_LAYER)  # an unknown bit
    assert _status(_patched(f32, _flags_offset(f32, 0), 2)) == (Status.BAD_LAYER, Status.BAD_LAYER)


def test_validation_of_the_expert_flag_agrees() -> None:
    g = quantize(ENGINE_MODELS["random-0"](), "q8", int8_blocks=["layers.*"])
    data = image.write(g)
    back = image.read(data)
    assert any(e.int8_blocks for layer in back.layers for e in getattr(layer, "experts", []))
    # the expert table (header offsets 56, 60: docs/model-format.md "Header"); flags at offset 2 of each
    table = struct.unpack_from("<I", data, 60)[0]
    count = struct.unpack_from("<I", data, 56)[0]
    assert count > 0
    flags = [struct.unpack_from("<H", data, table + 32 * j + 2)[0] for j in range(count)]
    j = flags.index(2)
    assert _status(_patched(data, table + 32 * j + 2, 3)) == (Status.BAD_MOE, Status.BAD_MOE)
    assert _status(_patched(data, table + 32 * j + 2, 6)) == (Status.BAD_MOE, Status.BAD_MOE)


def test_quantize_patterns() -> None:
    g = ENGINE_MODELS["random-0"]()
    with pytest.raises(ExportError, match="choose one activation form"):
        quantize(g, "q8", int8_act=["layers.*"], int8_blocks=["layers.*"])
    with pytest.raises(ExportError, match="int8 activations need int8 weights"):
        quantize(g, "f16", int8_blocks=["layers.*"])
    with pytest.raises(ExportError, match="matches no weight"):
        quantize(g, "q8", int8_blocks=["nothing.*"])
