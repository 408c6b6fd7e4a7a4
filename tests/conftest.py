from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "firmware" / "colibri_core"


def make(*args: str) -> subprocess.CompletedProcess:
    """Runs make under one lock, so parallel pytest workers never build the same objects at once."""
    lock = ROOT / "tests" / "c" / ".build.lock"
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        return subprocess.run(["make", "-s", *args], capture_output=True, text=True)


def build_c_tests(variant: str) -> Path:
    """Builds the engine and the C test drivers for a variant (host, asan, tsan); returns their folder."""
    r = make("-C", str(ROOT / "tests" / "c"), f"VARIANT={variant}")
    assert r.returncode == 0, r.stdout + r.stderr
    return ROOT / "tests" / "c" / "build" / variant


@pytest.fixture(scope="session", params=["host", "asan"])
def c_drivers(request) -> Path:
    """The test drivers built normally and with AddressSanitizer + UndefinedBehaviorSanitizer."""
    return build_c_tests(request.param)


def _qemu_children() -> list[int]:
    """PIDs of qemu-system-arm processes this test process started and has not ended."""
    me = str(os.getpid())
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = stat.with_name("comm").read_text().strip()
        except OSError:
            continue
        if fields[1] == me and comm.startswith("qemu-system"):
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def no_qemu_left_behind():
    """Fails a test that leaves a QEMU process running after it (and its fixtures) ended."""
    yield
    assert _qemu_children() == [], "a QEMU process outlived its test"
