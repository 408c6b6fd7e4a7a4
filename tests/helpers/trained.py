"""A small MoE classifier trained on real data, for tests that need trained (not random) weights.

Quantisation error depends on the weight distribution and on how decisively
the router picks its experts; random weights are a poor proxy for either.
This trains Linear(64→32) → LayerNorm → Residual(MoE(32, 4 SwiGLU experts,
top-2)) → Linear(32→10) on scikit-learn's handwritten digits (1797 real 8×8
images shipped inside the package, no download), seeded, in about a second
of CPU. `digits_classifier()` is cached, so every test in a process shares
one training run.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from colibri import nn as cnn
from colibri.frontends.exporter import build_graph
from colibri.model.ir import Graph

TEST_SHARE = 0.25  # held-out share of the 1797 images (450 test images)
STEPS = 300
BATCH = 128
LEARNING_RATE = 3e-3
MAX_BATCH = 16


@dataclass(frozen=True)
class TrainedClassifier:
    """The trained module, its exported f32 graph and the held-out split (x in [0, 1], labels 0..9)."""

    model: torch.nn.Module
    graph: Graph
    x_test: np.ndarray  # float32 [n, 64]
    y_test: np.ndarray  # int64 [n]
    train_accuracy: float


def _digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): pixels scaled to [0, 1], a seeded random split."""
    from sklearn.datasets import load_digits  # imported here: only the tests that train need scikit-learn

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(TEST_SHARE * len(x)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32),
        torch.nn.LayerNorm(32),
        cnn.Residual(cnn.MoE(32, 4, 64, top_k=2, routing="topk_softmax", gated=True, activation="silu",
                             expert_bias=False)),
        torch.nn.Linear(32, 10),
    )


@contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny matrices gain nothing from intra-op threads, and under `pytest -n 2` on two cores
    the workers' OpenMP threads oversubscribe them: training then took minutes instead of a second."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def digits_classifier(seed: int = 0) -> TrainedClassifier:
    """Train with Adam on seeded minibatches; the result is deterministic for a seed on a given build."""
    with _one_thread():
        return _train(seed)


def _train(seed: int) -> TrainedClassifier:
    x_train, y_train, x_test, y_test = _digits(seed)
    model = _build(seed)
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    xs, ys = torch.from_numpy(x_train), torch.from_numpy(y_train)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(STEPS):
        idx = torch.randint(0, len(xs), (BATCH,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        train_accuracy = float((model(xs).argmax(dim=1) == ys).float().mean())
        graph, _ = build_graph(model, max_batch=MAX_BATCH)
    return TrainedClassifier(model, graph, x_test, y_test, train_accuracy)
