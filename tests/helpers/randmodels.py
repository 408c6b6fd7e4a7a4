"""Randomly drawn Colibri models for the sweep tests (seeded, so reproducible)."""
from __future__ import annotations

import numpy as np
import torch

from colibri import nn as cnn

ROUTINGS = cnn.ROUTINGS
ACTIVATIONS = cnn.ACTIVATIONS


def _size(rng: np.random.Generator, hi: int = 300) -> int:
    """Log-uniform in 1..hi, so small edge sizes come up as often as large ones."""
    return int(np.clip(round(np.exp(rng.uniform(0, np.log(hi)))), 1, hi))


def random_moe(rng: np.random.Generator, d: int) -> cnn.MoE:
    n = int(rng.integers(1, 17))
    routing = str(rng.choice(ROUTINGS))
    shared = int(rng.choice([0, 0, 1, 2]))
    return cnn.MoE(
        d, n, _size(rng, 128 if n > 8 else 300),
        top_k=int(rng.integers(1, n + 1)),
        routing=routing,
        renormalize=routing == "softmax_topk" and bool(rng.integers(2)),
        activation=str(rng.choice(ACTIVATIONS)),
        gated=bool(rng.integers(2)),
        expert_bias=bool(rng.integers(2)),
        router_bias=bool(rng.integers(2)),
        num_shared=shared,
        shared_hidden=_size(rng, 64),
        shared_gate=shared > 0 and bool(rng.integers(2)),
    )


def _norm(rng: np.random.Generator, d: int) -> torch.nn.Module:
    affine = bool(rng.integers(2))
    if rng.integers(2):
        return torch.nn.LayerNorm(d, eps=float(rng.choice([1e-5, 1e-6])), elementwise_affine=affine,
                                  bias=affine and bool(rng.integers(2)))
    return torch.nn.RMSNorm(d, eps=float(rng.choice([1e-6, 1e-5])) if rng.integers(2) else None,
                            elementwise_affine=affine)


def random_model(seed: int) -> tuple[torch.nn.Module, int, int]:
    """(model, input_size, max_batch) for one seed: Linear / norms / activations / MoE blocks."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    d_in = _size(rng)
    d = _size(rng)
    layers: list[torch.nn.Module] = []
    if d != d_in or rng.integers(2):
        layers.append(torch.nn.Linear(d_in, d, bias=bool(rng.integers(2))))
    else:
        d = d_in
    for _ in range(int(rng.integers(1, 3))):
        block: list[torch.nn.Module] = []
        if rng.integers(2):
            block.append(_norm(rng, d))
        block.append(random_moe(rng, d))
        layers.append(cnn.Residual(*block) if rng.integers(2) else torch.nn.Sequential(*block))
        if rng.integers(2):
            layers.append(cnn.make_activation(str(rng.choice(ACTIVATIONS))))
    if rng.integers(2):
        layers.append(_norm(rng, d))
    if rng.integers(2):
        layers.append(torch.nn.Linear(d, _size(rng), bias=bool(rng.integers(2))))
    model = torch.nn.Sequential(*layers).eval()
    # Training-like weight scales: default init keeps activations O(1) through the stack.
    return model, d_in, int(rng.integers(1, 17))
