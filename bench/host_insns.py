"""What the index bounds cost the x86-64 kernels: instructions per forward of the edge model, with and without.

    .venv/bin/python bench/host_insns.py

The engine bounds every index it reads in place from the image where it uses it (docs/threading.md
"A changed image"). To price those bounds this builds the host library twice, as shipped and as the core
Makefile's `nobounds` variant (COLIBRI_MEASURE_WITHOUT_BOUNDS: the same code trusting the image as
validated), links tests/c/colibri_kernels_e2e against each, exports the bench's edge model
(bench/models.py) at batch 1 in f32, q8 and q8 with int8 activations in the experts, and counts the
instructions of one forward with the optimised kernels under valgrind's callgrind: the instructions
inside colibri_forward (--toggle-collect) with one repetition of the optimised forward less those with
none. Valgrind reports no AVX-512 to the program, so the kernels counted are the AVX2 level
("x86-64 avx2+fma+f16c"); the counts are deterministic for a given compiler and valgrind.

Instruction counts, not time: they say how many instructions each build issues.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import models as M  # noqa: E402
from colibri.frontends.exporter import export  # noqa: E402

CORE = ROOT / "firmware" / "colibri_core"
BUILDS = ("host", "nobounds")  # as shipped, and without the bounds
VARIANTS = (("f32", {}), ("q8", {"dtype": "q8"}), ("q8i8", {"dtype": "q8", "int8_act": ["*.experts.*"]}))
KERNELS = "x86-64 avx2+fma+f16c"


def build(variant: str) -> Path:
    """tests/c's colibri_kernels_e2e against the variant's library (the library first: the driver's rule
    relinks only against a library already up to date)."""
    for args in (["-C", str(CORE), variant], ["-C", str(ROOT / "tests" / "c"), f"VARIANT={variant}",
                                              f"build/{variant}/colibri_kernels_e2e"]):
        r = subprocess.run(["make", "-s", "-j2", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"make {' '.join(args)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return ROOT / "tests" / "c" / "build" / variant / "colibri_kernels_e2e"


def collected(driver: Path, image: Path, reps: int) -> int:
    """Instructions callgrind counts inside colibri_forward: one reference forward, one optimised, and
    `reps` more optimised ones."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
                            "--toggle-collect=colibri_forward", str(driver), "--time", str(reps), "--only", "opt",
                            KERNELS, str(image)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"callgrind of {driver} {image.name} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return int(next(line for line in r.stderr.splitlines() if "Collected :" in line).split(":")[-1])


def measure() -> dict[str, dict[str, int]]:
    """Instructions per forward of the edge model at batch 1, by dtype and build."""
    drivers = {b: build(b) for b in BUILDS}
    out: dict[str, dict[str, int]] = {}
    module = M.edge()
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in VARIANTS:
            image = Path(tmp) / f"edge-{name}.clb"
            image.write_bytes(bytes(export(module, None, max_batch=1, **kw).image))
            x.tofile(f"{image}.in")
            out[name] = {b: collected(d, image, 1) - collected(d, image, 0) for b, d in drivers.items()}
    return out


def main() -> None:
    counts = measure()
    print("edge model, batch 1: instructions per forward under callgrind (AVX2 kernels), with and without "
          "the index bounds")
    print(f"{'dtype':<8}{'bounded':>12}{'unbounded':>12}{'bounds':>9}")
    for name, c in counts.items():
        print(f"{name:<8}{c['host']:>12,}{c['nobounds']:>12,}{c['host'] / c['nobounds'] - 1:>+9.2%}")


if __name__ == "__main__":
    main()
