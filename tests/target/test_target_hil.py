"""Hardware-in-the-loop: the runner firmware on a device under test, over its serial line.

The `dut` fixture (colibri.pytest_plugin) boots the runner in QEMU mps2-an500
by default; `pytest --colibri-port /dev/ttyACM0` runs these same tests on a
board. Nothing here assumes QEMU.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

import colibri
from colibri import image
from colibri import nn as cnn
from colibri.target import protocol as P
from colibri.target.device import Device, DeviceError
from colibri.frontends.exporter import export
from colibri.model.format import Status
from helpers.nonfinite_inputs import nonfinite_rows

from helpers.target import DTYPES, MAX_BATCH, assert_bits_equal, assert_close_to_reference, model_image

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]


def assert_matches_host(dut: Device, data: bytes, seed: int = 0) -> None:
    """With the reference kernels on both sides (KERNELS request; colibri.Model(reference_kernels=True)),
    device output == host engine output bit for bit: the same IEEE arithmetic in the same order
    (-ffp-contract=off everywhere) and the engine's own exp/erf/tanh instead of two different libms.
    With the device's optimised kernels (its default), within the kernels' tolerance of that."""
    host = colibri.Model(data, reference_kernels=True)
    assert host.kernels == "reference"
    rng = np.random.default_rng(seed)
    for batch in (1, MAX_BATCH):
        # Wide inputs reach the tails of exp, erf and tanh as well as their middles.
        x = (rng.standard_normal((batch, host.input_size)) * (4.0 if batch > 1 else 1.0)).astype(np.float32)
        want = host.forward(x)
        assert dut.kernels(reference=True)[0]
        y, work = dut.forward(x)
        assert_bits_equal(y, want, f"batch {batch}, reference kernels")
        assert work.count > 0 or work.kind == P.WorkKind.NONE
        assert not dut.kernels(reference=False)[0]
        y, work = dut.forward(x)
        assert_close_to_reference(y, want, f"batch {batch}, optimised kernels")
        assert work.count > 0 or work.kind == P.WorkKind.NONE


def test_hello(dut: Device) -> None:
    hello = dut.hello()
    assert hello.protocol_version == P.VERSION and hello.max_payload == P.MAX_PAYLOAD
    assert hello.engine_version == colibri.version()
    assert hello.model_capacity >= 64 * 1024 and hello.arena_capacity >= 16 * 1024
    assert hello.board
    if hello.work_kind == P.WorkKind.QEMU_INSTRUCTIONS:
        assert f"icount_shift={colibri.target.qemu.ICOUNT_SHIFT}" in hello.build_flags


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", cnn.ROUTINGS)
def test_device_matches_host_engine(dut: Device, routing: str, dtype: str) -> None:
    data = model_image(routing, dtype)
    info = dut.load(data)
    assert (info.input_size, info.output_size, info.max_batch) == (12, 6, MAX_BATCH)
    # The arena holds pointers: a 32-bit target needs a little less than the 64-bit host.
    assert info.image_size == len(data) and 0 < info.arena_size <= colibri.Model(data).arena_size
    assert_matches_host(dut, data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_inputs_match_host_bits(dut: Device, dtype: str) -> None:
    """NaN, ±inf, FLT_MAX-scale and subnormal inputs, alone at several positions and as whole rows:
    with the reference kernels the device answers what the host engine answers, NaN for NaN, bit for
    bit (every routing mode); with its optimised kernels, NaN exactly where the reference has NaN."""
    x = nonfinite_rows(11, 12, (0, 5, 11))
    for routing in cnn.ROUTINGS:
        data = model_image(routing, dtype)
        dut.load(data)
        host = colibri.Model(data, reference_kernels=True)
        for start in range(0, len(x), MAX_BATCH):
            batch = x[start:start + MAX_BATCH]
            want = host.forward(batch)
            for reference in (True, False):
                dut.kernels(reference=reference)
                y, _ = dut.forward(batch)
                what = f"{routing} rows {start}.., {'reference' if reference else 'optimised'} kernels"
                if reference:
                    assert_bits_equal(y, want, what)
                else:
                    assert (np.isnan(y) == np.isnan(want)).all(), f"{what}: NaN pattern differs"
                # A NaN input reaches every output of its row (the first layer mixes it into all).
                assert np.isnan(y[np.isnan(batch).any(axis=1)]).all(), f"{what}: a NaN input gave a number"


def test_quickstart_model_bit_for_bit(dut: Device) -> None:
    """README "Measured": the quickstart model on the Cortex-M7 equals the host engine bit for bit,
    f32 and q8, at batch 1 and a full batch, both with the reference kernels; the device's optimised
    kernels agree within their tolerance."""
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(examples))
    try:
        from quickstart import build_model
    finally:
        sys.path.remove(str(examples))
    for dtype in ("f32", "q8"):
        data = export(build_model(), None, max_batch=8, dtype=dtype).image
        dut.load(data)
        host = colibri.Model(data, reference_kernels=True)
        rng = np.random.default_rng(5)
        for batch in (1, 8):
            x = rng.standard_normal((batch, host.input_size)).astype(np.float32)
            want = host.forward(x)
            dut.kernels(reference=True)
            assert_bits_equal(dut.forward(x)[0], want, f"quickstart {dtype} batch {batch}")
            dut.kernels(reference=False)
            assert_close_to_reference(dut.forward(x)[0], want, f"quickstart {dtype} batch {batch}, optimised")


def test_kernels_request(dut: Device) -> None:
    """The runner runs the build's optimised kernels by default (cmsis on the Cortex-M7), KERNELS switches
    the running model and every model loaded after it, and refuses what it does not know."""
    assert dut.kernels() == (False, "")  # no model yet
    data = model_image("top1", "f32")
    dut.load(data)
    reference, name = dut.kernels()
    assert not reference and name != "reference"
    if dut.hello().board.startswith("mps2-an500"):
        assert name.startswith("cmsis")
    assert dut.kernels(reference=True) == (True, "reference")
    dut.load(data)  # a new model keeps the selection
    assert dut.kernels() == (True, "reference")
    assert dut.kernels(reference=False) == (False, name)
    for bad in (struct.pack("<I", 2), b"\x01"):
        with pytest.raises(DeviceError) as info:
            dut.request(P.Type.KERNELS, bad)
        assert info.value.code == P.ProtocolStatus.BAD_PAYLOAD
    _still_serves(dut)


def test_work_is_deterministic(dut: Device) -> None:
    data = model_image("topk_softmax", "q8")
    dut.load(data)
    x = np.random.default_rng(3).standard_normal((MAX_BATCH, 12)).astype(np.float32)
    counts = {dut.forward(x)[1].count for _ in range(3)}
    assert len(counts) == 1, counts


def _frame_status(dut: Device) -> tuple[int, int]:
    """(seq, code) of the STATUS frame the device sends next."""
    packet = dut.read_packet()
    assert packet.type == P.Type.STATUS
    return packet.seq, P.status_payload(packet)[0]


def _still_serves(dut: Device) -> None:
    assert dut.hello().protocol_version == P.VERSION


def test_garbage_gets_a_status_and_resync(dut: Device) -> None:
    dut.write_raw(b"\x13\x37garbage\xff\xfe\x01\x00")
    assert _frame_status(dut) == (P.UNKNOWN_SEQ, P.ProtocolStatus.FRAME_DECODE)
    _still_serves(dut)


def test_nonzero_flags_byte_is_refused(dut: Device) -> None:
    """docs/protocol.md: the flags byte is zero. A request that sets it is refused (FRAME_DECODE,
    answered with its seq) and not acted on, so a later protocol can give the byte a meaning."""
    data = model_image("top1", "f32")
    dut.load(data)
    for flags in (0x01, 0x80, 0xFF):
        dut.write_raw(P.encode(P.Packet(P.Type.LM_RESET if flags == 0x80 else P.Type.HELLO, 21, b"", flags)))
        assert _frame_status(dut) == (21, P.ProtocolStatus.FRAME_DECODE)
    dut.write_raw(P.encode(P.Packet(P.Type.LOAD_BEGIN, 22, struct.pack("<II", 64, 0), 0x02)))
    assert _frame_status(dut) == (22, P.ProtocolStatus.FRAME_DECODE)
    assert dut.model_info().image_size == len(data)  # the refused LOAD_BEGIN did not drop the model
    _still_serves(dut)


def test_bad_crc(dut: Device) -> None:
    body = P.HEADER.pack(P.Type.HELLO, 0, 7, 0)
    dut.write_raw(P.cobs.encode(body + struct.pack("<I", zlib.crc32(body) ^ 1)) + b"\x00")
    assert _frame_status(dut) == (P.UNKNOWN_SEQ, P.ProtocolStatus.FRAME_CRC)
    _still_serves(dut)


def test_truncated_frame(dut: Device) -> None:
    frame = P.encode(P.Packet(P.Type.INFO, 9, b"\x01\x02\x03\x04"))
    dut.write_raw(frame[: len(frame) // 2] + b"\x00")
    seq, code = _frame_status(dut)
    assert seq == P.UNKNOWN_SEQ and code in (P.ProtocolStatus.FRAME_DECODE, P.ProtocolStatus.FRAME_CRC,
                                             P.ProtocolStatus.FRAME_LENGTH)
    _still_serves(dut)


def test_length_field_lies(dut: Device) -> None:
    body = P.HEADER.pack(P.Type.HELLO, 0, 5, 1000)
    dut.write_raw(P.cobs.encode(body + struct.pack("<I", zlib.crc32(body))) + b"\x00")
    assert _frame_status(dut) == (P.UNKNOWN_SEQ, P.ProtocolStatus.FRAME_LENGTH)
    _still_serves(dut)


def test_oversized_frame(dut: Device) -> None:
    dut.write_raw(bytes([0x55]) * (P.MAX_PAYLOAD + 200) + b"\x00")
    assert _frame_status(dut) == (P.UNKNOWN_SEQ, P.ProtocolStatus.FRAME_TOO_LONG)
    _still_serves(dut)


def test_oversized_payload_request(dut: Device) -> None:
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.LOAD_CHUNK, bytes(P.MAX_PAYLOAD + 1))
    assert info.value.code in (P.ProtocolStatus.FRAME_TOO_LONG, P.ProtocolStatus.BAD_PAYLOAD)
    _still_serves(dut)


def test_unknown_type_and_bad_payload(dut: Device) -> None:
    with pytest.raises(DeviceError) as info:
        dut.request(0x66)
    assert info.value.code == P.ProtocolStatus.UNKNOWN_TYPE
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.LOAD_BEGIN, b"\x01")
    assert info.value.code == P.ProtocolStatus.BAD_PAYLOAD
    _still_serves(dut)


def test_forward_before_load(dut: Device) -> None:
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.FORWARD, struct.pack("<I", 1) + bytes(48))
    assert info.value.code == P.ProtocolStatus.NO_MODEL
    _still_serves(dut)


def test_image_with_bad_transfer_crc(dut: Device) -> None:
    data = model_image("top1", "f32")
    dut.request(P.Type.LOAD_BEGIN, struct.pack("<II", len(data), zlib.crc32(data) ^ 0x5A5A))
    for off in range(0, len(data), 2048):
        dut.request(P.Type.LOAD_CHUNK, struct.pack("<I", off) + data[off : off + 2048])
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.LOAD_END)
    assert info.value.code == P.ProtocolStatus.LOAD_CRC
    dut.load(data)  # the next good upload works
    assert_matches_host(dut, data)


def test_image_the_engine_refuses(dut: Device) -> None:
    bad = bytearray(model_image("dense", "f32"))
    bad[200] ^= 0x40  # inside the tables: the image's own CRC no longer matches
    with pytest.raises(DeviceError) as info:
        dut.load(bytes(bad))
    assert info.value.code == Status.BAD_CRC
    image.set_crc(bad)  # now structurally wrong but with a valid CRC
    with pytest.raises(DeviceError) as info:
        dut.load(bytes(bad))
    assert info.value.code in {int(s) for s in Status if s < 0}
    with pytest.raises(DeviceError) as info:
        dut.model_info()
    assert info.value.code == P.ProtocolStatus.NO_MODEL


def test_chunks_out_of_order_and_too_large(dut: Device) -> None:
    data = model_image("top1", "f32")
    dut.request(P.Type.LOAD_BEGIN, struct.pack("<II", len(data), zlib.crc32(data)))
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.LOAD_CHUNK, struct.pack("<I", 100) + data[100:200])
    assert info.value.code == P.ProtocolStatus.LOAD_SEQUENCE
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.LOAD_BEGIN, struct.pack("<II", dut.hello().model_capacity + 1, 0))
    assert info.value.code == P.ProtocolStatus.TOO_LARGE
    _still_serves(dut)


def test_bad_batch(dut: Device) -> None:
    data = model_image("softmax_topk", "f32")
    dut.load(data)
    for batch in (0, MAX_BATCH + 1):
        with pytest.raises(DeviceError) as info:
            dut.request(P.Type.FORWARD, struct.pack("<I", batch) + bytes(4 * 12 * batch))
        assert info.value.code == Status.BAD_BATCH
    with pytest.raises(DeviceError) as info:
        dut.request(P.Type.FORWARD, struct.pack("<I", 2) + bytes(4 * 12))
    assert info.value.code == P.ProtocolStatus.BAD_PAYLOAD
    assert_matches_host(dut, data)


def test_stats(dut: Device) -> None:
    data = model_image("topk_softmax", "q8-int8-act")
    info = dut.load(data)
    dut.forward(np.ones((MAX_BATCH, 12), np.float32))
    stats = dut.stats()
    assert 0 < stats.stack_used < stats.stack_size
    assert stats.arena_used == info.arena_size <= stats.arena_capacity


def test_reset(dut: Device, colibri_target) -> None:
    dut.load(model_image("top1", "f32"))
    dut.reset()
    fresh = colibri_target.after_reset(dut)
    with pytest.raises(DeviceError) as info:
        fresh.model_info()
    assert info.value.code == P.ProtocolStatus.NO_MODEL  # the model lived in RAM
    _still_serves(fresh)
    fresh.close()


def test_fault_handler_reports_and_exits(colibri_target, dut: Device) -> None:
    """A fault is reported over the UART as one line and ends the board with a non-zero status (QEMU build)."""
    if not colibri_target.emulated:
        pytest.skip("FAULT is a debug request of the emulated board only; a real board would reset")
    for kind, name in ((0, "BusFault"), (1, "UsageFault")):
        dev = dut if kind == 0 else colibri_target.connect()
        dev.send(P.Type.FAULT, struct.pack("<I", kind))
        with pytest.raises(DeviceError, match=rf"device fault: FAULT {name} .*pc=0x[0-9a-f]+ .*cfsr=0x[0-9a-f]+"):
            dev.read_packet()
        assert colibri_target.qemu.wait(10) == 3
        colibri_target.disconnect(dev)
