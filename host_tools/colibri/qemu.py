"""Boots firmware in QEMU's mps2-an500 (Cortex-M7) with its UART on a TCP port.

    with Qemu("runner.elf") as q:
        dut = Device(q.url)
        ...
    print(q.exit_status)   # the firmware's semihosting exit status

QEMU listens on a free port it picks itself (port 0) and starts the guest
only when the host connects (wait=on), so no early output is lost; nodelay=on
keeps small round trips under a millisecond. The process is always ended on
exit, also when a test fails.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path

from .errors import ColibriError

ICOUNT_SHIFT = 7  # the firmware converts SysTick ticks to instructions with the same shift
_PORT = re.compile(r"disconnected:tcp:127\.0\.0\.1:(\d+)")  # the listening port, not the -serial option echoed


class QemuError(ColibriError):
    pass


class Qemu:
    def __init__(self, firmware: str | Path, *, machine: str = "mps2-an500", timeout: float = 10.0,
                 extra_args: list[str] | None = None):
        self.firmware = Path(firmware)
        self.machine = machine
        self.timeout = timeout
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.port: int | None = None
        self._stderr: list[str] = []
        self.exit_status: int | None = None

    @property
    def url(self) -> str:
        return f"socket://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        exe = shutil.which("qemu-system-arm")
        if exe is None:
            raise QemuError("qemu-system-arm not found: run scripts/setup.sh (apt-get install qemu-system-arm)")
        return [
            exe, "-M", self.machine, "-display", "none", "-monitor", "none", "-nodefaults",
            "-kernel", str(self.firmware),
            "-semihosting-config", "enable=on,target=native",
            "-icount", f"shift={ICOUNT_SHIFT},sleep=off",
            "-serial", "tcp:127.0.0.1:0,server=on,wait=on,nodelay=on",
            *self.extra_args,
        ]

    def start(self) -> Qemu:
        if not self.firmware.exists():
            raise QemuError(f"{self.firmware}: no such firmware (build it with make firmware)")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        found = threading.Event()

        def read_stderr() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self._stderr.append(line)
                m = _PORT.search(line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        self._reader = threading.Thread(target=read_stderr, daemon=True)
        self._reader.start()
        if not found.wait(self.timeout) or self.port is None:
            self.stop()
            raise QemuError(f"QEMU did not open its serial port: {''.join(self._stderr).strip()[-500:]}")
        return self

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the firmware to end QEMU (semihosting exit); returns its status."""
        assert self.proc is not None
        self.exit_status = self.proc.wait(timeout if timeout is not None else self.timeout)
        return self.exit_status

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.exit_status is None:
            self.exit_status = self.proc.returncode
        if self._reader is not None:
            self._reader.join(5)  # ends at EOF once the process is gone
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def __enter__(self) -> Qemu:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

