"""The MicroPython module against a real MicroPython tree (MICROPYTHON_PATH), built the user's ways.

No package registry has MicroPython's source, so these tests need a checkout
(submodules not needed): MICROPYTHON_PATH names it, and they are skipped with
that reason without it (`make upstream-check MICROPYTHON_PATH=...`, README.md
"Upstream checks"). They build into folders of their own inside that tree
(build-colibri*, as MicroPython's ports build in place) and:

- build the unix port with `colibri` as a user C module
  (USER_C_MODULES=<this checkout>, micropython_module/micropython.mk; the unix
  port has no CMake build, so micropython.cmake is checked by
  tests/micropython/test_micropython_module.py against a stand-in only) and run
  tests/micropython/test_micropython_module.py, tests/micropython/test_micropython_lm.py and the natmod import test under it: every test
  passes with the compiled-in module (COLIBRI_MICROPYTHON_BUILTIN=1);
- build the unix port without the module and run the same tests with the
  project's x64 .mpy loaded from MICROPYPATH: the native-module ABI of that tree;
- build the qemu port for MPS2_AN500 (Cortex-M7, the board closest to the
  STM32H7 that builds without submodules) with and without the module: it
  compiles and links, and the firmware it adds is reported
  (arm-none-eabi-size, text + data + bss), then boots it in QEMU and runs
  a forward pass at its REPL.

The unix port is built with FFI, SSL and BTREE off and both ports without
frozen modules (FROZEN_MANIFEST=): those need submodules.
"""
from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import colibri
from helpers.build import ROOT

MP = Path(os.environ["MICROPYTHON_PATH"]).resolve() if os.environ.get("MICROPYTHON_PATH") else None
pytestmark = [pytest.mark.upstream, pytest.mark.micropython, pytest.mark.qemu, pytest.mark.cross, pytest.mark.skipif(
    MP is None, reason="MICROPYTHON_PATH is not set (a MicroPython checkout; docs/testing.md 'Upstream checks': "
                       "make upstream-check MICROPYTHON_PATH=...)")]
UNIX_OPTIONS = ["MICROPY_PY_FFI=0", "MICROPY_PY_SSL=0", "MICROPY_PY_BTREE=0", "FROZEN_MANIFEST="]
QEMU_BOARD = "MPS2_AN500"
MP_TESTS = ["tests/micropython/test_micropython_module.py", "tests/micropython/test_micropython_lm.py", "tests/micropython/test_micropython_natmod.py::test_minimal_module_imports"]
SIZES = ROOT / "build" / "upstream" / "micropython-qemu-size.txt"


def mp_make(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    r = subprocess.run(["make", "-j2", *args], cwd=MP, capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def mpy_cross() -> None:
    mp_make("-C", "mpy-cross")


def unix_port(build: str, *extra: str) -> Path:
    mp_make("-C", "ports/unix", f"BUILD={build}", *UNIX_OPTIONS, *extra)
    prog = MP / "ports" / "unix" / build / "micropython"
    assert prog.is_file()
    return prog


@pytest.fixture(scope="module")
def unix_with_module(mpy_cross) -> Path:
    return unix_port("build-colibri", f"USER_C_MODULES={ROOT}")


@pytest.fixture(scope="module")
def unix_without_module(mpy_cross) -> Path:
    return unix_port("build-colibri-plain")


def run_pytest(interpreter: Path, builtin: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLIBRI_MICROPYTHON=str(interpreter), COLIBRI_MICROPYTHON_BUILTIN="1" if builtin else "0")
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *MP_TESTS], cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)


def passed_all(r: subprocess.CompletedProcess) -> int:
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    # nothing failed or skipped; warnings (a plugin's deprecation notice) do not count against the module
    assert re.fullmatch(r"=*\s*\d+ passed(, \d+ warnings?)? in [\d.]+s( \([\d:]+\))?\s*=*", summary), summary
    return int(re.search(r"(\d+) passed", summary).group(1))


