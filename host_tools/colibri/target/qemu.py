"""Boots firmware in QEMU's mps2-an500 (Cortex-M7) with its UART on a TCP port.

    with Qemu("runner.elf") as q:
        dut = Device(q.url)
        ...
    print(q.exit_status)   # the firmware's semihosting exit status

QEMU listens on a free port it picks itself (port 0) and starts the guest
only when the host connects (wait=on), so no early output is lost; nodelay=on
keeps small round trips under a millisecond. The process is always ended on
exit, also when a test fails.

The runner keeps its model slots in emulated flash, a RAM region of QEMU
(colibri.target.slots.LAYOUTS["mps2_an500"]) that lives as long as the process. To
carry it across a "power cycle":

    with Qemu(elf, qmp=True) as q:
        ...                                   # dut.update(image)
        q.pause()                             # QMP stop: nothing runs any more
        q.save_flash("flash.bin")             # QMP pmemsave of the slot region
    with Qemu(elf, flash="flash.bin") as q:   # -device loader puts it back before reset
        ...
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ..model.errors import ColibriError
from .slots import LAYOUTS

ICOUNT_SHIFT = 7  # the firmware converts SysTick ticks to instructions with the same shift
_PORT = re.compile(r"disconnected:tcp:127\.0\.0\.1:(\d+)")  # the listening port, not the -serial option echoed
FLASH = LAYOUTS["mps2_an500"]
FLASH_BASE = FLASH.slot_a  # the emulated flash: slot A, then slot B
FLASH_SIZE = FLASH.slot_b + FLASH.slot_size - FLASH.slot_a
POWER_CUT = "colibri: power cut"  # what the firmware prints on stderr (semihosting) when its debug power cut fires


class QemuError(ColibriError):
    pass


# QEMU's chatter that is never the reason it stopped: the port banner, warnings, the register dump
# that follows a fatal error.
_NOISE = re.compile(r"info: QEMU waiting for connection|: warning: |^[RSsdD]\d\d=|^(XPSR|FPSCR|PSR|CPSR)[=:]")


def _reason(stderr: str) -> str:
    """The line of QEMU's stderr that says why it stopped (e.g. `qemu: fatal: Lockup: ...`)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not _NOISE.search(line.strip())]
    for line in lines:
        if "fatal" in line or "error" in line.lower():
            return line
    return lines[0] if lines else "no message"


