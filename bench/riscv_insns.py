"""Instructions per multiply-accumulate of the meter and edge models' linear layers under
qemu-riscv64: the RVV kernels at VLEN 128 and 256 against the scalar rv64gc build.

    .venv/bin/python bench/riscv_insns.py        (make bench-riscv-insns)

Builds the engine for rv64gcv (RVV backend) and rv64gc (no vector unit: reference kernels) with
clang-16, the driver bench/kernel_insns.c against each, and the QEMU plugin counting executed
guest instructions (bench/qemu_insn_count.c). Each layer shape of bench/models.py's meter
(48->32, the experts' 32->64 and 64->32, 32->24) and edge (256->256, the experts' 256->1024 and
1024->256) models runs as one `linear` call over 1 and 8 token rows, with f32, f16 and int8
weights (f32 activations) and int8 weights with int8 activations (the quantiser not counted).
Per call = (count with 1 + R calls - count with 1 call) / R; per MAC = per call / (in · out · n).

Instructions of the emulated CPU, not cycles: one RVV instruction is counted once whatever its
vector length and LMUL, so these say how many instructions each build issues per MAC, nothing
about the time of any RISC-V core (none was run here).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "firmware" / "colibri_core"
OUT = ROOT / "build" / "riscv_insns"
CC = ["clang-16", "--target=riscv64-linux-gnu", "--sysroot=/usr/riscv64-linux-gnu", "--gcc-toolchain=/usr"]
# The tests/c flags of the same variants (tests/c/Makefile).
BUILDS = {"riscv64": ["-march=rv64gcv", "-fno-vectorize", "-fno-slp-vectorize"], "riscv64gc": ["-march=rv64gc"]}
# column: (build, qemu -cpu, the kernel set the driver must report)
TARGETS = {
    "rv64gc": ("riscv64gc", "rv64,v=false", "reference"),
    "RVV 128": ("riscv64", "rv64,v=true,vlen=128", "riscv rvv"),
    "RVV 256": ("riscv64", "rv64,v=true,vlen=256", "riscv rvv"),
}
LAYERS = [("meter", "in", 48, 32), ("meter", "expert w1", 32, 64), ("meter", "expert w2", 64, 32),
          ("meter", "out", 32, 24), ("edge", "in", 256, 256), ("edge", "expert w1", 256, 1024),
          ("edge", "expert w2", 1024, 256)]
DTYPES = {"f32": "f32", "f16": "f16", "q8": "q8", "q8 int8-act": "q8q8"}
BATCHES = (1, 8)
MACS_PER_RUN = 2_000_000  # R = this / (in · out · n), at least 1: a few seconds of emulation per layer


def build() -> tuple[dict[str, Path], Path]:
    r = subprocess.run(["make", "-s", "-C", str(CORE), *BUILDS], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    OUT.mkdir(parents=True, exist_ok=True)
    drivers = {}
    for variant, flags in BUILDS.items():
        exe = OUT / f"kernel_insns-{variant}"
        subprocess.run([*CC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2", *flags,
                        "-ffp-contract=off", "-fno-math-errno", "-static", f"-I{CORE / 'include'}",
                        f"-I{CORE / 'src'}", str(ROOT / "bench" / "kernel_insns.c"),
                        str(CORE / "build" / variant / "libcolibri.a"), "-lm", "-o", str(exe)], check=True)
        drivers[variant] = exe
    plugin = OUT / "libinsn.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(ROOT / "bench" / "qemu_insn_count.c"), "-o", str(plugin)],
                   check=True)
    return drivers, plugin


def count(plugin: Path, cpu: str, exe: Path, kernels: str, args: list[str]) -> int:
    r = subprocess.run(["qemu-riscv64", "-cpu", cpu, "-plugin", str(plugin), "-d", "plugin", str(exe), *args],
                       capture_output=True, text=True, check=True)
    assert f"kernels: {kernels} " in r.stdout, r.stdout
    return int(next(line for line in (r.stdout + r.stderr).splitlines() if line.startswith("insns:")).split()[1])


def main() -> None:
    drivers, plugin = build()
    print("instructions per multiply-accumulate, one linear call under qemu-riscv64 "
          "(emulated instructions, not cycles; no hardware)")
    print(f"{'model':<7}{'layer':<11}{'in->out':>10}  {'dtype':<12}{'n':>3}"
          + "".join(f"{t:>10}" for t in TARGETS) + "  scalar/RVV 128, /RVV 256")
    for model, layer, n_in, n_out in LAYERS:
        for dtype, arg in DTYPES.items():
            for n in BATCHES:
                macs = n_in * n_out * n
                reps = max(1, MACS_PER_RUN // macs)
                per_mac = {}
                for name, (variant, cpu, kernels) in TARGETS.items():
                    base = [n_in, n_out, n]
                    one = count(plugin, cpu, drivers[variant], kernels, ["opt", arg, *map(str, base), "1"])
                    more = count(plugin, cpu, drivers[variant], kernels, ["opt", arg, *map(str, base), str(1 + reps)])
                    per_mac[name] = (more - one) / reps / macs
                s, v1, v2 = per_mac["rv64gc"], per_mac["RVV 128"], per_mac["RVV 256"]
                print(f"{model:<7}{layer:<11}{f'{n_in}->{n_out}':>10}  {dtype:<12}{n:>3}"
                      + "".join(f"{per_mac[t]:>10.3f}" for t in TARGETS) + f"  {s / v1:>8.1f}× {s / v2:>7.1f}×",
                      flush=True)


if __name__ == "__main__":
    main()
