"""INT8_BLOCKS on attention records (docs/lm.md "Attention record"): the four projections with int8
activations in blocks of 32, as an INT8_BLOCKS LINEAR layer.

The flag is written, read back and chosen by export patterns (`layers.N` names an attention block);
the C engine (optimised and reference kernels) gives the numpy reference's logits bit for bit where
the reference is the bit specification (no sparse E, whose numpy sum order differs: the first row,
which attends to itself alone) and within the token-model tolerance everywhere else; the C
validator and the Python reader give the same status for every value of the flags byte, every
reserved byte and every single-byte change of an attention-blocks image's metadata; the arena
grows by the int8 rows and block scales the projections need, exactly."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.model import format as F
from colibri.model.errors import ExportError, ImageError
from colibri.model.format import AttentionFlag, DType, Status
from colibri.model.ir import Attention, Embedding, Graph, Linear
from colibri.quant.quantize import quantize
from colibri.runtime import _engine
from helpers import lmmodels
from helpers.c_drivers import check, status
from helpers.lm_records import attention_offset, patched

# As tests/lm/test_lm_engine.py: |engine - reference| <= TOL · (1 + max|reference|) per row. A few rows
# get STEP_TOL: int8 activations turn an ulp of difference upstream (softmax's and the norms' summation
# order) into a whole quantisation step where a value lies on a rounding boundary, and one step of one
# element moves that row's logits by about |w| · (block max / 127).
TOL_OPTIMISED = 5e-6
STEP_TOL = 2e-3
STEP_ROWS = 0.1  # the share of rows that may take a step


def _row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.max(np.abs(got - want), axis=1) / (1 + np.max(np.abs(want), axis=1))


def _agree(got: np.ndarray, want: np.ndarray) -> bool:
    err = _row_errors(got, want)
    return err.max() <= STEP_TOL and np.mean(err > TOL_OPTIMISED) <= STEP_ROWS


def _projection_model(seed: int, d: int, heads: int, kv_heads: int, hd: int, *, bias: bool = False,
                      vocab: int = 40) -> Graph:
    """EMBED, ATTENTION, LINEAR head: at position 0 a row's attention output is its own value row (one
    score, softmax 1), so its logits are the v, o and head projections of the embedding row alone."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, d)).astype(np.float32)
    att = lmmodels.attention(rng, d, heads, kv_heads, hd, 24, bias=bias)
    head = (rng.standard_normal((vocab, d)) / np.sqrt(d)).astype(np.float32)
    return Graph([Embedding(table), att, Linear(head)], vocab, vocab, max_batch=8)


def _attention_flags(data: bytes) -> list[int]:
    count = F.V4_FIELDS.unpack_from(data, F.V4_FIELDS_OFFSET)[0]
    return [data[attention_offset(data, j) + F.ATTENTION_FLAGS_OFFSET] for j in range(count)]


def test_the_flag_is_written_read_and_chosen_by_patterns() -> None:
    g = lmmodels.token_model(1)
    attention_at = [i for i, layer in enumerate(g.layers) if isinstance(layer, Attention)]
    everything = image.write(quantize(g, "q4", int8_blocks=["layers.*"]))
    assert _attention_flags(everything) == [int(AttentionFlag.INT8_BLOCKS)] * 2
    back = image.read(everything)
    assert [back.layers[i].int8_blocks for i in attention_at] == [True, True]
    # One attention block by its layer name; experts only; per-row int8 patterns pass over attention.
    one = image.read(image.write(quantize(g, "q8", int8_blocks=[f"layers.{attention_at[1]}"])))
    assert [one.layers[i].int8_blocks for i in attention_at] == [False, True]
    assert not any(e.int8_blocks for layer in one.layers for e in getattr(layer, "experts", []))
    experts = image.write(quantize(g, "q8", int8_blocks=["layers.*.experts.*"]))
    assert _attention_flags(experts) == [0, 0]
    rows = image.read(image.write(quantize(g, "q8", int8_act=["layers.*"])))
    assert not any(rows.layers[i].int8_blocks for i in attention_at) and rows.layers[-1].int8_act
    # Attention blocks beside per-row experts: two patterns, each target one form.
    mixed = image.read(image.write(quantize(g, "q8", int8_act=["layers.*.experts.*"],
                                            int8_blocks=[f"layers.{i}" for i in attention_at])))
    assert all(mixed.layers[i].int8_blocks for i in attention_at)
    assert all(e.int8_act for layer in mixed.layers for e in getattr(layer, "experts", []))


