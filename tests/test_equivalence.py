"""The C engine and the numpy reference agree with PyTorch on randomly drawn models.

Tolerance, as the engine promises: max |Δ| ≤ 1e-5 · (1 + max |y|) in f32.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import colibri
from colibri import reference
from colibri.frontends.exporter import export

from randmodels import random_model

N_CONFIGS = 300


def tol(y: np.ndarray) -> float:
    return 1e-5 * (1 + float(np.abs(y).max()))


@pytest.mark.parametrize("seed", range(N_CONFIGS))
def test_random_model_matches_pytorch(seed: int) -> None:
    model, d_in, max_batch = random_model(seed)
    rng = np.random.default_rng(10_000 + seed)
    batch = int(rng.integers(1, max_batch + 1))
    x = torch.from_numpy(rng.standard_normal((batch, d_in)).astype(np.float32))
    with torch.no_grad():
        want = model(x).numpy()
    result = export(model, None, max_batch=max_batch)
    engine = colibri.Model(result.image)
    got_c = engine.forward(x.numpy())
    got_ref = reference.run(colibri.image.read(result.image), x.numpy())
    assert got_c.shape == want.shape
    assert np.abs(got_ref - want).max() <= tol(want), "reference vs PyTorch"
    assert np.abs(got_c - want).max() <= tol(want), "C engine vs PyTorch"
    # max_batch is the most the arena holds: a full batch must run too.
    full = rng.standard_normal((max_batch, d_in)).astype(np.float32)
    with torch.no_grad():
        want_full = model(torch.from_numpy(full)).numpy()
    assert np.abs(engine.forward(full) - want_full).max() <= tol(want_full)


@pytest.mark.parametrize("page_aligned", [False, True])
def test_page_aligned_layout_same_answers(page_aligned: bool) -> None:
    model, d_in, max_batch = random_model(7)
    x = np.random.default_rng(1).standard_normal((max_batch, d_in)).astype(np.float32)
    plain = export(model, None, max_batch=max_batch).image
    paged = export(model, None, max_batch=max_batch, page_aligned=page_aligned).image
    np.testing.assert_array_equal(colibri.Model(plain).forward(x), colibri.Model(paged).forward(x))
    graph = colibri.image.read(paged)
    if page_aligned:
        for moe in graph.moe_layers():
            for e in moe.experts + moe.shared:
                offset = e.w1.__array_interface__["data"][0] - np.frombuffer(paged, np.uint8).__array_interface__["data"][0]
                assert offset % 4096 == 0
