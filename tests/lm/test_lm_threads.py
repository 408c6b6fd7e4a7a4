"""Token models on threads: colibri_lm_forward_ex (include/colibri.h) over colibri_pool against
colibri_lm_forward, by the C driver tests/c/colibri_lm_exec_test.c (every step's logits bit for bit,
with the optimised and the reference kernels, plain, under ASan+UBSan, under ThreadSanitizer and
(NEON) under qemu-aarch64;
colibri_model_size_ex exact; each failing callback's status), and through the bindings:
colibri.LM(workers=N) and `colibri generate --threads N` give the single-threaded logits and ids."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import colibri
from colibri import cli as colibri_cli
from colibri import image
from colibri.quant import quantize
from colibri.model.errors import ColibriError
from colibri.model.format import Status
from colibri.model.format import DType

from helpers import lmmodels
from helpers.build import build_c_tests

# Matrices large enough for decode to split them in row blocks (64 rows; from 2^17 weights a loop,
# colibri_engine.c LM_PAR_MIN_MACS), with partial last blocks: d 256, q 512 and k, v 128 rows, o
# 256 x 512, experts of 200 hidden rows, a 520-token head; 96 positions, so decode steps from
# position 31 on run the heads in parallel too.
SHAPE = dict(vocab=520, d=256, heads=8, kv_heads=2, hd=64, max_seq_len=96, max_batch=8, hidden=200)
CONFIGS = {
    "f32": dict(),
    "f32-bias-qknorm": dict(bias=True, qk_norm="head"),
    "f16-f16kv": dict(dtype="f16", kv_dtype=DType.F16),
    # q8 with biases: they move into the companion, whose matrices run whole (no row view).
    "q8-bias-tied": dict(dtype="q8", bias=True, tied=True),
    "q8-int8act": dict(dtype="q8", int8_act=["layers.*.experts.*"]),
    "q4": dict(dtype="q4"),
    # INT8_BLOCKS: decode's one-token kernels on each worker's row blocks, prefill's multi-token ones; the
    # attention projections too (q, k and v one loop over the shared int8 row of x, then o).
    "q8-int8blocks": dict(dtype="q8", int8_blocks=["layers.*"]),
    "q4-int8blocks": dict(dtype="q4", int8_blocks=["layers.*"]),
}


def _graph(seed: int, kw: dict, **shape):
    kw = dict(kw)
    dtype = kw.pop("dtype", "f32")
    int8_act = kw.pop("int8_act", ())
    int8_blocks = kw.pop("int8_blocks", ())
    g = lmmodels.token_model(seed, **{**SHAPE, **shape}, **kw)
    return quantize.quantize(g, dtype, int8_act=int8_act, int8_blocks=int8_blocks) if dtype != "f32" else g


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("lm_threads")
    paths = []
    for seed, (name, kw) in enumerate(CONFIGS.items()):
        p = folder / f"{name}.clb"
        p.write_bytes(image.write(_graph(seed, kw)))
        paths.append(p)
    return paths


def _driver(variant: str, images: list[Path], env: dict | None = None) -> None:
    drivers = build_c_tests(variant)
    r = subprocess.run([str(drivers / "colibri_lm_exec_test"), *map(str, images)], capture_output=True, text=True,
                       timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"lm exec ok: {len(images)} images" in r.stdout


@pytest.mark.parametrize("variant", ["host", pytest.param("asan", marks=[pytest.mark.slow, pytest.mark.sanitizer])])
def test_lm_forward_ex_matches_lm_forward(variant: str, images: list[Path]) -> None:
    _driver(variant, images)


@pytest.mark.slow
@pytest.mark.sanitizer
def test_lm_forward_ex_under_threadsanitizer(images: list[Path]) -> None:
    # f32, q8 with int8 activations, q4: every kind of task (row blocks with and without int8 rows,
    # expert blocks, heads, token chunks, parallel experts), at a third of the time of all six.
    picked = [p for p in images if p.stem in ("f32", "q8-int8act", "q4")]
    assert len(picked) == 3
    _driver("tsan", picked, env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})


@pytest.mark.slow
@pytest.mark.cross
@pytest.mark.skipif(shutil.which("qemu-aarch64") is None or shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="needs qemu-user and gcc-aarch64-linux-gnu (scripts/setup.sh)")
def test_lm_forward_ex_on_aarch64(images: list[Path]) -> None:
    """The NEON kernels' row blocks: f32 and q8 with int8 activations under qemu-aarch64."""
    drivers = build_c_tests("aarch64")
    picked = [p for p in images if p.stem in ("f32", "q8-int8act")]
    r = subprocess.run(["qemu-aarch64", "-cpu", "max", "-L", "/usr/aarch64-linux-gnu",
                        str(drivers / "colibri_lm_exec_test"), *map(str, picked)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"lm exec ok: {len(picked)} images" in r.stdout


def test_the_arena_for_workers_is_pinned(images: list[Path]) -> None:
    """colibri_model_size_ex's token-model share, byte for byte (f32, no int8 rows): each extra worker
    holds two hidden buffers [B, H] and one head's scores [max_seq_len]; the shared part the staging
    rows [B (K + S), W], the task table (N + S) x 3, one token's active experts' hidden rows
    [K + S, H] and a status per task (the most of any loop: here the 512 q rows bound the heads)."""
    data = images[0].read_bytes()
    one, two, three = (colibri.arena_size(data, workers=w) for w in (1, 2, 3))
    assert one == colibri.arena_size(data)
    B, L, W, H = SHAPE["max_batch"], SHAPE["max_seq_len"], SHAPE["vocab"], SHAPE["hidden"] + 4  # the dense FFN's
    K, S, N = 2, 1, 4
    per_worker = 2 * B * H * 4 + L * 4
    fixed = B * (K + S) * W * 4 + 64 + (K + S) * H * 4 + SHAPE["heads"] * SHAPE["hd"] * 4
    assert three - two == per_worker
    assert two - one == fixed + per_worker
    assert (N + S) * 3 * 4 == 60  # the task table, rounded up to 64 above


@pytest.mark.parametrize("name", ["f32", "q8-int8act"])
def test_lm_workers_binding_is_bit_identical(name: str) -> None:
    data = image.write(_graph(7, CONFIGS[name]))
    one = colibri.LM(data)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, SHAPE["vocab"], 11)
    steps = [int(t) for t in rng.integers(0, SHAPE["vocab"], 40)]
    want = np.concatenate([one.forward_tokens(prompt), *(one.forward_tokens([t]) for t in steps)])
    for workers in (2, 3):
        lm = colibri.LM(data, workers=workers)
        assert lm.workers == workers and lm.arena_size == colibri.arena_size(data, workers=workers) > one.arena_size
        got = np.concatenate([lm.forward_tokens(prompt), *(lm.forward_tokens([t]) for t in steps)])
        assert got.tobytes() == want.tobytes()
        assert lm.generate(prompt, 30, temperature=0.8, top_k=20, seed=3) == \
            one.generate(prompt, 30, temperature=0.8, top_k=20, seed=3)
        assert list(lm.stream(prompt, 12)) == one.generate(prompt, 12)


def test_lm_workers_must_be_a_positive_count() -> None:
    data = image.write(_graph(8, CONFIGS["f32"]))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="workers must be a positive int"):
            colibri.LM(data, workers=bad)
    with pytest.raises(ColibriError) as err:  # more than a colibri_pool starts
        colibri.LM(data, workers=1000)
    assert err.value.status == Status.BAD_EXEC


def test_generate_threads_cli(tmp_path: Path) -> None:
    p = tmp_path / "m.clb"
    p.write_bytes(image.write(_graph(9, CONFIGS["f32"], vocab=256)))  # the byte tokenizer's
    outs = []
    for threads in ("1", "2"):
        r = CliRunner().invoke(colibri_cli.main, ["generate", str(p), "--prompt", "Hello", "--max-new-tokens", "20",
                                                  "--temperature", "0.9", "--seed", "4", "--threads", threads])
        assert r.exit_code == 0, r.output
        outs.append(r.output)
    assert outs[0] == outs[1] and len(outs[0]) > len("Hello")
    r = CliRunner().invoke(colibri_cli.main, ["generate", str(p), "--prompt", "Hello", "--threads", "0"])
    assert r.exit_code != 0 and "--threads" in r.output
