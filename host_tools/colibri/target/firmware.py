"""The runner firmware for the emulated board: where it is and how it is built.

Shared by the `colibri` command (hil, footprint, flash) and the pytest plugin,
so it must not import pytest: the CLI works without the test extra.
"""
from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

from ..runtime import sources
from ..model.errors import BuildError, ColibriError


def _first_error(output: str) -> str:
    """The line of a make/compiler log that says what went wrong (the first `error`), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[-1] if lines else "no output"


def build_runner() -> Path:
    """Builds the QEMU runner from this checkout, or from the sources packaged with colibri (make is
    idempotent; a lock serialises xdist workers)."""
    runner = sources.build_root() / "firmware" / "runner"
    if not (runner / "Makefile").exists():
        raise BuildError("no firmware/runner among the C sources: pass the runner ELF with --firmware")
    lock = runner / ".build.lock"
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        r = subprocess.run(["make", "-s", "-C", str(runner), "BOARD=mps2_an500"],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"building the runner failed: {_first_error(r.stdout + r.stderr)}",
                         log=r.stdout + r.stderr)
    return runner / "build" / "mps2_an500" / "runner.elf"


def check_emulator_elf(path: Path) -> Path:
    """Refuses, before QEMU boots it, a --firmware that is no Arm ELF: QEMU would load it as raw bytes or
    at the wrong addresses and run garbage, which the host sees only as silence on the serial line."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as fh:
        if fh.read(4) != b"\x7fELF":
            raise ColibriError(f"{path} is not an ELF file: give the runner's .elf built for mps2_an500")
        fh.seek(0)
        try:
            machine = ELFFile(fh)["e_machine"]
        except ELFError as exc:
            raise ColibriError(f"{path}: a broken ELF file ({exc})") from None
    if machine != "EM_ARM":
        raise ColibriError(f"{path} is an ELF for {machine.removeprefix('EM_')}, not for Arm: give the runner's "
                           ".elf built for mps2_an500")
    return path