class Qemu:
    def __init__(self, firmware: str | Path, *, machine: str = "mps2-an500", timeout: float = 10.0,
                 extra_args: list[str] | None = None, qmp: bool = False, flash: str | Path | None = None):
        """`qmp`: open a QMP socket (pause, save_flash); `flash`: a file (FLASH_SIZE bytes, as save_flash
        writes) loaded into the emulated flash before the firmware starts."""
        self.firmware = Path(firmware)
        self.machine = machine
        self.timeout = timeout
        self.extra_args = extra_args or []
        self.flash = Path(flash) if flash is not None else None
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.port: int | None = None
        self._stderr: list[str] = []
        self._stderr_changed = threading.Condition()
        self.exit_status: int | None = None
        self.qmp_enabled = qmp
        self._qmp_dir: str | None = None  # made by start(): a short path, unix socket paths are limited
        self._qmp: socket.socket | None = None
        self._qmp_buf = b""

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
            *(["-qmp", f"unix:{self.qmp_path},server=on,wait=off"] if self.qmp_enabled else []),
            # The generic loader writes the file at reset, before the CPU fetches its first
            # instruction; no ELF segment covers the region, so nothing else writes it.
            *(["-device", f"loader,file={self.flash.resolve()},addr=0x{FLASH_BASE:x},force-raw=on"]
              if self.flash is not None else []),
            *self.extra_args,
        ]

    @property
    def qmp_path(self) -> str:
        if not self.qmp_enabled:
            raise QemuError("no QMP socket: use Qemu(..., qmp=True)")
        if self._qmp_dir is None:
            self._qmp_dir = tempfile.mkdtemp(prefix="colibri-qmp-")
        return str(Path(self._qmp_dir) / "qmp.sock")

    def start(self) -> Qemu:
        if not self.firmware.exists():
            raise QemuError(f"{self.firmware}: no such firmware (build it with make firmware)")
        if self.flash is not None and self.flash.stat().st_size > FLASH_SIZE:
            raise QemuError(f"{self.flash}: {self.flash.stat().st_size} bytes, more than the "
                            f"{FLASH_SIZE}-byte emulated flash")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        found = threading.Event()

        def read_stderr() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                with self._stderr_changed:
                    self._stderr.append(line)
                    self._stderr_changed.notify_all()
                m = _PORT.search(line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()
            with self._stderr_changed:
                self._stderr_changed.notify_all()

        self._reader = threading.Thread(target=read_stderr, daemon=True)
        self._reader.start()
        if not found.wait(self.timeout) or self.port is None:
            self.stop()
            raise QemuError(f"QEMU did not open its serial port: {_reason(self.stderr)}")
        return self

    def ended_early(self, grace: float = 1.0) -> str | None:
        """If QEMU stopped on its own with a failure (waiting up to `grace` s for it to), why: its exit
        status and the line of its stderr that gives the reason; else None.

        A firmware QEMU cannot run (an ELF for another board, not an ELF at all) shows up on the host
        only as a reset serial connection; the reason is in QEMU's stderr."""
        if self.proc is None:
            return None
        try:
            status = self.proc.wait(grace) if grace > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None
        if status is None or status == 0:
            return None
        if self._reader is not None:
            self._reader.join(2)  # the rest of stderr
        how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        return f"QEMU stopped ({how}) running {self.firmware}: {_reason(self.stderr)}"

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the firmware to end QEMU (semihosting exit); returns its status."""
        assert self.proc is not None
        self.exit_status = self.proc.wait(timeout if timeout is not None else self.timeout)
        return self.exit_status

    def wait_for_stderr(self, text: str, timeout: float | None = None) -> bool:
        """Waits until a line of QEMU's stderr (where semihosting output goes) contains `text`."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._stderr_changed:
            while not any(text in line for line in self._stderr):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc is not None and self.proc.poll() is not None
                                 and not (self._reader and self._reader.is_alive())):
                    return any(text in line for line in self._stderr)
                self._stderr_changed.wait(min(left, 0.5))
        return True

    # -- QMP -----------------------------------------------------------------

    def qmp(self, command: str, **arguments) -> object:
        """One QMP command; its "return" value, or QemuError."""
        if self._qmp is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(self.qmp_path)
            self._qmp = sock
            self._qmp_read()  # greeting
            self._qmp_send("qmp_capabilities")
        return self._qmp_send(command, **arguments)

    def _qmp_read(self) -> dict:
        assert self._qmp is not None
        while b"\n" not in self._qmp_buf:
            chunk = self._qmp.recv(65536)
            if not chunk:
                raise QemuError("QMP connection closed by QEMU")
            self._qmp_buf += chunk
        line, self._qmp_buf = self._qmp_buf.split(b"\n", 1)
        return json.loads(line)

    def _qmp_send(self, command: str, **arguments) -> object:
        assert self._qmp is not None
        msg = {"execute": command, **({"arguments": arguments} if arguments else {})}
        self._qmp.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._qmp_read()
            if "event" in reply:
                continue
            if "error" in reply:
                raise QemuError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def pause(self) -> None:
        """Stops the guest CPU (QMP stop); memory stays as it is."""
        self.qmp("stop")

    def save_flash(self, path: str | Path) -> Path:
        """Writes the emulated flash (FLASH_SIZE bytes at FLASH_BASE) to `path` (QMP pmemsave);
        pause() first for a consistent copy."""
        path = Path(path).resolve()
        self.qmp("pmemsave", val=FLASH_BASE, size=FLASH_SIZE, filename=str(path))
        return path

    def stop(self) -> None:
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        if self.proc is None:
            self._remove_qmp_dir()
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
        self._remove_qmp_dir()

    def _remove_qmp_dir(self) -> None:
        if self._qmp_dir is not None:
            shutil.rmtree(self._qmp_dir, ignore_errors=True)
            self._qmp_dir = None

    @property
    def stderr(self) -> str:
        with self._stderr_changed:
            return "".join(self._stderr)

    def __enter__(self) -> Qemu:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # A failure while talking to the firmware (a reset connection, a timeout) whose real cause is that
        # QEMU itself stopped: report QEMU's reason instead.
        # A broken connection (OSError) means QEMU is going: give it a moment to finish saying why.
        why = (self.ended_early(grace=1.0 if isinstance(exc, OSError) else 0.0)
               if isinstance(exc, Exception) and not isinstance(exc, QemuError) else None)
        self.stop()
        if why is not None:
            raise QemuError(why) from exc

