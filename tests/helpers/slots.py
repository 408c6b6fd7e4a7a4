"""The A/B slot tests' models and checks: small images that differ by seed, whether the device runs one,
and a stand-in `pyocd` that records what colibri asks of it."""
from __future__ import annotations

import functools

import numpy as np
import torch

import colibri
from colibri import nn as cnn
from colibri.target.device import Device
from colibri.frontends.exporter import export

MAX_BATCH = 2


@functools.lru_cache(maxsize=None)
def small_model(seed: int) -> bytes:
    """A q8 MoE model image of about 5 KB (a quarter second over the emulated UART); each seed differs."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 12), cnn.MoE(12, 4, 16, top_k=2), torch.nn.Linear(12, 4)).eval()
    return export(m, None, max_batch=MAX_BATCH, dtype="q8").image


def inputs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((MAX_BATCH, 8)).astype(np.float32)


def runs(dut: Device, data: bytes) -> bool:
    """Whether the device's answers are the host engine's for this image."""
    x = inputs()
    want = colibri.Model(data).forward(x)
    dut.info = None  # the model may have changed under the cached INFO
    y, _ = dut.forward(x)
    return bool(np.abs(y - want).max() <= 1e-5 * (1 + np.abs(want).max()))


def other(name: str) -> str:
    return "B" if name == "A" else "A"


FAKE_PYOCD = """#!/bin/sh
echo "$@" >> "{log}"
for last; do :; done
case "$1" in flash) cp "$last" "{log}.$(wc -l < "{log}" | tr -d ' ')";; esac
{fail}
"""
