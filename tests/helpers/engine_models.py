"""The graphs quantised images are run through the C engine on, and the engine's tolerance against the
numpy reference on the same image (the quantisation tests for q8 and q4 share them)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

import colibri
from colibri import image, reference
from colibri.model.ir import Graph

from helpers.quant_models import graph_of, quickstart_model
from helpers.randmodels import random_model


def assert_engine_matches(img: bytes, x: np.ndarray) -> None:
    """The C engine's tolerance: max|Δ| ≤ 1e-5 · (1 + max|y|) against the reference on the same image."""
    want = reference.run(image.read(img), x)
    got = colibri.Model(img).forward(x)
    err, tol = float(np.abs(got - want).max()), 1e-5 * (1 + float(np.abs(want).max()))
    assert err <= tol, f"engine vs reference: max|Δ| {err:.3g} > {tol:.3g}"


def random_graph(seed: int) -> Graph:
    """helpers.randmodels.random_model(seed) with its own max_batch."""
    model, _, max_batch = random_model(seed)
    return graph_of(model, max_batch=max_batch)


ENGINE_MODELS: dict[str, Callable[[], Graph]] = {
    "quickstart": lambda: graph_of(quickstart_model()),
    **{f"random-{s}": (lambda s=s: random_graph(s)) for s in range(5)},
}
