"""Paths of the checkout and the builds tests need: make under one lock, the C test drivers per variant."""
from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
