"""The optimised kernels against the reference kernels (docs/model-format.md "Numerics").

Kernel by kernel: the C driver tests/c/colibri_kernels_x86.c (random shapes with odd sizes and
tails, 1..9 tokens with and without the rows index list, linear and linear_acc, bias, gates,
NaN/±inf/1e38/subnormal inputs, and E's tables changed after validation), built normally and with
AddressSanitizer + UBSan. End to end:
colibri.Model(image) against colibri.Model(image, reference_kernels=True) on random models in
f32, f16 and q8 (f32 and int8 activations): non-finite values in the same places, finite values
within the end-to-end tolerance below.
"""
from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri.frontends.exporter import export

from helpers.randmodels import random_model


def cpu_has_avx2_fma_f16c() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags.split(":", 1)[1].split())


X86 = platform.machine() in ("x86_64", "AMD64") and cpu_has_avx2_fma_f16c()


def test_kernel_driver_against_reference(c_drivers: Path) -> None:
    trials = "3000" if c_drivers.name == "host" else "800"
    for seed in ("1", "2"):
        r = subprocess.run([str(c_drivers / "colibri_kernels_x86"), trials, seed], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        assert "kernels ok" in r.stdout
        if X86:  # the AVX2 level always, AVX-512F too where the CPU has it
            assert "kernels: x86-64 avx2+fma+f16c\n  0 failures" in r.stdout
            assert "optimised kernels: x86-64 avx" in r.stdout
        # E's tables changed after validation (columns past cols, row pointers past nnz or decreasing, NaN
        # beyond every table): at every level tested, wrong numbers at worst, never a read outside them.
        levels = r.stdout.count("kernels: ") - r.stdout.count("optimised kernels: ")
        assert r.stdout.count(" reads outside\n") == levels and " 0 cases" not in r.stdout, r.stdout
        assert all(line.endswith(" 0 reads outside") for line in r.stdout.splitlines() if "changed tables" in line)


def test_backend_neutral_kernel_driver(c_drivers: Path) -> None:
    """tests/c/colibri_kernel_test.c, the driver every backend runs (under qemu-aarch64 for NEON,
    tests/kernels/test_kernels_aarch64.py): this build's optimised table against the reference, its own shapes
    (edge-sized layers, int8 weights of -128, page-guarded buffers) and tolerances."""
    r = subprocess.run([str(c_drivers / "colibri_kernel_test")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " 0 failures" in r.stdout
    if X86:
        assert "kernels: x86-64 avx" in r.stdout


def test_q4_kernel_driver(c_drivers: Path) -> None:
    """tests/c/colibri_q4_test.c: I4 matrices built directly (every group size 2^3..2^8, odd columns and
    partial last groups, E and the companion bias present or absent, NaN/inf inputs): the reference
    kernels against a double-precision evaluation of the format's definition, then every x86-64 level
    the CPU has against the reference (int8 activations bit for bit, f32 within the q8 tolerance), and each
    with E's tables changed after validation (tests/c/colibri_changed_tables.h)."""
    r = subprocess.run([str(c_drivers / "colibri_q4_test")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "reference vs definition: 480 cases" in r.stdout and " 0 failures" in r.stdout, r.stdout
    # E's tables changed after validation, at every level and in the reference: no read outside them.
    assert re.search(r"^changed tables: \d{3} cases, 0 reads outside$", r.stdout, re.M), r.stdout
    if X86:
        assert "x86-64 avx2+fma+f16c vs reference: f32-act worst err/tol" in r.stdout, r.stdout


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_block_kernel_driver(c_drivers: Path) -> None:
    """tests/c/colibri_blocks_test.c: INT8_BLOCKS on I8 and I4 matrices built directly (random shapes with
    tails, every group size, E and biases present or absent, blocks of very different magnitudes, zero,
    subnormal, NaN/inf): the reference quantiser and kernels against the definition, then every x86-64
    level the CPU has (AVX2, AVX-VNNI, AVX-512 VNNI, each forced) bit for bit against the reference, and
    each of them with E's tables changed after validation (tests/c/colibri_changed_tables.h)."""
    r = subprocess.run([str(c_drivers / "colibri_blocks_test")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "blocks: 360 cases" in r.stdout and " 0 failures" in r.stdout, r.stdout
    # E's tables changed after validation, at every level and in the reference: no read outside them.
    assert re.search(r"^changed tables: \d{3} cases, 0 reads outside$", r.stdout, re.M), r.stdout
    if X86:
        flags = _cpu_flags()
        levels = ["x86 AVX2"] + (["x86 AVX-VNNI"] if "avx_vnni" in flags else []) + (
            ["x86 AVX-512 VNNI"] if {"avx512_vnni", "avx512bw", "avx512vl"} <= flags else [])
        for level in levels:
            assert f"block kernels: {level}\n" in r.stdout, (level, r.stdout)


@pytest.fixture(scope="module")
def small_image() -> bytes:
    model, _, max_batch = random_model(3)
    return export(model, None, max_batch=max_batch).image


def test_kernel_names(small_image: bytes) -> None:
    assert colibri.Model(small_image, reference_kernels=True).kernels == "reference"
    name = colibri.Model(small_image).kernels
    if X86:
        assert name in ("x86-64 avx2+fma+f16c", "x86-64 avx512f+avx2+fma+f16c", "x86-64 avx512f+vnni+avx2+fma+f16c")


def tol(y: np.ndarray, rel: float) -> float:
    finite = y[np.isfinite(y)]
    return rel * (1 + float(np.abs(finite).max() if finite.size else 0.0))


# Relative end-to-end tolerance of optimised vs reference kernels, max |Δ| <= rel · (1 + max |y|)
# (measured on seeds 0..59: at most 8.4e-7): the sums differ in order only (the kernel
# tolerance, carried through the layers). With int8 activations the int8 products are exact,
# but a layer's input can differ in its last bits and requantising it can then move one int8
# activation by one step: a wider margin there.
END_TO_END = {"f32": 1e-5, "f16": 1e-5, "q8": 1e-5, "q8-int8-act": 1e-4}


@pytest.mark.parametrize("variant", list(END_TO_END))
@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_model_optimised_vs_reference_kernels(seed: int, variant: str) -> None:
    model, d_in, max_batch = random_model(seed)
    dtype = variant.split("-")[0]
    kw = {"int8_act": ["*"]} if variant == "q8-int8-act" else {}
    image = export(model, None, max_batch=max_batch, dtype=dtype, check=False, **kw).image
    rng = np.random.default_rng(20_000 + seed)
    x = rng.standard_normal((max_batch, d_in)).astype(np.float32)
    if seed % 2:
        x[0, int(rng.integers(d_in))] = np.nan
        x[-1, int(rng.integers(d_in))] = np.float32(1e38) if max_batch > 1 else np.nan
    opt, ref = colibri.Model(image), colibri.Model(image, reference_kernels=True)
    got, want = opt.forward(x), ref.forward(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    both = np.isfinite(want)
    assert np.abs(got[both] - want[both]).max(initial=0.0) <= tol(want, END_TO_END[variant])
    # Batch 1 (the GEMV path) as well.
    np.testing.assert_allclose(opt.forward(x[-1:]), ref.forward(x[-1:]), rtol=0,
                               atol=tol(want[-1:], END_TO_END[variant]))
