"""The accelerator-hook model: the network, its weight dtypes and batch, and how close a device that
computes its experts itself (numpy, or a Rust closure) must come to the engine."""
from __future__ import annotations

import torch

from colibri import nn as cnn

BATCH = 12


# |hook - engine| <= TOLERANCE · (1 + max |engine output|), per model. The numpy device sums in
# another order than the engine's kernels (and widens f16 / dequantises int8 once, up front), so
# only f32 rounding separates them. Measured (-s prints it): 1.3e-8 for each dtype, optimised and
# reference kernels alike, i.e. one rounding of an output of 0.17; the bound leaves ~80x of margin.
TOLERANCE = 1e-6


def hook_net() -> torch.nn.Module:
    torch.manual_seed(13)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 24),
        cnn.MoE(24, 5, 40, top_k=2, routing="topk_softmax", activation="silu", gated=True,
                num_shared=1, shared_hidden=16, shared_gate=True),
        cnn.MoE(24, 4, 20, top_k=1, routing="top1", activation="gelu"),
        torch.nn.Linear(24, 6)).eval()


# q8-int8act: the first MoE's routed experts (torch's layers.1) compute with int8 activations, which the numpy device declines.
DTYPES = {"f32": {}, "f16": {"dtype": "f16"}, "q8": {"dtype": "q8"},
          "q8-int8act": {"dtype": "q8", "int8_act": ["layers.1.experts.*"]}, "q4": {"dtype": "q4", "group": 8}}
