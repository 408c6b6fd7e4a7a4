"""The RISC-V Vector (RVV 1.0) kernel backend and the scalar RV64 build under qemu-riscv64.

The C test drivers are cross-built with clang-16 (tests/c VARIANT=riscv64: -march=rv64gcv, the
engine's default backend there, RVV; VARIANT=riscv64gc: no vector unit, so the reference kernels
only) and run under Debian's qemu-riscv64 (there is no riscv64 CPython here, nor hardware):

- the rv64gcv build at `-cpu rv64,v=true,vlen=128` and `vlen=256`: one binary, vector-length
  agnostic kernels, two vector lengths;
- the rv64gc build at `-cpu rv64,v=false`, which must pass on its own (the reference kernels as
  the optimised set, so every comparison is exact).

colibri_kernel_test checks every optimised kernel against its reference kernel (tolerance stated
in that file: the dot-product reordering bound; the quantiser, ReLU, mul/add and the int8 × int8
linear kernels bit-exact). colibri_kernels_e2e runs the corpus of tests/kernels/test_kernels_aarch64.py (the
differential fuzz corpus and models exported as f32, f16, q8 and q8 with int8 activations under
every routing mode): the RISC-V build's reference kernels give the x86-64 host's reference output
bit for bit, and the RVV kernels agree within E2E_RTOL.
"""
from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from helpers.build import ROOT, build_c_tests
from helpers.qemu_user import BATCH, E2E_RTOL, corpus_images, qemu_riscv64, same_bits

pytestmark = [pytest.mark.qemu, pytest.mark.cross]

# (tests/c variant, qemu -cpu, the kernel set colibri_init must choose)
TARGETS = {
    "rvv-vlen128": ("riscv64", "rv64,v=true,vlen=128", "riscv rvv"),
    "rvv-vlen256": ("riscv64", "rv64,v=true,vlen=256", "riscv rvv"),
    "rv64gc": ("riscv64gc", "rv64,v=false", "reference"),
}


