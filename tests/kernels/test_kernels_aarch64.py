"""The AArch64 NEON kernel backend under qemu-aarch64 (there is no aarch64 CPython here).

The C test drivers are cross-built with aarch64-linux-gnu-gcc (tests/c VARIANT=aarch64, the
engine with its default AArch64 backend, NEON) and run under Debian's qemu-aarch64 twice:
`-cpu cortex-a72` (ARMv8.0, a Raspberry Pi 4: no SDOT, no fp16 arithmetic, so the ARMv8.0
fallbacks) and `-cpu max` (SDOT and fp16), each asserting which kernels colibri_init chose.

- colibri_kernel_test: every NEON kernel against its reference kernel on random shapes
  (odd sizes and tails, n = 1..9 with and without the rows list, linear and linear_acc, NaN
  and ±inf); tolerance stated in that file (the dot-product reordering bound), the quantiser,
  ReLU and the int8 × int8 linear kernels bit-exact.
- colibri_blocks_test: the INT8_BLOCKS kernels (ARMv8.0 on both CPUs, SDOT on `max`) against the
  reference bit for bit.
- colibri_kernels_e2e over a corpus of exported images (fuzz/corpus/differential and models
  exported here covering f32, f16, q8, q8 with int8 activations and q8 and q4 with INT8_BLOCKS
  activations under every routing mode):
  the aarch64 build's reference kernels give the x86-64 host's reference output bit for bit
  (colibri.Model(img, reference_kernels=True)), and the NEON kernels agree within E2E_RTOL.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri

from helpers.build import ROOT, build_c_tests
from helpers.qemu_user import BATCH, E2E_RTOL, corpus_images, qemu_aarch64, same_bits

pytestmark = [pytest.mark.qemu, pytest.mark.cross]

CPUS = {"cortex-a72": "aarch64 neon", "max": "aarch64 neon+dotprod"}


@pytest.fixture(scope="module")
def aarch64_drivers() -> Path:
    return build_c_tests("aarch64")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """The images with their inputs (.in) in one folder, and the host's reference outputs."""
    folder = tmp_path_factory.mktemp("aarch64-corpus")
    rng = np.random.default_rng(10)
    expected = {}
    for k, (name, img) in enumerate(corpus_images()):
        host = colibri.Model(img, reference_kernels=True)
        batch = min(BATCH, host.max_batch)
        x = rng.standard_normal((batch, host.input_size)).astype(np.float32)
        if k % 2 and batch >= 3:  # non-finite inputs in half the images: NaN and inf must behave as the reference
            x[1, 0] = np.nan
            x[2, -1] = np.inf
        (folder / f"{name}.clb").write_bytes(img)
        (folder / f"{name}.clb.in").write_bytes(x.tobytes())
        expected[name] = host.forward(x)
    return folder, expected


@pytest.mark.parametrize("cpu", list(CPUS))
def test_neon_kernels_match_reference(aarch64_drivers: Path, cpu: str) -> None:
    r = qemu_aarch64(cpu, str(aarch64_drivers / "colibri_kernel_test"), CPUS[cpu])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kernels: {CPUS[cpu]}" in r.stdout
    assert " 0 failures" in r.stdout


@pytest.mark.parametrize("cpu", list(CPUS))
def test_neon_q4_kernels_match_reference(aarch64_drivers: Path, cpu: str) -> None:
    """tests/c/colibri_q4_test.c under qemu-aarch64: the I4 reference kernels against the format's
    definition, the NEON ones against the reference (int8 activations bit for bit)."""
    r = qemu_aarch64(cpu, str(aarch64_drivers / "colibri_q4_test"), CPUS[cpu])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kernels: {CPUS[cpu]}" in r.stdout
    assert f"{CPUS[cpu]} vs reference: f32-act" in r.stdout and " 0 failures" in r.stdout, r.stdout


# The block-form configurations colibri_blocks_test compares with the reference on each CPU: the ARMv8.0
# kernels everywhere (colibri_kernels_neon_caps without SDOT), the SDOT ones where the CPU has dotprod.
BLOCK_CONFIGS = {"cortex-a72": ["aarch64 neon (ARMv8.0)"],
                 "max": ["aarch64 neon (ARMv8.0)", "aarch64 neon+dotprod (SDOT)"]}


