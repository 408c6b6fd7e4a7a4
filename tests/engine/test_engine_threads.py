"""Many contexts of different models run forward at once, with the same answers as alone."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri.frontends.exporter import export

from helpers.build import build_c_tests
from helpers.randmodels import random_model


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("threads")
    paths = []
    for seed in (1, 2, 3, 4):
        model, _, max_batch = random_model(seed)
        p = d / f"m{seed}.clb"
        export(model, p, max_batch=max_batch)
        paths.append(p)
    return paths


@pytest.mark.sanitizer
def test_contexts_in_threads_under_threadsanitizer(images: list[Path]) -> None:
    drivers = build_c_tests("tsan")
    r = subprocess.run([str(drivers / "colibri_threads"), "8", "25", *map(str, images)],
                       capture_output=True, text=True, timeout=600,
                       env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "ThreadSanitizer" not in r.stderr
    assert "threads ok" in r.stdout


def test_python_threads_share_nothing(images: list[Path]) -> None:
    models = [colibri.Model(p) for p in images]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((m.max_batch, m.input_size)).astype(np.float32) for m in models]
    alone = [m.forward(x) for m, x in zip(models, inputs)]

    def work(i: int) -> bool:
        m, x = models[i % len(models)], inputs[i % len(models)]
        return all(np.array_equal(m.forward(x), alone[i % len(models)]) for _ in range(50))

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(work, range(32)))