def test_user_module_is_built_in(unix_with_module: Path) -> None:
    r = subprocess.run([str(unix_with_module), "-c", "import colibri, sys; print(colibri.version(), "
                        "getattr(colibri, '__file__', None), sys.implementation._mpy)"],
                       capture_output=True, text=True, timeout=30, env={"MICROPYPATH": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    version, origin, _ = r.stdout.split()
    assert version == colibri.version() and origin == "None", r.stdout


@pytest.fixture(scope="module")
def collected() -> int:
    """How many tests MP_TESTS hold: each run must pass every one of them, none skipped."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *MP_TESTS],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    n = sum(1 for ln in r.stdout.splitlines() if "::" in ln)
    assert n > 50, r.stdout
    return n


def test_micropython_tests_pass_with_the_user_module(unix_with_module: Path, collected: int) -> None:
    assert passed_all(run_pytest(unix_with_module, builtin=True)) == collected


def test_micropython_tests_pass_with_the_native_module(unix_without_module: Path, collected: int) -> None:
    assert passed_all(run_pytest(unix_without_module, builtin=False)) == collected


def qemu_port(build: str, *extra: str) -> Path:
    mp_make("-C", "ports/qemu", f"BOARD={QEMU_BOARD}", f"BUILD={build}", "FROZEN_MANIFEST=", *extra)
    elf = MP / "ports" / "qemu" / build / "firmware.elf"
    assert elf.is_file()
    return elf


def size(elf: Path) -> dict[str, int]:
    r = subprocess.run(["arm-none-eabi-size", str(elf)], capture_output=True, text=True, check=True)
    text, data, bss = (int(v) for v in r.stdout.splitlines()[1].split()[:3])
    return {"text": text, "data": data, "bss": bss}


@pytest.fixture(scope="module")
def qemu_firmware(mpy_cross) -> tuple[Path, Path]:
    if shutil.which("arm-none-eabi-gcc") is None:
        pytest.skip("arm-none-eabi-gcc is not installed (scripts/setup.sh installs it)")
    return qemu_port("build-colibri-plain"), qemu_port("build-colibri", f"USER_C_MODULES={ROOT}")


def test_qemu_port_links_the_user_module(qemu_firmware: tuple[Path, Path]) -> None:
    plain, with_module = qemu_firmware
    nm = subprocess.run(["arm-none-eabi-nm", str(with_module)], capture_output=True, text=True, check=True).stdout
    assert re.search(r" colibri_forward$", nm, re.M) and re.search(r" colibri_user_cmodule$", nm, re.M)
    a, b = size(plain), size(with_module)
    added = {k: b[k] - a[k] for k in a}
    SIZES.parent.mkdir(parents=True, exist_ok=True)
    SIZES.write_text(f"ports/qemu BOARD={QEMU_BOARD}, arm-none-eabi-size firmware.elf\n"
                     f"without colibri: {a}\nwith colibri:    {b}\nadded:           {added}\n")
    print(SIZES.read_text())
    assert added["text"] > 10_000 and added["data"] == 0, added  # the engine keeps no writable globals


def test_qemu_firmware_runs_the_module(qemu_firmware: tuple[Path, Path], tmp_path: Path) -> None:
    """The Cortex-M7 MicroPython with the module compiled in: at its REPL over the UART, `colibri.version()`
    and a forward pass of a small f32 model (the image typed in as hex) give the host engine's numbers."""
    if shutil.which("qemu-system-arm") is None:
        pytest.skip("qemu-system-arm is not installed")
    import numpy as np
    import torch

    from colibri import nn as cnn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), cnn.MoE(8, 2, 8, top_k=1, routing="top1"),
                                torch.nn.Linear(8, 3)).eval()
    image = colibri.export(model, tmp_path / "m.clb", max_batch=1).image
    x = np.array([0.5, -1.0, 0.25, 2.0], np.float32)
    want = colibri.Model(image, reference_kernels=True).forward(x)
    session = ("import colibri\nfrom array import array\n"
               f"img = bytes.fromhex('{image.hex()}')\n"
               "m = colibri.Model(img)\n"
               "y = array('f', [0.0] * 3)\n"
               f"m.forward(array('f', {x.tolist()}), y)\n"
               "print('VERSION', colibri.version())\n"
               "print('OUT', ' '.join(repr(v) for v in y))\n")
    text = _repl_session(qemu_firmware[1], session, rb"\nOUT [^\n]*\n")
    assert f"\nVERSION {colibri.version()}\n" in text, text[-3000:]
    got = np.array([float(v) for v in text.split("\nOUT ", 1)[1].splitlines()[0].split()], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_qemu_firmware_runs_the_lm(qemu_firmware: tuple[Path, Path], tmp_path: Path) -> None:
    """colibri.LM on the Cortex-M7 MicroPython with the module compiled in: a small token model typed in
    at its REPL generates the host engine's greedy ids, into a list and into a bytearray, and refuses a
    token outside its vocabulary with the engine's status."""
    if shutil.which("qemu-system-arm") is None:
        pytest.skip("qemu-system-arm is not installed")
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from helpers import lmmodels
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from colibri import image as image_writer
    from colibri.model.format import STATUS_TEXT, Status

    image = image_writer.write(lmmodels.token_model(5, vocab=24, d=8, layers=2, heads=2, kv_heads=1, hd=4,
                                                    max_seq_len=12, max_batch=2))
    want = colibri.LM(image, reference_kernels=True).generate([1, 2, 3], 6)
    session = ("import colibri\n"
               f"lm = colibri.LM(bytes.fromhex('{image.hex()}'))\n"
               "print('IDS', lm.generate([1, 2, 3], 6))\n"
               "out = bytearray(6)\n"
               "print('OUT', lm.generate(b'\\x01\\x02\\x03', 6, out=out), list(out))\n"
               "lm.forward_tokens([24])\n"
               "print('DONE')\n")
    text = _repl_session(qemu_firmware[1], session, rb"\nDONE\n")
    assert f"\nIDS {want}\n" in text, text[-3000:]
    assert f"\nOUT 6 {want}\n" in text, text[-3000:]
    assert f"\nValueError: colibri: {STATUS_TEXT[Status.BAD_TOKEN]}" in text, text[-3000:]


def _repl_session(elf: Path, session: str, done: bytes, timeout: float = 120) -> str:
    """Types session into the MicroPython REPL of the qemu firmware (mps2-an500, UART on stdio) and
    returns what it printed (\r removed) once `done` matches, or at the timeout."""
    proc = subprocess.Popen(["qemu-system-arm", "-M", "mps2-an500", "-display", "none", "-monitor", "none",
                             "-nodefaults", "-semihosting", "-serial", "stdio", "-kernel", str(elf)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = b""
    try:
        proc.stdin.write(session.encode())
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while not re.search(done, out.replace(b"\r", b"")) and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
    finally:
        proc.kill()
        proc.wait()
    return out.decode(errors="replace").replace("\r", "")