@pytest.mark.slow
@pytest.mark.parametrize("cpu", list(CPUS))
def test_neon_block_kernels_match_reference(aarch64_drivers: Path, cpu: str) -> None:
    """tests/c/colibri_blocks_test.c under qemu-aarch64: the INT8_BLOCKS reference kernels against the format's
    definition, and the NEON block kernels (the quantiser, linear and linear_acc, I8 and I4, one token and
    several) against the reference bit for bit on random shapes with tails, with and without E, and with E's
    tables changed after validation (nothing read outside them or x)."""
    r = qemu_aarch64(cpu, str(aarch64_drivers / "colibri_blocks_test"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    chosen = [line.removeprefix("block kernels: ") for line in r.stdout.splitlines()
              if line.startswith("block kernels: ")]
    assert chosen == BLOCK_CONFIGS[cpu], r.stdout
    assert " 0 failures" in r.stdout and ", 0 reads outside" in r.stdout, r.stdout


@pytest.mark.parametrize("cpu", list(CPUS))
def test_neon_end_to_end(aarch64_drivers: Path, corpus, tmp_path: Path, cpu: str) -> None:
    folder, expected = corpus
    for f in folder.iterdir():  # a copy per CPU, so parallel workers never share outputs
        if f.suffix in (".clb", ".in"):
            shutil.copy(f, tmp_path / f.name)
    paths = [str(tmp_path / f"{name}.clb") for name in expected]
    r = qemu_aarch64(cpu, str(aarch64_drivers / "colibri_kernels_e2e"), CPUS[cpu], *paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(f"kernels {CPUS[cpu]}") == len(paths)
    worst = 0.0
    for name, want in expected.items():
        ref = np.fromfile(tmp_path / f"{name}.clb.ref.out", dtype=np.float32).reshape(want.shape)
        opt = np.fromfile(tmp_path / f"{name}.clb.opt.out", dtype=np.float32).reshape(want.shape)
        assert same_bits(ref, want), f"{name}: aarch64 reference kernels differ from the x86-64 host's"
        assert np.array_equal(np.isnan(opt), np.isnan(ref)), f"{name}: NaN where the reference has none (or v.v.)"
        fin = np.isfinite(ref)
        assert np.array_equal(opt[~fin & ~np.isnan(ref)], ref[~fin & ~np.isnan(ref)]), f"{name}: ±inf differs"
        err = np.abs(opt[fin] - ref[fin]) / (1.0 + np.abs(ref[fin]))
        if err.size:
            worst = max(worst, float(err.max()))
            assert err.max() <= E2E_RTOL, f"{name}: NEON differs from the reference by {err.max():.3g}"
    print(f"{cpu}: {len(paths)} images, worst NEON deviation {worst:.3g} (relative to 1 + |ref|)")


def test_block_instruction_counts() -> None:
    """bench/aarch64_insns.py's INT8_BLOCKS measurement on a small shape: the counting plugin loads under
    qemu-aarch64, one call's count is linear in the calls made (whole calls, nothing else, counted), and per
    dtype the SDOT kernels issue fewer instructions than the ARMv8.0 ones, which issue far fewer than the
    reference (docs/measured.md pins the full-size figures)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import aarch64_insns as A  # noqa: PLC0415

    driver, plugin = A.build_block_driver()
    for dtype in A.BLOCK_DTYPES:
        per_call = {}
        for kernel_set, (cpu, which, kernels) in A.BLOCK_SETS.items():
            args = [str(driver), which, A.BLOCK_DTYPES[dtype], "200", "44", "3"]
            one, two, three = (A.count(plugin, cpu, [*args, str(c)], kernels) for c in (1, 2, 3))
            assert three - two == two - one > 0, (dtype, kernel_set)
            per_call[kernel_set] = two - one
        assert per_call["NEON SDOT"] < per_call["NEON v8.0"] < per_call["reference"] / 5, (dtype, per_call)
