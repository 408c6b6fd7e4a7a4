"""Inputs that probe the non-finite semantics on every target (docs/model-format.md, "Numerics")."""
from __future__ import annotations

import numpy as np

# NaN, ±inf, FLT_MAX-scale values whose sums and squares overflow, and subnormals.
NONFINITE = [float("nan"), float("inf"), -float("inf"), 1e38, -3e38, 1e-40, -2.5e-39]


def nonfinite_rows(seed: int, width: int, positions: tuple[int, ...]) -> np.ndarray:
    """Each NONFINITE value alone at each position of a random row, then a subnormal row, a
    FLT_MAX-scale row and an all-NaN row: float32 [len(NONFINITE) * len(positions) + 3, width]."""
    rng = np.random.default_rng(seed)
    rows = []
    for v in NONFINITE:
        for p in positions:
            r = rng.standard_normal(width)
            r[p] = v
            rows.append(r)
    rows += [rng.standard_normal(width) * 1e-39, rng.standard_normal(width) * 1e37, np.full(width, np.nan)]
    return np.array(rows, dtype=np.float32)
