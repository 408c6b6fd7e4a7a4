"""Instructions per forward of the AArch64 build under qemu-aarch64, reference vs NEON kernels.

    .venv/bin/python bench/aarch64_insns.py

Exports the bench's meter and edge models (bench/models.py) as f32, f16, q8 and q8 with int8
activations in the experts, builds the aarch64 test drivers (tests/c VARIANT=aarch64) and a
QEMU plugin counting executed guest instructions (bench/qemu_insn_count.c), and runs
colibri_kernels_e2e under `qemu-aarch64 -cpu cortex-a72` (ARMv8.0) and `-cpu max` (SDOT).
Per forward = (count with R repetitions of one kernel set - count with none) / R.

Emulated instruction counts, not cycles and not a performance figure of any CPU: they say how
many instructions each kernel set issues, nothing about a Cortex-A72's pipelines or memory.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import models as M  # noqa: E402
from colibri.frontends.exporter import export  # noqa: E402

CPUS = {"cortex-a72": "aarch64 neon", "max": "aarch64 neon+dotprod"}
VARIANTS = [("f32", {}), ("f16", {"dtype": "f16"}), ("q8", {"dtype": "q8"}),
            ("q8 int8-act", {"dtype": "q8", "int8_act": ["*.experts.*"]})]


def count(plugin: Path, cpu: str, args: list[str]) -> int:
    r = subprocess.run(["qemu-aarch64", "-cpu", cpu, "-L", "/usr/aarch64-linux-gnu", "-plugin", str(plugin),
                        "-d", "plugin", *args], capture_output=True, text=True, check=True)
    return int(next(line for line in (r.stdout + r.stderr).splitlines() if line.startswith("insns:")).split()[1])


def main() -> None:
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "tests" / "c"), "VARIANT=aarch64"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    driver = ROOT / "tests" / "c" / "build" / "aarch64" / "colibri_kernels_e2e"
    plugin = ROOT / "tests" / "c" / "build" / "aarch64" / "libinsn.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(ROOT / "bench" / "qemu_insn_count.c"), "-o", str(plugin)],
                   check=True)
    rng = np.random.default_rng(0)
    print("instructions per forward under qemu-aarch64 (emulated, not a performance figure)")
    print(f"{'model':<8}{'dtype':<13}{'batch':>6}  {'cpu':<11}{'reference':>12}{'NEON':>12}{'ratio':>7}  kernels")
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn, reps in (("meter", M.meter, 50), ("edge", M.edge, 3)):
            module = fn()
            n_in = next(p for p in module.parameters()).shape[1]
            for dtype, kw in VARIANTS:
                img = Path(tmp) / f"{name}-{dtype.replace(' ', '-')}.clb"
                img.write_bytes(bytes(export(module, None, max_batch=8, **kw).image))
                for batch in (1, 8):
                    rng.standard_normal((batch, n_in)).astype(np.float32).tofile(f"{img}.in")
                    for cpu, kname in CPUS.items():
                        base = count(plugin, cpu, [str(driver), kname, str(img)])
                        per = {s: (count(plugin, cpu, [str(driver), "--time", str(reps), "--only", s, kname, str(img)])
                                   - base) / reps for s in ("ref", "opt")}
                        print(f"{name:<8}{dtype:<13}{batch:>6}  {cpu:<11}{per['ref']:>12,.0f}{per['opt']:>12,.0f}"
                              f"{per['ref'] / per['opt']:>6.1f}×  {kname}", flush=True)


if __name__ == "__main__":
    main()
