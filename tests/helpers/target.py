"""The feature models the runner firmware is tested with, and how its answers must match the host engine."""
from __future__ import annotations

import numpy as np
import torch

from colibri import nn as cnn
from colibri.frontends.exporter import export

MAX_BATCH = 4


DTYPES = {
    "f32": {},
    "f16": {"dtype": "f16"},
    "q8": {"dtype": "q8"},
    "q8-int8-act": {"dtype": "q8", "int8_act": ["layers.*"]},
    # int4 weights (format v5): groups of 8 so the 12- and 16-wide layers have several
    "q4": {"dtype": "q4", "group": 8, "compensation": 0.02},
    "q4-int8-act": {"dtype": "q4", "group": 8, "int8_act": ["layers.*"]},
}


def make_model(routing: str, gated: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16),
        torch.nn.LayerNorm(16),
        cnn.Residual(cnn.MoE(16, 4, 24, top_k=2, routing=routing, renormalize=routing == "softmax_topk",
                             gated=gated, activation="silu" if gated else "gelu", num_shared=1, shared_gate=True)),
        torch.nn.Linear(16, 6),
    ).eval()


def model_image(routing: str, dtype: str) -> bytes:
    return export(make_model(routing), None, max_batch=MAX_BATCH, **DTYPES[dtype]).image


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The same float32 bits, and NaN exactly where the host has NaN. (The bits of a NaN are the
    FPU's: x86 makes 0xFFC00000 for inf - inf, Arm 0x7FC00000; both are NaN to every reader.)"""
    assert got.shape == want.shape, what
    nan = np.isnan(want)
    diff = np.flatnonzero((np.isnan(got) != nan) | (~nan & (got.view(np.uint32) != want.view(np.uint32))))
    assert not len(diff), (f"{what}: {len(diff)} of {got.size} outputs differ from the host engine, "
                           f"first at {diff[0]}: {got.flat[diff[0]]!r} != {want.flat[diff[0]]!r}")


# The device's optimised kernels (on the Cortex-M7: FPU-blocked f32/f16 with fused multiply-adds and
# another summation order, SMLAD int8) against the reference kernels, end to end through a model: the
# kernels' own tolerance (tests/c/cm7/kernel_test.c) carried through norms, gates and activations.
OPTIMISED_RTOL = 1e-4


def assert_close_to_reference(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The optimised kernels' outputs: NaN exactly where the reference has NaN, the same infinities, and
    every finite output within OPTIMISED_RTOL · (1 + max |y|) of its row."""
    assert got.shape == want.shape, what
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{what}: NaN where the reference kernels give none, or the reverse"
    inf = np.isinf(want)
    assert (got[inf] == want[inf]).all() and not np.isinf(got[~inf]).any(), f"{what}: infinities differ"
    fin = ~nan & ~inf
    scale = 1.0 + np.max(np.where(fin, np.abs(want), 0.0), axis=-1, keepdims=True)
    err = np.where(fin, np.abs(got.astype(np.float64) - want), 0.0) / scale
    assert err.max(initial=0.0) <= OPTIMISED_RTOL, f"{what}: optimised kernels off by {err.max():.2e} (relative)"
