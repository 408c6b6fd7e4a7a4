"""The Cortex-M7 kernels (firmware/colibri_core/src/kernels/cmsis) against the reference kernels, on the
emulated Cortex-M7: tests/c/cm7/kernel_test.c runs random cases (f32, f16, q8 with f32 and int8
activations; linear and linear_acc; odd sizes and tails; 1-9 tokens with and without a row list, bias,
gates; NaN and inf inputs), the activations and the int8 quantiser, in QEMU mps2-an500 with semihosting,
and exits with the number of outputs out of its stated tolerance (bit for bit for int8 activations, ReLU
and the quantiser; SiLU and sigmoid within 2^-20 relative); and I4 weights (q4, every group size, E and
companion bias present or absent) with f32 and int8 activations."""
from __future__ import annotations

import re
import subprocess

import pytest

from helpers.build import ROOT, make

pytestmark = [pytest.mark.qemu, pytest.mark.cross]

CM7 = ROOT / "tests" / "c" / "cm7"


def run_kernel_test(kernels: str | None) -> str:
    args = ["-C", str(CM7)] + ([f"KERNELS={kernels}"] if kernels else [])
    r = make(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    elf = CM7 / (f"build-{kernels}" if kernels else "build") / "kernel_test.elf"
    q = subprocess.run(["qemu-system-arm", "-M", "mps2-an500", "-display", "none", "-monitor", "none",
                        "-nodefaults", "-icount", "shift=7,sleep=off",
                        "-semihosting-config", "enable=on,target=native", "-kernel", str(elf)],
                       capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, f"kernel test failed (status {q.returncode}):\n{q.stdout}{q.stderr}"
    return q.stdout + q.stderr  # semihosting writes go to QEMU's stderr


@pytest.mark.usefixtures("no_qemu_left_behind")
def test_cmsis_kernels_match_the_reference_on_the_m7() -> None:
    out = run_kernel_test(None)  # the build's default backend: cmsis on the Cortex-M7
    assert "kernels: cmsis" in out, out
    for kind in ("f32", "f16", "q8 f32-act", "q8 int8-act"):
        m = re.search(rf"^{re.escape(kind)}: (\d+) linear, (\d+) linear_acc cases; worst err/tol ([\d.]+), ([\d.]+)$",
                      out, re.M)
        assert m and int(m[1]) > 50 and int(m[2]) > 50, out
        if kind == "q8 int8-act":
            assert float(m[3]) == float(m[4]) == 0.0, "int8 activations must be bit for bit"
    m = re.search(r"^q4: (\d+) f32-act, (\d+) int8-act cases; f32-act worst err/tol ([\d.]+), int8-act bit for bit$",
                  out, re.M)
    assert m and int(m[1]) >= 150 and int(m[2]) >= 150 and float(m[3]) <= 1.0, out
    assert "activations: 240 cases" in out and "quantize_rows: 200 cases, bit for bit" in out, out
    assert "passed: 0" in out, out
    # The instruction counts it prints (QEMU -icount, not cycles) on the meter model's shapes: the cmsis
    # kernels must beat the reference ones, and f32 stay near the floor of docs/m7-floors.md (73
    # instructions per 64 MACs, 1.14): 1.24 with 13 instructions of bookkeeping per 8-row block, 1.25
    # before (16), which the whole meter inference needs to stay within issue 10's 1.4 per MAC.
    per_mac = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(
        r"^instructions per MAC, meter shapes, (.+?): optimised ([\d.]+) reference ([\d.]+)", out, re.M)
        if not m[1].startswith("q4")}
    assert set(per_mac) == {"f32", "f16", "q8 f32-act", "q8 int8-act"}, out
    assert all(opt < ref for opt, ref in per_mac.values()), per_mac
    assert per_mac["f32"][0] < 1.245, per_mac
    # q4 (group 32): the cmsis kernels beat the reference ones on the meter shapes too, and on one wide
    # layer (256 x 256) print instructions per MAC beside q8's and f32's (bench figures, not pinned).
    q4 = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(
        r"^instructions per MAC, meter shapes, (q4 .+?): optimised ([\d.]+) reference ([\d.]+)", out, re.M)}
    assert set(q4) == {"q4 f32-act", "q4 int8-act"} and all(opt < ref for opt, ref in q4.values()), q4
    wide = dict(re.findall(r"^instructions per MAC, wide 256x256, (.+?): ([\d.]+)", out, re.M))
    assert set(wide) == {"f32", "q8 f32-act", "q8 int8-act", "q4 f32-act", "q4 int8-act"}, out


@pytest.mark.usefixtures("no_qemu_left_behind")
def test_kernel_driver_on_the_reference_build() -> None:
    """KERNELS=ref: the driver compares the reference with itself (every error 0), so its own checks and
    the reference kernels run on the M7 as well."""
    out = run_kernel_test("ref")
    assert "kernels: reference" in out and "passed: 0" in out, out
    assert "worst err/tol 0.000, 0.000" in out, out
