"""The C engine on token models (docs/lm.md) against the numpy reference (reference.LMState, sample):
logits at every position over prefill and single-token steps, the sampler bit for bit, every status,
the validator against the Python reader, and the arena's exactness with the KV cache in it."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.model.errors import ImageError, InputError
from colibri.model.format import DType, Status

from helpers import lmmodels
from helpers.lmmodels import CONFIGS, config_graph
from helpers.lm_records import BAD_RECORDS, attention_offset, patched
from helpers.c_drivers import check

# max|engine - reference| <= TOL · (1 + max|reference|) at every position. The reference kernels sum
# as the numpy reference does but for RoPE's angles (the engine's own log/exp/cos/sin, docs/lm.md)
# and numpy's matmul order; the optimised kernels may also fuse and reorder (docs/model-format.md).
TOL_REFERENCE_KERNELS = 2e-6
TOL_OPTIMISED = 5e-6
# An f16 KV cache rounds each key and value: where the two sides' f32 values (within the tolerance
# above) straddle an f16 rounding boundary, one cached value moves by an f16 step (2^-11 relative).
TOL_F16_KV = 1e-3


def _steps(rng: np.random.Generator, vocab: int, max_batch: int, max_seq_len: int) -> list[list[int]]:
    """A full prefill, a shorter chunk, then single tokens up to max_seq_len."""
    calls = [list(rng.integers(0, vocab, max_batch)), list(rng.integers(0, vocab, 3))]
    used = max_batch + 3
    calls += [[int(rng.integers(0, vocab))] for _ in range(max_seq_len - used)]
    return calls


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("reference_kernels", [True, False], ids=["refkernels", "optimised"])
def test_logits_match_the_reference_at_every_position(name: str, reference_kernels: bool) -> None:
    tol = TOL_REFERENCE_KERNELS if reference_kernels else TOL_OPTIMISED
    if CONFIGS[name].get("kv_dtype") == DType.F16:
        tol = TOL_F16_KV
    for seed in range(2):
        g = config_graph(seed, CONFIGS[name])
        data = image.write(g)
        lm, twin = colibri.LM(data, reference_kernels=reference_kernels), reference.LMState(image.read(data))
        rng = np.random.default_rng(seed)
        worst = 0.0
        for ids in _steps(rng, lm.vocab_size, lm.max_batch, lm.max_seq_len):
            got, want = lm.forward_tokens(ids), twin.forward_tokens(ids)
            assert got.shape == (len(ids), lm.vocab_size) and got.dtype == np.float32
            err = float(np.max(np.abs(got - want) / (1 + np.max(np.abs(want), axis=1, keepdims=True))))
            worst = max(worst, err)
        assert lm.position == lm.max_seq_len == 24
        assert worst <= tol, (name, seed, worst)
        print(f"{name} seed {seed} {'reference' if reference_kernels else 'optimised'} kernels: worst {worst:.3g}")


def test_logits_do_not_depend_on_how_the_sequence_is_split() -> None:
    data = image.write(config_graph(3, CONFIGS["f32-gqa"]))
    ids = list(np.random.default_rng(3).integers(0, 40, 20))
    lm = colibri.LM(data, reference_kernels=True)
    whole = lm.forward_tokens(ids)
    lm.reset()
    steps = np.concatenate([lm.forward_tokens(ids[:5]), *[lm.forward_tokens([t]) for t in ids[5:]]])
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def lm_data() -> bytes:
    return image.write(config_graph(6, dict(qk_norm="head", bias=True)))


def test_sampler_is_the_references_bit_for_bit(lm_data: bytes) -> None:
    lm = colibri.LM(lm_data)
    rng = np.random.default_rng(0)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.8, 3, 0.5),
                (2.0, 1, 1.0), (1e-3, 0, 1.0), (1.0, 100, 0.999), (0.5, 40, 0.3)]
    draws = 0
    for trial in range(60):
        logits = (rng.standard_normal(lm.vocab_size) * rng.choice([0.1, 1, 10, 1e4])).astype(np.float32)
        if trial % 5 == 0:  # ties: equal logits rank by the lower index
            logits[rng.integers(0, lm.vocab_size, 10)] = logits.max()
        for temperature, top_k, top_p in settings:
            seed = int(rng.integers(0, 2**64, dtype=np.uint64))
            twin = reference.Rng(seed)
            state = seed
            for _ in range(4):
                token, state = lm._ctx.lm_sample(logits, temperature, top_k, top_p, state)
                assert token == reference.sample(logits, temperature, top_k, top_p, twin), (temperature, top_k, top_p)
                assert state == twin.state
                draws += 1
    assert draws == 60 * len(settings) * 4


def test_generate_is_the_references(lm_data: bytes) -> None:
    lm, twin = colibri.LM(lm_data, reference_kernels=True), reference.LMState(image.read(lm_data))
    prompt = [5, 1, 17, 3, 3, 30, 2, 9, 11, 0]  # longer than max_batch: two chunks
    for kw in (dict(), dict(temperature=0.8, seed=1), dict(temperature=1.0, top_k=5, seed=2),
               dict(temperature=0.9, top_p=0.8, seed=3)):
        got = lm.generate(prompt, 12, **kw)
        assert got == twin.generate(prompt, 12, **kw), kw
        assert len(got) == 12 and lm.position == len(prompt) + 11
    assert lm.generate(prompt, 0) == [] and lm.position == 0


def test_statuses_and_failed_calls_change_nothing(lm_data: bytes) -> None:
    lm = colibri.LM(lm_data, reference_kernels=True)
    first = lm.forward_tokens([1, 2, 3])
    for ids in ([1, 40], [-1], [2**31 - 1]):
        with pytest.raises(InputError, match="outside the vocabulary"):
            lm.forward_tokens(ids)
    assert lm.position == 3
    # Through the binding's raw call: the engine's own statuses, in docs/lm.md's order.
    raw = lm._ctx

    def status(ids, out_len=None):
        ids = np.array(ids, np.int32)
        try:
            raw.lm_forward(ids, np.empty(len(ids) * 40 if out_len is None else out_len, np.float32), len(ids))
        except colibri.runtime._engine.EngineError as e:
            return e.args[0]
        return 0

    assert status([]) == Status.BAD_BATCH
    assert status([1, 40]) == Status.BAD_TOKEN
    assert status([40] * 9) == Status.BAD_BATCH  # the batch before the tokens
    for ids in ([40] * 9, [1, 40]):  # the numpy reference answers the same
        with pytest.raises(colibri.ColibriError) as exc:
            reference.LMState(image.read(lm_data)).forward_tokens(ids)
        assert exc.value.status == status(ids)
    assert status(list(range(9))) == Status.BAD_BATCH
    assert status([1, 2], out_len=79) == Status.BUFFER_SIZE
    assert lm.position == 3
    lm.forward_tokens(list(range(8)) + list(range(8)) + [4, 5, 6, 7, 8])  # 24: full
    assert lm.position == 24
    assert status([1]) == Status.CACHE_FULL
    with pytest.raises(InputError, match="max_seq_len"):
        lm.forward_tokens([1])
    assert lm.position == 24
    lm.reset()
    assert lm.position == 0
    np.testing.assert_array_equal(lm.forward_tokens([1, 2, 3]), first)
    with pytest.raises(InputError, match="max_seq_len"):
        lm.generate([1] * 20, 6)
    with pytest.raises(InputError):
        lm.generate([], 3)


def test_sampler_statuses(lm_data: bytes) -> None:
    lm = colibri.LM(lm_data)
    row = np.zeros(40, np.float32)
    def status(logits, t=1.0, k=0, p=1.0):
        try:
            lm._ctx.lm_sample(np.asarray(logits, np.float32), t, k, p, 1)
        except colibri.runtime._engine.EngineError as e:
            return e.args[0]
        return 0
    assert status(row) == 0
    for t, p in ((-1.0, 1.0), (float("inf"), 1.0), (float("nan"), 1.0), (1.0, 0.0), (1.0, 1.5), (1.0, float("nan"))):
        assert status(row, t, 0, p) == Status.BAD_SAMPLER, (t, p)
    assert status(row[:39]) == Status.BUFFER_SIZE
    nan, inf = row.copy(), row.copy()
    nan[7], inf[3] = np.nan, np.inf
    assert status(nan, 0.0) == Status.NAN_LOGITS and status(nan) == Status.NAN_LOGITS
    assert status(inf) == Status.NAN_LOGITS and status(inf, 0.0) == 0  # greedy takes ±inf as values
    assert lm._ctx.lm_sample(inf, 0.0, 0, 1.0, 5) == (3, 5)  # greedy: no draw


def test_model_kind_both_ways(lm_data: bytes, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="colibri.LM"):
        colibri.Model(lm_data)
    ctx = colibri.runtime._engine.Context(lm_data)
    with pytest.raises(colibri.runtime._engine.EngineError) as exc:
        ctx.forward(np.zeros(40, np.float32), np.zeros(40, np.float32), 1)
    assert exc.value.args[0] == Status.MODEL_KIND
    import torch
    from colibri.frontends.exporter import export
    torch.manual_seed(0)
    feature = export(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)), None).image
    with pytest.raises(InputError, match="colibri.Model"):
        colibri.LM(feature)
    fctx = colibri.runtime._engine.Context(feature)
    for call in (fctx.lm_reset, fctx.lm_position):
        with pytest.raises(colibri.runtime._engine.EngineError) as exc:
            call()
        assert exc.value.args[0] == Status.MODEL_KIND


def test_info_and_kv_cache_bytes() -> None:
    for kw, elem in ((dict(), 4), (dict(kv_dtype=DType.F16), 2)):
        lm = colibri.LM(image.write(lmmodels.token_model(1, **kw)))
        # 2 layers x K and V x 24 positions x KVH·hd = 2·6
        assert lm.kv_cache_bytes == 2 * 2 * 24 * 12 * elem
        assert lm.vocab_size == 40 and lm.max_seq_len == 24 and lm.info["vocab_size"] == 40
        assert lm.arena_size > lm.kv_cache_bytes


def test_validator_agrees_with_the_python_reader(lm_data: bytes) -> None:
    assert colibri.runtime._engine.validate(lm_data) == 0 == image.status(lm_data)
    off = attention_offset(lm_data)
    for what, at, fmt, value in BAD_RECORDS:
        bad = patched(lm_data, off + at, fmt, value)
        assert colibri.runtime._engine.validate(bad) == image.status(bad) == Status.BAD_ATTENTION, what
    # Every single-byte change of the metadata: the same status from both readers.
    meta = struct.unpack_from("<I", lm_data, 64)[0]
    for pos in range(0, meta, 3):
        for xor in (0x01, 0x80):
            buf = bytearray(lm_data)
            buf[pos] ^= xor
            if pos >= 12:  # past the CRC field: the header CRC made right, so the change itself is checked
                image.set_crc(buf)
            assert colibri.runtime._engine.validate(bytes(buf)) == image.status(bytes(buf)), (pos, xor)


def test_arena_is_exact_with_the_kv_cache(c_drivers: Path) -> None:
    images = [image.write(config_graph(s, kw)) for s, kw in enumerate(CONFIGS.values())]
    for data, f in zip(images, check(c_drivers, images)):
        assert f["validate"] == "0" and f["short"] == str(int(Status.ARENA_TOO_SMALL)), f
        assert f["init"] == "0" and f["fwd1"] == "0" and f["fwdN"] == "0" and f["sum"] != "nan", f


def test_a_path_is_mapped_and_its_payloads_verified(lm_data: bytes, tmp_path: Path) -> None:
    """LM(path) maps the file as Model(path) does (no copy); the default verify="on_use" checks at open
    the payloads every token reads (the head here), "full" every payload, "none" leaves it to
    LM.file.verify()."""
    path = tmp_path / "lm.colibri"
    path.write_bytes(lm_data)
    ids = [1, 5, 2, 7]
    want = colibri.LM(lm_data).forward_tokens(ids)
    mapped = colibri.LM(path)
    assert mapped.file is not None and len(mapped.file) == len(lm_data)
    np.testing.assert_array_equal(mapped.forward_tokens(ids), want)
    copied = colibri.LM(path, copy=True)
    assert copied.file is None
    np.testing.assert_array_equal(copied.forward_tokens(ids), want)

    bad = bytearray(lm_data)
    bad[-1] ^= 0x40  # the last tensor's payload: the structure stays valid
    path.write_bytes(bad)
    with pytest.raises(ImageError) as exc:
        colibri.LM(path)
    assert exc.value.status == Status.BAD_PAYLOAD_CRC
    unchecked = colibri.LM(path, verify="none")
    with pytest.raises(ImageError) as exc:
        unchecked.file.verify()
    assert exc.value.status == Status.BAD_PAYLOAD_CRC
    with pytest.raises(ImageError) as exc:
        colibri.LM(path, verify="full")
    assert exc.value.status == Status.BAD_PAYLOAD_CRC
    with pytest.raises(ValueError, match="lock applies to a mapped file"):
        colibri.LM(lm_data, lock="all")


@pytest.mark.parametrize("kw", [dict(tied=True, qk_norm="head", kv_dtype=DType.F16), dict(bias=True)])
def test_cli_info_describes_a_token_model(kw: dict) -> None:
    """`colibri info` on a token model: the embedding and attention rows carry their weights, a tied head
    counts none of its own, and the totals are the C engine's (parameters, arena, KV cache)."""
    from colibri.cli.info import describe

    data = image.write(lmmodels.token_model(3, **kw))
    d = describe(data)
    lm = colibri.LM(data)
    assert d["parameters"] == lm.info["num_parameters"]
    assert d["kv_cache_bytes"] == lm.kv_cache_bytes and d["arena_bytes"] == lm.arena_size
    assert d["vocab_size"] == 40
    ops = [row["op"] for row in d["layers"]]
    assert ops[0] == "Embedding" and d["layers"][0]["params"] == 40 * 16
    attention = [row for row in d["layers"] if row["op"] == "Attention"]
    assert len(attention) == 2 and all(row["heads"] == 4 and row["kv_heads"] == 2 for row in attention)
    assert sum(row["kv_cache_bytes"] for row in attention) == lm.kv_cache_bytes
    head = d["layers"][-1]
    assert head["op"] == "Linear" and head["tied"] == kw.get("tied", False)
