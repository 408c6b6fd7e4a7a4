"""A/B model slots in flash over the serial line: UPDATE_BEGIN/CHUNK/COMMIT and SLOT_INFO.

Runs on the `dut` (QEMU mps2-an500 by default, where the flash is emulated in
RAM; `--colibri-port` for a board). Nothing assumes the slots start empty:
every expectation is relative to the SLOT_INFO read first. A "power cycle"
keeps flash and loses RAM (colibri_target.power_cycle).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image as cimage
from colibri.target import protocol as P
from colibri.target import slots
from colibri.target.device import Device, DeviceError

from helpers.slots import FAKE_PYOCD, inputs, other, runs, small_model

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]


def test_models_differ() -> None:
    a, b = (colibri.Model(small_model(s)).forward(inputs()) for s in (1, 2))
    assert np.abs(a - b).max() > 1e-2  # so "runs the old one" and "runs the new one" are told apart
    assert len(small_model(1)) % 32 != 0  # the last flash word is a padded partial one


def test_slot_info(dut: Device) -> None:
    info = dut.slot_info()
    assert info.program_size == slots.SLOT_HEADER_SIZE == 32
    assert info.slot_size % info.sector_size == 0 and info.capacity == info.slot_size - 32
    assert info.slots[1].address == info.slots[0].address + info.slot_size
    assert not info.updating
    for slot in info.slots:
        assert slot.valid == (slot.state == P.SlotState.VALID)
    assert info.running == info.active  # at reset the active slot runs, or nothing does
    if info.active is None:
        with pytest.raises(DeviceError) as exc:
            dut.model_info()
        assert exc.value.code == P.ProtocolStatus.NO_MODEL


def test_update_switches_and_survives_power_cycle(dut: Device, colibri_target) -> None:
    before = dut.slot_info()
    data = small_model(1)
    after = dut.update(data)
    target = other(before.running) if before.running in ("A", "B") else other(before.active or "B")
    newest = max((s.sequence for s in before.slots if s.valid), default=0)
    assert after.running == after.active == target
    new = after[target]
    assert new.valid and new.sequence == newest + 1
    assert (new.image_size, new.image_crc32) == (len(data), zlib.crc32(data))
    assert runs(dut, data)
    assert dut.model_info().image_size == len(data)

    dut = colibri_target.power_cycle(dut)
    try:
        again = dut.slot_info()
        assert again.running == again.active == target and again[target] == new
        assert runs(dut, data)
    finally:
        colibri_target.disconnect(dut)


def test_second_update_goes_to_the_other_slot(dut: Device, colibri_target) -> None:
    first, second = small_model(1), small_model(2)
    one = dut.update(first)
    two = dut.update(second)
    assert two.running == two.active == other(one.running)
    assert two[two.running].sequence == one[one.running].sequence + 1
    assert two[one.running] == one[one.running]  # the previous model is still there, intact
    assert runs(dut, second)
    three = dut.update(first)  # and back again
    assert three.running == one.running and three[three.running].sequence == two[two.running].sequence + 1
    assert runs(dut, first)

    dut = colibri_target.power_cycle(dut)
    try:
        assert dut.slot_info().running == one.running
        assert runs(dut, first)
    finally:
        colibri_target.disconnect(dut)


def test_wrong_crc_leaves_the_old_model(dut: Device, colibri_target) -> None:
    old, new = small_model(1), small_model(2)
    base = dut.update(old)
    with pytest.raises(DeviceError) as exc:
        dut.update(new, crc=zlib.crc32(new) ^ 0x5A5A)
    assert exc.value.code == P.ProtocolStatus.LOAD_CRC
    info = dut.slot_info()
    assert info.running == info.active == base.running and info[base.running] == base[base.running]
    assert not info[other(base.running)].valid  # erased and programmed, never committed
    assert runs(dut, old)

    dut = colibri_target.power_cycle(dut)
    try:
        assert dut.slot_info().running == base.running
        assert runs(dut, old)
    finally:
        colibri_target.disconnect(dut)


def test_image_the_engine_refuses_is_never_committed(dut: Device) -> None:
    old = small_model(1)
    base = dut.update(old)
    bad = bytearray(small_model(2))
    bad[100] ^= 0x40
    cimage.set_crc(bad)  # the transfer CRC is right; the image itself is not a model the engine runs
    with pytest.raises(DeviceError) as exc:
        dut.update(bytes(bad))
    assert -100 < exc.value.code < 0  # the engine's own status
    info = dut.slot_info()
    assert info.running == info.active == base.running and not info[other(base.running)].valid
    assert runs(dut, old)


def test_update_refusals(dut: Device) -> None:
    data = small_model(1)
    info = dut.slot_info()

    def refused(ptype: int, payload: bytes = b"") -> int:
        with pytest.raises(DeviceError) as exc:
            dut.request(ptype, payload)
        return exc.value.code

    assert refused(P.Type.UPDATE_CHUNK, struct.pack("<I", 0) + data[:64]) == P.ProtocolStatus.LOAD_SEQUENCE
    assert refused(P.Type.UPDATE_COMMIT) == P.ProtocolStatus.LOAD_SEQUENCE
    assert refused(P.Type.UPDATE_BEGIN, struct.pack("<II", info.capacity + 1, 0)) == P.ProtocolStatus.TOO_LARGE
    assert refused(P.Type.UPDATE_BEGIN, b"\x01") == P.ProtocolStatus.BAD_PAYLOAD
    assert refused(P.Type.SLOT_INFO, b"\x01") == P.ProtocolStatus.BAD_PAYLOAD

    dut.request(P.Type.UPDATE_BEGIN, struct.pack("<II", len(data), zlib.crc32(data)))
    assert dut.slot_info().updating
    assert refused(P.Type.UPDATE_CHUNK, struct.pack("<I", 32) + data[32:64]) == P.ProtocolStatus.LOAD_SEQUENCE
    dut.request(P.Type.UPDATE_CHUNK, struct.pack("<I", 0) + data[:100])
    assert refused(P.Type.UPDATE_COMMIT) == P.ProtocolStatus.LOAD_SEQUENCE  # early: the update stays open
    end = len(data) - 50
    for off in range(100, end, 1000):  # odd chunk sizes: flash words straddle chunks
        dut.request(P.Type.UPDATE_CHUNK, struct.pack("<I", off) + data[off : min(off + 1000, end)])
    assert refused(P.Type.UPDATE_CHUNK, struct.pack("<I", end) + bytes(51)) == P.ProtocolStatus.LOAD_SEQUENCE
    dut.request(P.Type.UPDATE_CHUNK, struct.pack("<I", end) + data[end:])
    dut.request(P.Type.UPDATE_COMMIT)
    now = dut.slot_info()
    assert not now.updating and now.running in ("A", "B") and now[now.running].image_crc32 == zlib.crc32(data)
    assert runs(dut, data)


def test_ram_load_and_slots_coexist(dut: Device, colibri_target) -> None:
    slot_model, ram_model = small_model(1), small_model(2)
    base = dut.update(slot_model)
    dut.load(ram_model)  # the RAM path: runs until reset, flash untouched
    info = dut.slot_info()
    assert info.running == "RAM" and info.active == base.running
    assert runs(dut, ram_model)
    # An update must not touch the active slot, whatever runs.
    after = dut.update(small_model(3))
    assert after.running == after.active == other(base.running)
    assert after[base.running] == base[base.running]
    dut = colibri_target.power_cycle(dut)
    try:
        assert dut.slot_info().running == other(base.running)
        assert runs(dut, small_model(3))
    finally:
        colibri_target.disconnect(dut)


# -- colibri flash -------------------------------------------------------------------------------------------

COLIBRI = str(Path(sys.executable).parent / "colibri")


def _colibri(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([COLIBRI, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def model_files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.clb", tmp_path / "b.clb"
    a.write_bytes(small_model(1))
    b.write_bytes(small_model(2))
    return a, b


def test_cli_flash_to_qemu_keeps_slots_between_runs(model_files, tmp_path: Path) -> None:
    flash = tmp_path / "flash.bin"
    lines = []
    for model in (*model_files, model_files[0]):
        r = _colibri("flash", str(model), "--qemu-flash", str(flash))
        assert r.returncode == 0, r.stdout + r.stderr
        lines.append(r.stdout.strip())
    assert [line.count("\n") for line in lines] == [0, 0, 0]  # one line each
    for line, (slot, seq, model) in zip(lines, [("A", 1, model_files[0]), ("B", 2, model_files[1]),
                                                ("A", 3, model_files[0])]):
        assert line.startswith(f"flashed {model.name} to slot {slot} (sequence {seq}, 0x")
        assert f"{model.stat().st_size:,} bytes in " in line and "verified, running" in line
    header = slots.parse_slot_header(flash.read_bytes()[:32])  # slot A of the saved emulated flash
    assert header == slots.parse_slot_header(slots.slot_header(small_model(1), 3))


def test_cli_flash_errors_are_one_line(tmp_path: Path, model_files) -> None:
    junk = tmp_path / "junk.clb"
    junk.write_bytes(b"not a model")
    for args in (["flash", str(junk)], ["flash", str(model_files[0]), "--port", "socket://127.0.0.1:9"]):
        r = _colibri(*args)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.startswith("colibri: error: ") and r.stderr.count("\n") == 1, r.stderr


def test_cli_flash_probe_without_pyocd(model_files) -> None:
    import shutil

    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    if shutil.which("pyocd", path=env["PATH"]):
        pytest.skip("pyocd is installed here")
    r = _colibri("flash", str(model_files[0]), "--probe", env=env)
    assert r.returncode == 1 and "pyOCD" in r.stderr and "not installed" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("probe", ["present", "absent"])
def test_cli_flash_probe_runs_pyocd(model_files, tmp_path: Path, probe: str) -> None:
    """A stand-in `pyocd` records what colibri asks of it (no probe can be attached here)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "pyocd.log"
    bin_dir.mkdir()
    fail = "" if probe == "present" else 'echo "0000183:ERROR:load_cmd:No connected debug probes" >&2; exit 1'
    (bin_dir / "pyocd").write_text(FAKE_PYOCD.format(log=log, fail=fail))
    (bin_dir / "pyocd").chmod(0o755)
    # A stand-in firmware file carrying runner.c's format record: it reads the q8 model's format (v2).
    from colibri.model import format as F
    from colibri.target.pack import FORMATS_RECORD, FORMATS_TAG

    fw = tmp_path / "runner.bin"
    fw.write_bytes(b"\x00" * 64 + FORMATS_RECORD.pack(FORMATS_TAG, F.MIN_READ_VERSION, F.MAX_READ_VERSION))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = _colibri("flash", str(model_files[1]), "--probe", "--firmware", str(fw), "--slot", "B", "--sequence", "7",
                 env=env)
    if probe == "absent":
        assert r.returncode == 1 and "no debug probe found" in r.stderr and r.stderr.count("\n") == 1
        return
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "erase -t stm32h743zitx -W --sector 0x8100000"  # slot A's header sector: B must win
    assert calls[1] == f"flash -t stm32h743zitx -W --base-address 0x08000000 {fw}"
    assert calls[2].startswith("flash -t stm32h743zitx -W --base-address 0x8180000 ")
    written = Path(f"{log}.3").read_bytes()
    assert written == slots.slot_image(small_model(2), 7)
    assert r.stdout.startswith("programmed slot B at 0x08180000") and r.stdout.count("\n") == 1


