"""Token models (docs/lm.md) on the device under test through the runner (docs/protocol.md, protocol 4):
LM_RESET, FORWARD_TOKENS and GENERATE over the real serial framing, against the host engine.

Like tests/target/test_target_hil.py: the `dut` fixture boots the runner in QEMU mps2-an500 (Cortex-M7) unless
`--colibri-port` names a board. With the reference kernels on both sides the device's logits are the host
engine's bit for bit and GENERATE draws what colibri.LM.generate draws; with the device's optimised
kernels the logits agree within test_target_hil.py's OPTIMISED_RTOL.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

import colibri
from colibri import image
from colibri.target import protocol as P
from colibri.target.device import Device, DeviceError
from colibri.model.format import Status

from helpers import lmmodels
from helpers import tiny_lm_m7
from helpers.target import assert_bits_equal, assert_close_to_reference, model_image

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]

VOCAB, D_MODEL, MAX_SEQ_LEN, MAX_BATCH = 64, 32, 64, 8


def lm_image(seed: int = 0, **kw) -> bytes:
    args = dict(vocab=VOCAB, d=D_MODEL, heads=4, kv_heads=2, hd=8, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    args.update(kw)
    return image.write(lmmodels.token_model(seed, **args))


@pytest.fixture
def lm_dut(dut: Device) -> tuple[Device, bytes]:
    data = lm_image()
    info = dut.load(data)
    assert (info.vocab_size, info.max_seq_len, info.max_batch) == (VOCAB, MAX_SEQ_LEN, MAX_BATCH)
    return dut, data


def _code(call) -> int:
    with pytest.raises(DeviceError) as info:
        call()
    return info.value.code


def _calls(rng: np.random.Generator) -> list[list[int]]:
    """A full prefill chunk, a shorter one, a call of max_batch + 3 (two chunks), then single tokens."""
    calls = [list(rng.integers(0, VOCAB, MAX_BATCH)), list(rng.integers(0, VOCAB, 3)),
             list(rng.integers(0, VOCAB, MAX_BATCH + 3))]
    used = sum(map(len, calls))
    return calls + [[int(rng.integers(0, VOCAB))] for _ in range(MAX_SEQ_LEN - used)]


def test_info_and_arena_hold_the_kv_cache(lm_dut) -> None:
    """INFO (protocol 4) reports the token model's vocabulary, sequence length and KV cache; the arena,
    KV cache included, fits the runner's with room for a model twice as wide."""
    dut, data = lm_dut
    host = colibri.LM(data)
    info = dut.model_info()
    assert info.kv_cache_bytes == host.kv_cache_bytes > 0
    hello = dut.hello()
    assert hello.protocol_version == P.VERSION == 5
    # The arena holds pointers: the 32-bit target needs a little less than the 64-bit host.
    assert 0 < info.arena_size <= host.arena_size <= hello.arena_capacity
    wide = lm_image(1, d=64, hd=16)
    wide_info = dut.load(wide)
    assert wide_info.kv_cache_bytes == colibri.LM(wide).kv_cache_bytes
    assert dut.stats().arena_used == wide_info.arena_size <= hello.arena_capacity


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_tokens_match_the_host_engine_at_every_position(dut: Device, seed: int) -> None:
    data = lm_image(seed, qk_norm="head" if seed else None, bias=bool(seed))
    dut.load(data)
    rng = np.random.default_rng(seed)
    calls = _calls(rng)
    for reference in (True, False):
        assert dut.kernels(reference=reference)[0] == reference
        host = colibri.LM(data, reference_kernels=True)
        dut.lm_reset()
        for i, ids in enumerate(calls):
            got, work = dut.forward_tokens(ids)
            want = host.forward_tokens(ids)
            what = f"seed {seed} call {i} ({len(ids)} tokens), {'reference' if reference else 'optimised'} kernels"
            if reference:
                assert_bits_equal(got, want, what)
            else:
                assert_close_to_reference(got, want, what)
            assert work.count > 0 or work.kind == P.WorkKind.NONE
        assert host.position == MAX_SEQ_LEN


def test_last_row_only(lm_dut) -> None:
    """rows=last answers [1, vocab]: the last token's logits, as the full answer's last row."""
    dut, data = lm_dut
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    ids = list(range(5, 5 + MAX_BATCH + 2))
    got, _ = dut.forward_tokens(ids, last_only=True)
    assert got.shape == (1, VOCAB)
    assert_bits_equal(got, host.forward_tokens(ids)[-1:], "last row")


def test_lm_reset_starts_a_new_sequence(lm_dut) -> None:
    dut, data = lm_dut
    dut.kernels(reference=True)
    ids = [3, 1, 4, 1, 5]
    first, _ = dut.forward_tokens(ids)
    again, _ = dut.forward_tokens(ids)  # later positions: other logits
    assert not np.array_equal(first, again)
    dut.lm_reset()
    assert_bits_equal(dut.forward_tokens(ids)[0], first, "after LM_RESET")