def test_patterns_refuse_a_projection_that_is_not_int8_or_int4() -> None:
    g = lmmodels.token_model(2)
    at = next(i for i, layer in enumerate(g.layers) if isinstance(layer, Attention))
    with pytest.raises(ExportError, match=f"layers.{at}: int8 activations need int8 weights"):
        quantize(g, "q8", keep=[f"layers.{at}.k"], int8_blocks=["layers.*"])
    with pytest.raises(ExportError, match="int8 activations need int8 weights"):
        quantize(g, "f16", int8_blocks=[f"layers.{at}"])
    with pytest.raises(ExportError, match="choose one activation form"):
        quantize(g, "q8", int8_act=["layers.*"], int8_blocks=["layers.*"])  # the LINEAR head and experts


SHAPES = {
    "tails": dict(d=48, heads=4, kv_heads=2, hd=10),  # 48 and 40 columns: blocks of 16 and 8 at the end
    "wide": dict(d=200, heads=4, kv_heads=1, hd=34, bias=True),  # 200 and 136: the 64-column steps too
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_first_row_is_the_references_bit_for_bit(shape: str, dtype: str) -> None:
    """Without E the reference is the bit specification of INT8_BLOCKS: the first row of every call
    from position 0 (one token: the one-token kernels; 3 and 8: the prefill kernels) is its logits
    exactly, with either kernel set; the rest within the tolerance. With f32 activations on the
    projections the same image gives other bits."""
    g = _projection_model(3, **SHAPES[shape])
    data = image.write(quantize(g, dtype, compensation=0.0, int8_blocks=["layers.*"]))
    plain = image.write(quantize(g, dtype, compensation=0.0, int8_blocks=["layers.2"]))  # the head only
    assert _attention_flags(data) == [2] and _attention_flags(plain) == [0]
    rng = np.random.default_rng(7)
    for reference_kernels in (False, True):
        lm, twin = colibri.LM(data, reference_kernels=reference_kernels), reference.LMState(image.read(data))
        other = colibri.LM(plain, reference_kernels=reference_kernels)
        later_got, later_want = [], []
        for n in (1, 3, 8):
            for _ in range(4):
                ids = [int(t) for t in rng.integers(0, 40, n)]
                for m in (lm, twin, other):
                    m.reset()
                got, want, f32_act = lm.forward_tokens(ids), twin.forward_tokens(ids), other.forward_tokens(ids)
                assert got[0].tobytes() == want[0].tobytes(), (reference_kernels, ids)
                assert np.abs(f32_act[0] - want[0]).max() > 0
                later_got.append(got[1:])
                later_want.append(want[1:])
        got, want = np.concatenate(later_got), np.concatenate(later_want)
        assert _agree(got, want), (reference_kernels, _row_errors(got, want))


CONFIGS = {
    "gqa": dict(heads=4, kv_heads=2),
    "mqa-bias": dict(heads=4, kv_heads=1, bias=True),
    "mha-tied": dict(heads=3, kv_heads=3, tied=True),
    "qknorm-head-f16kv": dict(qk_norm="head", kv_dtype=DType.F16),
    "qknorm-all-bias": dict(qk_norm="all", bias=True),
}


@pytest.mark.parametrize("dtype", ["q8", "q4"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_the_reference_at_every_position(name: str, dtype: str) -> None:
    """Whole token models (E included, every projection, the experts and the head with INT8_BLOCKS)
    over a prefill, a shorter chunk and single tokens to the end of the cache, either kernel set: the
    reference's logits (rows at the f32 tolerance, a few a quantisation step off), while f32 activations
    on the projections alone move nearly every row by a hundred times that tolerance."""
    g = lmmodels.token_model(5, **CONFIGS[name])
    data = image.write(quantize(g, dtype, int8_blocks=["layers.*"]))
    plain = image.write(quantize(g, dtype, int8_blocks=["layers.*.experts.*", "layers.*.shared.*",
                                                        f"layers.{len(g.layers) - 1}"]))
    assert set(_attention_flags(data)) == {2} and set(_attention_flags(plain)) == {0}
    rng = np.random.default_rng(5)
    calls = [list(rng.integers(0, 40, 8)), list(rng.integers(0, 40, 3))]
    calls += [[int(t)] for t in rng.integers(0, 40, 24 - 11)]
    for reference_kernels in (False, True):
        lm, twin = colibri.LM(data, reference_kernels=reference_kernels), reference.LMState(image.read(data))
        other = reference.LMState(image.read(plain))
        got, want, f32_act = [], [], []
        for ids in calls:
            got.append(lm.forward_tokens(ids))
            want.append(twin.forward_tokens(ids))
            f32_act.append(other.forward_tokens(ids))
        got, want, f32_act = map(np.concatenate, (got, want, f32_act))
        assert lm.position == 24
        assert _agree(got, want), (name, dtype, reference_kernels, _row_errors(got, want))
        assert np.mean(_row_errors(f32_act, want) > 100 * TOL_OPTIMISED) > 0.9, (name, dtype)


def test_mixed_int8_and_int4_projections_run_as_the_reference() -> None:
    g = lmmodels.token_model(6)
    at = next(i for i, layer in enumerate(g.layers) if isinstance(layer, Attention))
    data = image.write(quantize(g, "q4", q8=[f"layers.{at}.q"], int8_blocks=["layers.*"]))  # k, v q8 by default
    back = image.read(data)
    assert type(back.layers[at].q_w).__name__ == "Q8Weight" and type(back.layers[at].o_w).__name__ == "Q4Weight"
    ids = [3, 9, 27, 1, 14]
    want = reference.LMState(back).forward_tokens(ids)
    got = colibri.LM(data).forward_tokens(ids)
    assert _agree(got, want)


def _blocks_images() -> dict[str, bytes]:
    return {
        "q8": image.write(quantize(lmmodels.token_model(8, bias=True), "q8", int8_blocks=["layers.*"])),
        "q4": image.write(quantize(lmmodels.token_model(9, qk_norm="all"), "q4", int8_blocks=["layers.*"])),
    }


@pytest.fixture(scope="module")
def blocks_images() -> dict[str, bytes]:
    return _blocks_images()


def _both(data: bytes) -> tuple[int, int, int]:
    return _engine.validate(data), _engine.validate_structure(data), image.status(data)


def test_every_flags_value_and_reserved_byte(blocks_images: dict[str, bytes]) -> None:
    """Byte 65 of every record: only 0 and INT8_BLOCKS are valid (INT8_BLOCKS only with int8 or int4
    projections); any other value, and any reserved byte 66..79 set, is BAD_ATTENTION in C and Python."""
    f32 = image.write(lmmodels.token_model(8, bias=True))
    for name, data in {**blocks_images, "f32": f32}.items():
        for j in range(2):
            at = attention_offset(data, j)
            for value in range(256):
                case = patched(data, at + F.ATTENTION_FLAGS_OFFSET, "<B", value)
                ok = value == 0 or (value == int(AttentionFlag.INT8_BLOCKS) and name != "f32")
                want = 0 if ok else int(Status.BAD_ATTENTION)
                assert _both(case) == (want, want, want), (name, j, value)
            for pos in range(F.ATTENTION_RESERVED, F.ATTENTION.size):
                case = patched(data, at + pos, "<B", 0x01)
                assert _both(case) == (Status.BAD_ATTENTION,) * 3, (name, j, pos)


def test_flag_with_a_float_projection_is_bad_attention() -> None:
    """Each projection in turn kept f32 or f16 under a set flag (written by hand: the exporter refuses it)."""
    g = lmmodels.token_model(10)
    at = next(i for i, layer in enumerate(g.layers) if isinstance(layer, Attention))
    for proj in "qkvo":
        for dtype in ("f32", "f16"):
            q = quantize(g, "q8", dtypes={f"layers.{at}.{proj}": dtype})
            q.layers[at].int8_blocks = True
            data = image.write(q)
            assert _both(data) == (Status.BAD_ATTENTION,) * 3, (proj, dtype)
            with pytest.raises(ImageError, match="INT8_BLOCKS needs int8 or int4"):
                image.read(data)


def test_metadata_byte_changes_agree_in_c_and_python(c_drivers: Path, blocks_images: dict[str, bytes]) -> None:
    """Every byte of the attention table flipped (three masks) and every other metadata byte (one in
    three), CRC made good: colibri_check (plain, ASan + UBSan) and image.status agree, and an image that
    still validates initialises and runs."""
    for name, data in blocks_images.items():
        meta = struct.unpack_from("<I", data, 64)[0]
        table = attention_offset(data, 0)
        attention = range(table, table + 2 * F.ATTENTION.size)
        cases = []
        for pos in [*attention, *range(F.CRC_START, meta, 3)]:
            for xor in ((0x01, 0x02, 0x80) if pos in attention else (0x01, 0x80)):
                buf = bytearray(data)
                buf[pos] ^= xor
                image.set_crc(buf)
                cases.append(bytes(buf))
        seen = set()
        for case, f in zip(cases, check(c_drivers, cases)):
            got = status(f)
            assert got == image.status(case), name
            if got == 0:
                assert status(f, "init") == 0 and status(f, "fwd1") == 0 and status(f, "fwdN") == 0, name
            seen.add(got)
        assert {0, Status.BAD_ATTENTION, Status.BAD_REF, Status.BAD_LAYER} <= seen, (name, seen)


def _blocks(cols: int) -> int:
    return -(-cols // 32)


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def test_the_arena_holds_the_projections_rows_and_block_scales(c_drivers: Path) -> None:
    """The only quantised rows are the attention's: x [B, d] and the heads' output [B, H·hd], H·hd wider
    than every other row. colibri_model_size() grows by int8 rows [B, max(d, H·hd)] and scales
    [B, max(ceil(d/32), ceil(H·hd/32))] f32 and nothing else; the arena runs and one byte less is
    ARENA_TOO_SMALL (in the ASan build an undersized row buffer would be a read past the arena)."""
    shape = dict(d=40, heads=6, kv_heads=2, hd=14)  # H·hd = 84: 84 int8 columns, 3 blocks
    g = quantize(_projection_model(11, **shape), "q4")
    with_flag = quantize(_projection_model(11, **shape), "q4", int8_blocks=["layers.1"])
    plain, blocks = image.write(g), image.write(with_flag)
    assert _attention_flags(blocks) == [2]
    for f in check(c_drivers, [plain, blocks]):
        assert f["validate"] == "0" and f["short"] == str(int(Status.ARENA_TOO_SMALL)), f
        assert f["init"] == "0" and f["fwd1"] == "0" and f["fwdN"] == "0" and f["sum"] != "nan", f
    B, q = g.max_batch, 6 * 14
    assert colibri.arena_size(blocks) - colibri.arena_size(plain) == _round8(B * q) + _round8(B * _blocks(q) * 4)
