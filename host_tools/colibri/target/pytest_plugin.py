"""pytest plugin: a `dut` fixture, the runner firmware on a device under test.

By default every test gets a fresh QEMU mps2-an500 (Cortex-M7) booting the
runner; `--colibri-port /dev/ttyACM0` runs the same tests on a real board
flashed with the runner (`--colibri-baud` sets its speed). Nothing else in a
test needs to know which it is.

`colibri_target.power_cycle(dut)` turns the device off and on: RAM is lost,
flash (the model slots) kept. Under QEMU that is: pause the VM, save its
emulated flash over QMP, end QEMU, boot a new one with that flash loaded.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import firmware
from .device import Device
from ..model.errors import BuildError
from .qemu import Qemu


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("colibri", "Colibri hardware-in-the-loop")
    group.addoption("--colibri-port", default=None,
                    help="serial port (or pyserial URL) of a board running the runner; default: QEMU")
    group.addoption("--colibri-baud", type=int, default=115200, help="baud rate for --colibri-port")
    group.addoption("--colibri-firmware", default=None,
                    help="runner ELF for QEMU (default: build firmware/runner for mps2_an500)")


def build_runner() -> Path:
    """colibri.target.firmware.build_runner, its failure reported as a pytest usage error with make's whole output."""
    try:
        return firmware.build_runner()
    except BuildError as exc:
        raise pytest.UsageError(f"{exc}\n{exc.log}") from None


class Target:
    """Where the device under test lives: a QEMU process or a serial port."""

    def __init__(self, config: pytest.Config):
        self.port: str | None = config.getoption("--colibri-port")
        self.baud: int = config.getoption("--colibri-baud")
        firmware = config.getoption("--colibri-firmware")
        self.firmware = Path(firmware) if firmware else None
        self.qemu: Qemu | None = None
        self._flash_dir: Path | None = None

    @property
    def emulated(self) -> bool:
        return self.port is None

    def connect(self, flash: Path | None = None) -> Device:
        """A device to talk to. QEMU: a new one, its emulated flash loaded from `flash` if given."""
        if self.port is not None:
            return Device(self.port, baudrate=self.baud)
        if self.firmware is None:
            self.firmware = build_runner()
        self.qemu = Qemu(self.firmware, qmp=True, flash=flash).start()
        return Device(self.qemu.url)

    def save_flash(self, path: Path) -> Path:
        """QEMU only: pauses the VM and writes its emulated flash (the two slots) to `path`."""
        assert self.qemu is not None, "save_flash needs the emulated board"
        self.qemu.pause()
        return self.qemu.save_flash(path)

    def power_cycle(self, device: Device) -> Device:
        """Power off and on: RAM is lost, flash kept. Returns a fresh connection to the rebooted device."""
        if self.qemu is None:
            device.reset()  # a board: a system reset keeps flash
            return self.after_reset(device)
        if self._flash_dir is None:
            self._flash_dir = Path(tempfile.mkdtemp(prefix="colibri-flash-"))
        dump = self.save_flash(self._flash_dir / f"flash-{time.monotonic_ns()}.bin")
        self.disconnect(device)
        return self.connect(flash=dump)

    def disconnect(self, device: Device) -> None:
        device.close()
        if self.qemu is not None:
            self.qemu.stop()
            self.qemu = None

    def after_reset(self, device: Device) -> Device:
        """The device was told to reset: returns a fresh connection to it once it is back."""
        device.close()
        if self.qemu is not None:
            status = self.qemu.wait(10)
            self.qemu.stop()  # already gone: this only releases its pipes and QMP socket folder
            assert status == 0, f"QEMU ended with status {status} after RESET"
            self.qemu = None
        else:
            time.sleep(1.0)  # the board reboots; USB CDC ports stay, so reopen
        return self.connect()


@pytest.fixture(scope="session")
def colibri_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    target = Target(request.config)
    yield target
    if target._flash_dir is not None:
        shutil.rmtree(target._flash_dir, ignore_errors=True)


@pytest.fixture
def dut(colibri_target: Target) -> Iterator[Device]:
    device = colibri_target.connect()
    try:
        yield device
    finally:
        colibri_target.disconnect(device)