@pytest.mark.parametrize("settings", [
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=10, top_p=0.9, seed=7),
    dict(temperature=1.3, seed=2**63 + 5),
    dict(temperature=0.5, top_k=1, seed=3),
    dict(temperature=2.0, top_p=0.5, seed=11),
], ids=["greedy", "topk-topp", "hot-seed64", "top1", "topp"])
def test_generate_matches_colibri_lm(lm_dut, settings: dict) -> None:
    """GENERATE samples on the target with colibri_lm_sample and the caller's seed: the same ids as the host's
    colibri.LM.generate (reference kernels on both sides), prompts of one chunk, two chunks, one token."""
    dut, data = lm_dut
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    for prompt, new in (([1, 2, 3], 20), (list(range(MAX_BATCH + 5)), MAX_SEQ_LEN - MAX_BATCH - 4), ([9], 1)):
        want = host.generate(prompt, new, **settings)
        assert dut.generate(prompt, new, **settings) == want
        assert len(want) == new
        work = dut.last_generation
        assert work.decode_steps == new - 1
        if work.kind == P.WorkKind.QEMU_INSTRUCTIONS:
            assert work.prefill > 0 and work.sample > 0 and (work.decode > 0) == (new > 1)
    # The sequence GENERATE leaves is the host's too: the next token continues it.
    nxt = int(np.argmax(host.forward_tokens([want[-1]])[0]))
    assert int(np.argmax(dut.forward_tokens([want[-1]])[0][0])) == nxt
    assert dut.generate([5, 6], 0, **settings) == [] == host.generate([5, 6], 0, **settings)


def test_cache_full(lm_dut) -> None:
    """Neither request overwrites the cache: CACHE_FULL (-32) before anything runs, the sequence intact."""
    dut, data = lm_dut
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    filled = [i % VOCAB for i in range(MAX_SEQ_LEN - 2)]
    dut.forward_tokens(filled, last_only=True)
    host.forward_tokens(filled)
    assert _code(lambda: dut.forward_tokens([1, 2, 3])) == Status.CACHE_FULL
    assert_bits_equal(dut.forward_tokens([7, 8])[0], host.forward_tokens([7, 8]), "the last two positions")
    assert _code(lambda: dut.forward_tokens([1])) == Status.CACHE_FULL
    # GENERATE: prompt + max_new_tokens - 1 positions, checked before the reset.
    assert _code(lambda: dut.generate([1, 2], MAX_SEQ_LEN)) == Status.CACHE_FULL
    assert len(dut.generate([1, 2], MAX_SEQ_LEN - 1)) == MAX_SEQ_LEN - 1


