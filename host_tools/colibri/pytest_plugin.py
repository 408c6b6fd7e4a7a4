"""pytest plugin: a `dut` fixture, the runner firmware on a device under test.

By default every test gets a fresh QEMU mps2-an500 (Cortex-M7) booting the
runner; `--colibri-port /dev/ttyACM0` runs the same tests on a real board
flashed with the runner (`--colibri-baud` sets its speed). Nothing else in a
test needs to know which it is.
"""
from __future__ import annotations

import fcntl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .device import Device
from .qemu import Qemu

REPO = Path(__file__).resolve().parents[2]
DEFAULT_FIRMWARE = REPO / "firmware" / "runner" / "build" / "mps2_an500" / "runner.elf"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("colibri", "Colibri hardware-in-the-loop")
    group.addoption("--colibri-port", default=None,
                    help="serial port (or pyserial URL) of a board running the runner; default: QEMU")
    group.addoption("--colibri-baud", type=int, default=115200, help="baud rate for --colibri-port")
    group.addoption("--colibri-firmware", default=None,
                    help="runner ELF for QEMU (default: build firmware/runner for mps2_an500)")


def build_runner() -> Path:
    """Builds the QEMU runner from this checkout (make is idempotent; a lock serialises xdist workers)."""
    if not (REPO / "firmware" / "runner" / "Makefile").exists():
        raise pytest.UsageError("no firmware/runner in this checkout: pass --colibri-firmware")
    lock = REPO / "firmware" / "runner" / ".build.lock"
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        r = subprocess.run(["make", "-s", "-C", str(REPO / "firmware" / "runner"), "BOARD=mps2_an500"],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise pytest.UsageError(f"building the runner failed:\n{r.stdout}{r.stderr}")
    return DEFAULT_FIRMWARE


class Target:
    """Where the device under test lives: a QEMU process or a serial port."""

    def __init__(self, config: pytest.Config):
        self.port: str | None = config.getoption("--colibri-port")
        self.baud: int = config.getoption("--colibri-baud")
        firmware = config.getoption("--colibri-firmware")
        self.firmware = Path(firmware) if firmware else None
        self.qemu: Qemu | None = None

    @property
    def emulated(self) -> bool:
        return self.port is None

    def connect(self) -> Device:
        if self.port is not None:
            return Device(self.port, baudrate=self.baud)
        if self.firmware is None:
            self.firmware = build_runner()
        self.qemu = Qemu(self.firmware).start()
        return Device(self.qemu.url)

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
            assert status == 0, f"QEMU ended with status {status} after RESET"
            self.qemu = None
        else:
            time.sleep(1.0)  # the board reboots; USB CDC ports stay, so reopen
        return self.connect()


@pytest.fixture(scope="session")
def colibri_target(request: pytest.FixtureRequest) -> Target:
    return Target(request.config)


@pytest.fixture
def dut(colibri_target: Target) -> Iterator[Device]:
    device = colibri_target.connect()
    try:
        yield device
    finally:
        colibri_target.disconnect(device)
