"""Instructions per forward of the AArch64 build under qemu-aarch64, reference vs NEON kernels.

    .venv/bin/python bench/aarch64_insns.py [--blocks]      (--blocks: only the INT8_BLOCKS table)

Exports the bench's meter and edge models (bench/models.py) as f32, f16, q8 and q8 with int8
activations in the experts, builds the aarch64 test drivers (tests/c VARIANT=aarch64) and a
QEMU plugin counting executed guest instructions (bench/qemu_insn_count.c), and runs
colibri_kernels_e2e under `qemu-aarch64 -cpu cortex-a72` (ARMv8.0) and `-cpu max` (SDOT).
Per forward = (count with R repetitions of one kernel set - count with none) / R.

Then the block form of int8 activations (INT8_BLOCKS) alone: one `linear_blocks` call of the
100 M-class Mixtral's expert matrices (512->1408 and 1408->512, BLOCK_LAYERS) with q8 and q4
(groups of 32) weights over 1 token (decode) and 8 (prefill), run by bench/kernel_insns.c with
the reference kernels, the NEON ARMv8.0 kernels (`-cpu cortex-a72`) and the SDOT ones (`-cpu max`).
Per call = count with 2 calls - count with 1 (block_counts; scripts/measure.py's aarch64_blocks
group pins these figures).

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


def count(plugin: Path, cpu: str, args: list[str], kernels: str | None = None) -> int:
    r = subprocess.run(["qemu-aarch64", "-cpu", cpu, "-L", "/usr/aarch64-linux-gnu", "-plugin", str(plugin),
                        "-d", "plugin", *args], capture_output=True, text=True, check=True)
    if kernels is not None:
        assert f"kernels: {kernels} " in r.stdout, r.stdout
    return int(next(line for line in (r.stdout + r.stderr).splitlines() if line.startswith("insns:")).split()[1])


# The block form's measurement: (name, in, out) of the expert matrices of bench/models.py's 100 M-class Mixtral.
BLOCK_LAYERS = [("expert w1", 512, 1408), ("expert w2", 1408, 512)]
BLOCK_DTYPES = {"q8": "q8b", "q4": "q4b"}  # kernel_insns's names: INT8_BLOCKS with I8, I4 in groups of 32
BLOCK_BATCHES = (1, 8)
# column: (qemu -cpu, kernel_insns's set, the kernel set it must report)
BLOCK_SETS = {"reference": ("cortex-a72", "ref", "reference"), "NEON v8.0": ("cortex-a72", "opt", "aarch64 neon"),
              "NEON SDOT": ("max", "opt", "aarch64 neon+dotprod")}
OUT = ROOT / "build" / "aarch64_insns"


def build_block_driver() -> tuple[Path, Path]:
    """bench/kernel_insns.c against the aarch64 library (the tests/c flags) and the counting plugin."""
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "firmware" / "colibri_core"), "aarch64"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    OUT.mkdir(parents=True, exist_ok=True)
    core = ROOT / "firmware" / "colibri_core"
    driver, plugin = OUT / "kernel_insns", OUT / "libinsn.so"
    subprocess.run(["aarch64-linux-gnu-gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2",
                    "-ffp-contract=off", "-fno-math-errno", f"-I{core / 'include'}", f"-I{core / 'src'}",
                    str(ROOT / "bench" / "kernel_insns.c"), str(core / "build" / "aarch64" / "libcolibri.a"), "-lm",
                    "-o", str(driver)], check=True)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(ROOT / "bench" / "qemu_insn_count.c"), "-o", str(plugin)],
                   check=True)
    return driver, plugin


def block_call(driver: Path, plugin: Path, kernel_set: str, dtype: str, n_in: int, n_out: int, n: int) -> int:
    """Instructions of one linear_blocks call (BLOCK_SETS name, BLOCK_DTYPES name)."""
    cpu, which, kernels = BLOCK_SETS[kernel_set]
    args = [str(driver), which, BLOCK_DTYPES[dtype], str(n_in), str(n_out), str(n)]
    return count(plugin, cpu, [*args, "2"], kernels) - count(plugin, cpu, [*args, "1"], kernels)


def block_counts(driver: Path, plugin: Path) -> dict[tuple[str, str, int, str], int]:
    """(dtype, layer, n, kernel set) -> instructions of one call, over BLOCK_DTYPES x BLOCK_LAYERS x
    BLOCK_BATCHES x BLOCK_SETS."""
    return {(dtype, layer, n, k): block_call(driver, plugin, k, dtype, n_in, n_out, n)
            for dtype in BLOCK_DTYPES for layer, n_in, n_out in BLOCK_LAYERS for n in BLOCK_BATCHES
            for k in BLOCK_SETS}


def print_blocks() -> None:
    driver, plugin = build_block_driver()
    counts = block_counts(driver, plugin)
    print("INT8_BLOCKS: instructions per linear_blocks call under qemu-aarch64 (emulated, not a performance figure)")
    print(f"{'dtype':<6}{'layer':<11}{'in->out':>10}{'n':>3}" + "".join(f"{k:>13}" for k in BLOCK_SETS)
          + "   per MAC (ref, v8.0, SDOT)")
    for dtype in BLOCK_DTYPES:
        for layer, n_in, n_out in BLOCK_LAYERS:
            for n in BLOCK_BATCHES:
                c = [counts[dtype, layer, n, k] for k in BLOCK_SETS]
                macs = n_in * n_out * n
                print(f"{dtype:<6}{layer:<11}{f'{n_in}->{n_out}':>10}{n:>3}" + "".join(f"{v:>13,}" for v in c)
                      + "   " + ", ".join(f"{v / macs:.3f}" for v in c), flush=True)


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
    if "--blocks" not in sys.argv[1:]:
        main()
    print_blocks()