def test_bad_tokens_batches_and_samplers(lm_dut) -> None:
    """BAD_TOKEN (-33), BAD_BATCH, BAD_SAMPLER (-35) as the engine reports them, nothing run or appended."""
    dut, data = lm_dut
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    for ids in ([-1], [VOCAB], [1, 2, VOCAB + 100], [2**31 - 1]):
        assert _code(lambda: dut.forward_tokens(ids)) == Status.BAD_TOKEN
        assert _code(lambda: dut.generate(ids, 3)) == Status.BAD_TOKEN
    for n in (0, MAX_BATCH + 1):
        payload = P.FORWARD_TOKENS_REQUEST.pack(n, P.ROWS_ALL) + bytes(4 * n)
        assert _code(lambda: dut.request(P.Type.FORWARD_TOKENS, payload)) == Status.BAD_BATCH
    assert _code(lambda: dut.generate([], 3)) == Status.BAD_BATCH
    for bad in (dict(temperature=-0.5), dict(temperature=float("nan")), dict(temperature=float("inf")),
                dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan"))):
        assert _code(lambda: dut.generate([1], 3, **bad)) == Status.BAD_SAMPLER, bad
    # None of it touched the sequence: position 0 still.
    assert_bits_equal(dut.forward_tokens([4, 2])[0], host.forward_tokens([4, 2]), "after refused requests")


def test_feature_model_and_no_model(dut: Device) -> None:
    """Before any model: NO_MODEL. A feature model answers LM requests with MODEL_KIND (-34), a token model
    answers FORWARD with it."""
    lm_requests = (lambda: dut.request(P.Type.LM_RESET),
                   lambda: dut.request(P.Type.FORWARD_TOKENS, P.FORWARD_TOKENS_REQUEST.pack(1, 0) + bytes(4)),
                   lambda: dut.request(P.Type.GENERATE, P.GENERATE_REQUEST.pack(1, 0.0, 0, 1.0, 0, 1) + bytes(4)))
    for call in lm_requests:
        assert _code(call) == P.ProtocolStatus.NO_MODEL
    dut.load(model_image("top1", "f32"))
    for call in lm_requests:
        assert _code(call) == Status.MODEL_KIND
    with pytest.raises(DeviceError, match="MODEL_KIND"):
        dut.forward_tokens([1])
    dut.load(lm_image())
    assert _code(lambda: dut.request(P.Type.FORWARD, struct.pack("<I", 1) + bytes(4 * VOCAB))) == Status.MODEL_KIND
    dut.forward_tokens([1, 2])


def test_bad_payloads_and_garbage_frames(lm_dut) -> None:
    """Wrong payload sizes and fields are BAD_PAYLOAD; broken frames get their frame status; the runner
    carries on with its sequence untouched."""
    dut, data = lm_dut
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    bad = [
        (P.Type.LM_RESET, b"\x00"),
        (P.Type.FORWARD_TOKENS, b"\x01\x00\x00"),
        (P.Type.FORWARD_TOKENS, P.FORWARD_TOKENS_REQUEST.pack(2, 0) + bytes(4)),  # 2 ids announced, 1 sent
        (P.Type.FORWARD_TOKENS, P.FORWARD_TOKENS_REQUEST.pack(1, 2) + bytes(4)),  # rows neither 0 nor 1
        (P.Type.FORWARD_TOKENS, P.FORWARD_TOKENS_REQUEST.pack(2**30, 0) + bytes(4)),
        (P.Type.GENERATE, bytes(27)),
        (P.Type.GENERATE, P.GENERATE_REQUEST.pack(3, 0.0, 0, 1.0, 0, 2) + bytes(12)),
    ]
    for ptype, payload in bad:
        assert _code(lambda: dut.request(ptype, payload)) == P.ProtocolStatus.BAD_PAYLOAD, (ptype, payload)
    frame = P.encode(P.Packet(P.Type.FORWARD_TOKENS, 9, P.FORWARD_TOKENS_REQUEST.pack(2, 0) + bytes(8)))
    dut.write_raw(frame[: len(frame) // 2] + b"\x00")
    packet = dut.read_packet()
    assert packet.type == P.Type.STATUS and packet.seq == P.UNKNOWN_SEQ
    assert P.status_payload(packet)[0] in (P.ProtocolStatus.FRAME_DECODE, P.ProtocolStatus.FRAME_CRC,
                                           P.ProtocolStatus.FRAME_LENGTH)
    dut.write_raw(b"\x13\x37garbage\xff\x00")
    assert P.status_payload(dut.read_packet())[0] == P.ProtocolStatus.FRAME_DECODE
    assert_bits_equal(dut.forward_tokens([6, 6, 6])[0], host.forward_tokens([6, 6, 6]), "after bad frames")


def test_generation_work_is_deterministic(lm_dut) -> None:
    """QEMU -icount: the instructions of a decode step are the same on every run (not cycles)."""
    dut, _ = lm_dut
    works = []
    for _ in range(2):
        dut.generate([1, 2, 3, 4], 32, temperature=0.7, top_k=20, seed=1)
        works.append(dut.last_generation)
    assert works[0] == works[1]
    if works[0].kind == P.WorkKind.QEMU_INSTRUCTIONS:
        print(f"decode step (d_model {D_MODEL}, vocab {VOCAB}, 2 layers, optimised kernels): "
              f"{works[0].per_decode_step:,.0f} instructions")


def test_large_vocabulary_rows_and_logits_buffer(dut: Device) -> None:
    """A vocabulary whose max_batch rows do not fit a response frame: rows=all of 2 tokens is TOO_LARGE with
    nothing appended, rows=last serves any call; a model whose max_batch x vocab logits pass the runner's
    buffer is answered TOO_LARGE by every LM request, and loads regardless (FORWARD_TOKENS is its only limit)."""
    vocab = 600  # one row is 2,400 bytes: one row per frame
    data = lm_image(2, vocab=vocab, d=16, hd=4)
    dut.load(data)
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    ids = list(range(100, 100 + MAX_BATCH))
    payload = P.FORWARD_TOKENS_REQUEST.pack(2, P.ROWS_ALL) + np.array(ids[:2], "<i4").tobytes()
    assert _code(lambda: dut.request(P.Type.FORWARD_TOKENS, payload)) == P.ProtocolStatus.TOO_LARGE
    last, _ = dut.forward_tokens(ids, last_only=True)
    assert_bits_equal(last, host.forward_tokens(ids)[-1:], "last row of a 600-token vocabulary")
    # Every row: the host sends one token per call, which agrees with max_batch calls within tolerance.
    rows, _ = dut.forward_tokens([5, 6, 7])
    want = host.forward_tokens([5, 6, 7])
    assert rows.shape == (3, vocab)
    np.testing.assert_allclose(rows, want, rtol=0, atol=1e-5 * (1 + np.abs(want).max()))
    huge = lm_image(3, vocab=2100, d=16, hd=4)  # 8 x 2,100 logits > the 16,384-float buffer of mps2-an500
    dut.load(huge)
    hello = dut.hello()
    if hello.board.startswith("mps2-an500"):
        for call in (dut.lm_reset, lambda: dut.forward_tokens([1], last_only=True), lambda: dut.generate([1], 2)):
            assert _code(call) == P.ProtocolStatus.TOO_LARGE


# -- the trained tiny King James model (examples/tiny_lm) -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory, colibri_target):
    if not colibri_target.emulated:
        pytest.skip("boots the emulated board with the model already in flash (tests/tiny_lm_m7.py)")
    return tmp_path_factory.mktemp("tiny_lm_m7")


@pytest.mark.parametrize("dtype", tiny_lm_m7.SLOT_DTYPES + tiny_lm_m7.LINKED_DTYPES)
def test_trained_tiny_lm_generates_the_host_engines_text(tiny_lm_dir, dtype: str) -> None:
    """The trained byte-level Qwen3-MoE (q8 and q4 booted from flash slot A, f16 linked into the firmware): a prefill's
    logits are the host engine's bit for bit with the reference kernels on both sides and within
    OPTIMISED_RTOL with the device's cmsis kernels; greedy GENERATE gives colibri.LM's bytes with either."""
    data = tiny_lm_m7.image(dtype)
    prompt = tiny_lm_m7.prompt_ids()
    new = tiny_lm_m7.NEW_TOKENS
    host = colibri.LM(data, reference_kernels=True)
    want_prefill = host.forward_tokens(prompt)
    host.reset()
    want = host.generate(prompt, new)
    text = bytes(want).decode("ascii")
    assert len(want) == new and text.strip(), text
    with tiny_lm_m7.booted(dtype, tiny_lm_dir) as dev:
        info = dev.model_info()
        assert (info.image_size, info.vocab_size, info.max_seq_len) == (len(data), 256, 256)
        assert info.kv_cache_bytes == host.kv_cache_bytes
        running = dev.slot_info().running
        assert running == ("A" if dtype in tiny_lm_m7.SLOT_DTYPES else "built-in")
        # The arena, KV cache included, as the Cortex-M7 build of the engine sizes it: the NUCLEO's must hold it.
        assert info.arena_size <= tiny_lm_m7.board_mk_capacity("RUNNER_ARENA_CAPACITY"), info.arena_size
        for reference in (True, False):
            dev.kernels(reference=reference)
            what = f"tiny LM {dtype}, {'reference' if reference else 'cmsis'} kernels"
            dev.lm_reset()
            got, work = dev.forward_tokens(prompt)
            (assert_bits_equal if reference else assert_close_to_reference)(got, want_prefill, f"{what}: prefill")
            assert work.count > 0
            # The device's greedy bytes against the host's reference kernels: the cmsis sums differ from the
            # reference ones in the last bits, which could only flip a near-tie of the two best logits.
            ids = dev.generate(prompt, new)
            assert bytes(ids).decode("ascii") == text, what
            assert ids == want, what


def test_trained_tiny_lm_fits_a_nucleo_h743zi(tmp_path) -> None:
    """As boards/nucleo_h743zi is laid out (its built ELF): the q8 image, larger than the RAM model buffer, fits a
    flash slot with its header and runs there in place; the f16 image links into flash bank 1 beside the runner.
    The arena with the KV cache against RUNNER_ARENA_CAPACITY is checked on the device, above."""
    from colibri.target.footprint import elf_footprint
    from colibri.target.slots import SLOT_HEADER_SIZE

    nucleo = tiny_lm_m7.nucleo_layout(tiny_lm_m7.build_runner("nucleo_h743zi"))
    assert nucleo.arena == tiny_lm_m7.board_mk_capacity("RUNNER_ARENA_CAPACITY")
    assert nucleo.model_buffer == tiny_lm_m7.board_mk_capacity("RUNNER_MODEL_CAPACITY")
    q8 = len(tiny_lm_m7.image("q8"))
    assert nucleo.model_buffer < q8 <= nucleo.slot - SLOT_HEADER_SIZE
    assert colibri.LM(tiny_lm_m7.image("q8")).arena_size <= nucleo.arena  # the 64-bit host's arena, an upper bound
    linked = tiny_lm_m7.linked_runner("f16", tmp_path, board="nucleo_h743zi")  # the linker checks bank 1
    assert len(tiny_lm_m7.image("f16")) < elf_footprint(linked).flash <= nucleo.bank1