def test_host_built_slot_boots(colibri_target, tmp_path: Path) -> None:
    """A slot image built on the host (colibri.target.slots, as colibri pack writes it), put into the emulated
    flash with QEMU's loader before reset, is found valid by the firmware at boot and run in place."""
    if not colibri_target.emulated:
        pytest.skip("writes the emulated flash directly")
    from colibri.target.qemu import FLASH_BASE, FLASH_SIZE

    layout = slots.LAYOUTS["mps2_an500"]
    data = small_model(2)
    flash = bytearray(b"\xff" * FLASH_SIZE)  # erased, as a new part
    off = layout.slot_b - FLASH_BASE
    flash[off : off + len(data) + 32] = slots.slot_image(data, 5)
    dump = tmp_path / "flash.bin"
    dump.write_bytes(bytes(flash))
    dut = colibri_target.connect(flash=dump)
    try:
        info = dut.slot_info()
        assert info.slots[0].state == P.SlotState.EMPTY
        assert info.running == info.active == "B" and info["B"].sequence == 5 and info["B"].address == layout.slot_b
        assert runs(dut, data)
        assert dut.update(small_model(1)).running == "A"  # into the erased slot, sequence 6
        assert dut.slot_info()["A"].sequence == 6
    finally:
        colibri_target.disconnect(dut)
