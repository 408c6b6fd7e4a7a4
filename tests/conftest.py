from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests import these from helpers.build; the names stay importable from conftest for tests written before
# tests/helpers existed (branches in flight), until they are moved into a room.
from helpers.build import CORE, ROOT, build_c_tests, make  # noqa: F401
from helpers.micropython import build_mpy, shared_build_dir


@pytest.fixture(scope="session", params=["host", pytest.param("asan", marks=pytest.mark.sanitizer)])
def c_drivers(request) -> Path:
    """The test drivers built normally and with AddressSanitizer + UndefinedBehaviorSanitizer."""
    return build_c_tests(request.param)


@pytest.fixture(scope="session")
def mpy_dir(tmp_path_factory) -> Path:
    """The folder holding the x64 colibri.mpy, built once per session."""
    return build_mpy("x64", shared_build_dir(tmp_path_factory)).parent


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
