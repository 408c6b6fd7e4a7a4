"""Power loss during a model update, deterministically, on the emulated board.

The mps2-an500 runner's emulated flash can cut the power after a chosen number
of flash operations (POWER_CUT_AFTER n, mode, tear; board.h), either cleanly
between two operations (mode 0) or half way through the n-th (mode 1: a torn
sector erase or a torn word program). For each cut point:

 1. boot QEMU with a prepared flash dump (a committed "old" model), arm the
    cut, start the update to a new model; the firmware reports the cut on
    QEMU's stderr (semihosting) and then stops dead, never answering;
 2. pause the VM over QMP, save the emulated flash (pmemsave), end QEMU;
 3. boot a new QEMU with that flash (-device loader) and check that it answers,
    runs exactly the model predicted for that cut point (the old one for any
    cut before the header word is complete, the new one after), that SLOT_INFO
    agrees, and that a fresh update from there works.

An update of an image of S bytes is 1 + ceil(S / 32) + 1 flash operations here:
one sector erase (S + 32 < 128 KiB), ceil(S / 32) word programs, the header
word (the commit).
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from colibri.target import protocol as P
from colibri.target import slots
from colibri.target.device import Device, Slot
from colibri.target.pytest_plugin import build_runner
from colibri.target.qemu import POWER_CUT, Qemu

from helpers.slots import other, runs, small_model

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]

NEW = 2  # small_model seed of the update's image


@dataclass
class Start:
    """A prepared flash state that the update starts from."""

    dump: Path
    old: bytes  # the model that runs before the update
    running: str  # its slot
    target: str  # where the update goes
    target_before: Slot  # what that slot held
    sequence: int  # the new model's sequence once committed


@pytest.fixture(scope="module")
def firmware(colibri_target) -> Path:
    if not colibri_target.emulated:
        pytest.skip("power cuts need the emulated board (QEMU)")
    return colibri_target.firmware or build_runner()


@pytest.fixture(scope="module")
def starts(firmware: Path, tmp_path_factory) -> dict[str, Start]:
    """'one': slot A holds model 1 (sequence 1), B never written; the update goes to B.
    'two': then B holds model 3 (sequence 2); the update goes to A, over a valid older model."""
    folder = tmp_path_factory.mktemp("power-loss")
    out = {}
    dump = None
    for name, seed in (("one", 1), ("two", 3)):
        with Qemu(firmware, qmp=True, flash=dump) as q, Device(q.url) as dut:
            info = dut.update(small_model(seed))
            q.pause()
            dump = q.save_flash(folder / f"{name}.bin")
        running = info.running
        out[name] = Start(dump, small_model(seed), running, other(running), info[other(running)],
                          info[running].sequence + 1)
    return out


def flash_ops(image: bytes) -> tuple[int, int]:
    """(erases, word programs) of an update with this image."""
    sector, word = 128 * 1024, 32
    return -(-(slots.SLOT_HEADER_SIZE + len(image)) // sector), -(-len(image) // word)


# Cut points: (start, phase, where, mode, tear). `where` is n for erase and commit
# ("total" = the header word), and for program a word index as a fraction of the
# image's words (resolved at run time: 0.0 = the first word, 1.0 = the last, the
# padded partial word programmed by UPDATE_COMMIT).
MASKS = [0x00000001, 0x0000FFFF, 0xFFFF0000, 0x55555555, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0x00000000]
PROGRAM_AT = [0.0, 0.03, 0.1, 0.17, 0.25, 0.31, 0.38, 0.45, 0.5, 0.56, 0.62, 0.69, 0.75, 0.81, 0.88, 0.94, 0.97, 1.0]
CUTS = (
    [("one", "erase", 0, 0, 0), ("one", "erase", 1, 0, 0)]
    + [("one", "erase", 1, 1, tear) for tear in (0, 32, 4096, 65536, 131000, 1 << 20)]
    + [("one", "program", f, 0, 0) for f in PROGRAM_AT]
    + [("one", "program", f, 1, MASKS[i % len(MASKS)]) for i, f in enumerate(PROGRAM_AT)]
    + [("one", "commit", "total-1", 0, 0), ("one", "commit", "total", 0, 0)]
    + [("one", "commit", "total", 1, m) for m in (0, 0x1, 0xFF, 0xFFFF, 0x0FFFFFFF, 0xEFFFFFFF, 0x7FFFFFFF,
                                                  0xFFFFFFFE, 0xFFFFFFFF)]
    + [("two", "erase", 0, 0, 0), ("two", "erase", 1, 0, 0)]
    + [("two", "erase", 1, 1, tear) for tear in (0, 64, 65536)]
    + [("two", "program", f, mode, 0x00FF00FF) for f in (0.0, 0.5, 1.0) for mode in (0, 1)]
    + [("two", "commit", "total-1", 0, 0), ("two", "commit", "total", 0, 0)]
    + [("two", "commit", "total", 1, m) for m in (0xFFFF, 0xEFFFFFFF, 0xFFFFFFFF)]
)


def cut_id(c) -> str:
    start, phase, where, mode, tear = c
    return f"{start}-{phase}-{where}-{'torn' if mode else 'clean'}" + (f"-{tear:#x}" if mode else "")


def resolve(phase: str, where, image: bytes) -> int:
    erases, words = flash_ops(image)
    total = erases + words + 1
    if phase == "erase":
        return where
    if phase == "program":
        return erases + 1 + round(where * (words - 1))
    return {"total-1": total - 1, "total": total}[where]


def expect_new(phase: str, where, mode: int, tear: int, start: Start, image: bytes) -> bool:
    """Whether the cut leaves the new model committed: the header word complete (or torn such that
    the bytes that did get programmed already make the whole header, which the CRC decides)."""
    if phase != "commit" or where != "total":
        return False
    if mode == 0:
        return True
    header = slots.slot_header(image, start.sequence)
    torn = bytes(b if (tear >> i) & 1 else 0xFF for i, b in enumerate(header))
    return slots.parse_slot_header(torn) == slots.parse_slot_header(header)


def update_until_cut(q: Qemu, dut: Device, image: bytes) -> None:
    """Runs the update in a thread and returns once the firmware reports the power cut."""
    result: list = []

    def run() -> None:
        try:
            dut.update(image)
            result.append("finished")
        except Exception as exc:  # noqa: BLE001  the line goes dead
            result.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    cut = q.wait_for_stderr(POWER_CUT, 20)
    q.pause()
    assert cut, f"no power cut reported; update: {result}; QEMU stderr: {q.stderr[-300:]}"
    assert result != ["finished"], "the update was answered after the power cut"
    return worker


def check_after_reboot(firmware: Path, dump: Path, start: Start, image: bytes, new_runs: bool) -> None:
    with Qemu(firmware, qmp=True, flash=dump) as q, Device(q.url) as dut:
        assert dut.hello().protocol_version == P.VERSION
        info = dut.slot_info()
        assert info.running == info.active, info  # boot ran the active slot
        assert info.running in ("A", "B"), f"no model after the cut, though one existed: {info}"
        want = image if new_runs else start.old
        slot = info[info.running]
        assert slot.valid and (slot.image_size, slot.image_crc32) == (len(want), zlib.crc32(want)), info
        assert runs(dut, want), "the device does not compute what the host engine does for that image"
        if new_runs:
            assert info.running == start.target and slot.sequence == start.sequence
        else:
            assert info.running == start.running
            target = info[start.target]
            assert not target.valid or target == start.target_before, info  # never a half-written "valid" slot
        # The update can be done again from here, whatever the cut left behind.
        again = dut.update(image)
        assert again[again.running].image_crc32 == zlib.crc32(image) and runs(dut, image)


@pytest.mark.parametrize("cut", CUTS, ids=[cut_id(c) for c in CUTS])
def test_power_cut(cut, firmware: Path, starts: dict[str, Start], tmp_path: Path) -> None:
    start_name, phase, where, mode, tear = cut
    start = starts[start_name]
    image = small_model(NEW)
    n = resolve(phase, where, image)
    with Qemu(firmware, qmp=True, flash=start.dump) as q, Device(q.url, timeout=20) as dut:
        assert dut.slot_info().running == start.running
        dut.power_cut_after(n, mode, tear)
        worker = update_until_cut(q, dut, image)
        dump = q.save_flash(tmp_path / "cut.bin")
    worker.join(10)
    check_after_reboot(firmware, dump, start, image, expect_new(phase, where, mode, tear, start, image))


def test_cut_points_cover_every_phase() -> None:
    phases = {(c[0], c[1], c[3]) for c in CUTS}
    for start in ("one", "two"):
        for phase in ("erase", "program", "commit"):
            assert {(start, phase, 0), (start, phase, 1)} <= phases, (start, phase)
    assert len(CUTS) >= 50


def test_operation_count_and_no_cut_past_the_end(firmware: Path, starts: dict[str, Start], tmp_path: Path) -> None:
    """The update takes exactly the operations the cut points assume; a cut armed past them never fires."""
    start = starts["one"]
    image = small_model(NEW)
    erases, words = flash_ops(image)
    with Qemu(firmware, qmp=True, flash=start.dump) as q, Device(q.url) as dut:
        before = dut.power_cut_after(erases + words + 2, 0)
        info = dut.update(image)
        assert dut.power_cut_after(10**6, 0) - before == erases + words + 1
        assert info.running == start.target and runs(dut, image)
        assert POWER_CUT not in q.stderr
        q.pause()
        dump = q.save_flash(tmp_path / "done.bin")
    with Qemu(firmware, flash=dump) as q, Device(q.url) as dut:
        assert dut.slot_info().running == start.target and runs(dut, image)


def test_power_cut_request_is_checked(firmware: Path) -> None:
    with Qemu(firmware) as q, Device(q.url) as dut:
        for payload in (b"", bytes(8), (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + bytes(4),
                        bytes(4) + (1).to_bytes(4, "little") + bytes(4)):  # short, mode 2, torn at n = 0
            with pytest.raises(Exception) as exc:
                dut.request(P.Type.POWER_CUT_AFTER, payload)
            assert getattr(exc.value, "code", None) == P.ProtocolStatus.BAD_PAYLOAD
        assert dut.hello().protocol_version == P.VERSION