@pytest.fixture(scope="module")
def riscv_drivers() -> dict[str, Path]:
    return {variant: build_c_tests(variant) for variant in ("riscv64", "riscv64gc")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """The images with their inputs (.in) in one folder, and the host's reference outputs."""
    folder = tmp_path_factory.mktemp("riscv-corpus")
    rng = np.random.default_rng(11)
    expected = {}
    for k, (name, img) in enumerate(corpus_images()):
        host = colibri.Model(img, reference_kernels=True)
        batch = min(BATCH, host.max_batch)
        x = rng.standard_normal((batch, host.input_size)).astype(np.float32)
        if k % 2 and batch >= 3:  # non-finite inputs in half the images
            x[1, 0] = np.nan
            x[2, -1] = np.inf
        (folder / f"{name}.clb").write_bytes(img)
        (folder / f"{name}.clb.in").write_bytes(x.tobytes())
        expected[name] = host.forward(x)
    return folder, expected


def test_rvv_build_uses_vector_instructions(riscv_drivers: dict[str, Path]) -> None:
    """The rv64gcv engine executes RVV instructions: on a CPU without the V extension it dies of
    an illegal instruction (the rv64gc build passes there: test_riscv_kernels_match_reference)."""
    r = qemu_riscv64("rv64,v=false", str(riscv_drivers["riscv64"] / "colibri_kernel_test"))
    assert r.returncode == -signal.SIGILL, (r.returncode, r.stdout + r.stderr)


@pytest.mark.parametrize("target", list(TARGETS))
def test_riscv_kernels_match_reference(riscv_drivers: dict[str, Path], target: str) -> None:
    variant, cpu, kernels = TARGETS[target]
    r = qemu_riscv64(cpu, str(riscv_drivers[variant] / "colibri_kernel_test"), kernels)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kernels: {kernels}" in r.stdout
    assert " 0 failures" in r.stdout


@pytest.mark.parametrize("target", list(TARGETS))
def test_riscv_block_kernels_match_reference(riscv_drivers: dict[str, Path], target: str) -> None:
    """tests/c/colibri_blocks_test.c under qemu-riscv64: the INT8_BLOCKS reference kernels meet the format's
    definition, and the RVV block kernels (quantiser, linear, linear_acc; I8 and I4) give their bits on random
    shapes with tails, with and without E, and read nothing outside E's changed tables or x. The scalar rv64gc
    build keeps the reference's."""
    variant, cpu, kernels = TARGETS[target]
    r = qemu_riscv64(cpu, str(riscv_drivers[variant] / "colibri_blocks_test"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"block kernels: {kernels}" in r.stdout, r.stdout
    assert ("(the reference's: the backend has none)" in r.stdout) == (kernels == "reference"), r.stdout
    assert " 0 failures" in r.stdout and ", 0 reads outside" in r.stdout, r.stdout


@pytest.mark.parametrize("target", list(TARGETS))
def test_riscv_end_to_end(riscv_drivers: dict[str, Path], corpus, tmp_path: Path, target: str) -> None:
    variant, cpu, kernels = TARGETS[target]
    folder, expected = corpus
    for f in folder.iterdir():  # a copy per target, so parallel workers never share outputs
        if f.suffix in (".clb", ".in"):
            shutil.copy(f, tmp_path / f.name)
    paths = [str(tmp_path / f"{name}.clb") for name in expected]
    r = qemu_riscv64(cpu, str(riscv_drivers[variant] / "colibri_kernels_e2e"), kernels, *paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(f"kernels {kernels}") == len(paths)
    worst = 0.0
    for name, want in expected.items():
        ref = np.fromfile(tmp_path / f"{name}.clb.ref.out", dtype=np.float32).reshape(want.shape)
        opt = np.fromfile(tmp_path / f"{name}.clb.opt.out", dtype=np.float32).reshape(want.shape)
        assert same_bits(ref, want), f"{name}: {target} reference kernels differ from the x86-64 host's"
        if kernels == "reference":
            assert same_bits(opt, ref), f"{name}: {target} optimised set (the reference) differs from itself"
            continue
        assert np.array_equal(np.isnan(opt), np.isnan(ref)), f"{name}: NaN where the reference has none (or v.v.)"
        fin = np.isfinite(ref)
        assert np.array_equal(opt[~fin & ~np.isnan(ref)], ref[~fin & ~np.isnan(ref)]), f"{name}: ±inf differs"
        err = np.abs(opt[fin] - ref[fin]) / (1.0 + np.abs(ref[fin]))
        if err.size:
            worst = max(worst, float(err.max()))
            assert err.max() <= E2E_RTOL, f"{name}: RVV differs from the reference by {err.max():.3g}"
    print(f"{target}: {len(paths)} images, worst deviation from the reference {worst:.3g} (relative to 1 + |ref|)")


def test_instruction_counts_per_mac(riscv_drivers: dict[str, Path]) -> None:
    """bench/riscv_insns.py's measurement on one edge layer: the counting plugin loads under
    qemu-riscv64, one call's count is linear in the calls made, and the RVV kernels issue fewer
    instructions per MAC than the scalar build, fewer still at VLEN 256 than at 128."""
    sys.path.insert(0, str(ROOT / "bench"))
    import riscv_insns as R  # noqa: PLC0415

    drivers, plugin = R.build()
    shape = ["1024", "256", "2"]
    per_mac = {}
    for name, (variant, cpu, kernels) in R.TARGETS.items():
        one, two, three = (R.count(plugin, cpu, drivers[variant], kernels, ["opt", "f32", *shape, str(c)])
                           for c in (1, 2, 3))
        assert three - two == two - one > 0, name  # whole calls, nothing else, counted
        per_mac[name] = (two - one) / (1024 * 256 * 2)
    assert per_mac["RVV 256"] < per_mac["RVV 128"] < per_mac["rv64gc"] / 4, per_mac
