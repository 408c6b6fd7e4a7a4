"""Host benchmark: the C engine against PyTorch eager and the numpy reference, side by side.

    .venv/bin/python bench/host_bench.py

Runs the quickstart model (examples/quickstart.py) at batch 1 and at its
max_batch, each engine in the same process and the same run, and prints
microseconds per forward (median of repeats) and the ratios. Wall-clock on a
shared machine: read the ratios, not the absolute numbers. The engine figures
include the CPython binding's call overhead.
"""
from __future__ import annotations

import sys
import timeit
from pathlib import Path

import numpy as np
import torch

import colibri
from colibri import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import build_model  # noqa: E402


def per_call_us(fn, repeat: int = 7) -> float:
    number = max(1, int(0.05 / max(timeit.timeit(fn, number=1), 1e-7)))
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    torch.set_num_threads(1)
    model = build_model()
    result = colibri.export(model, None, max_batch=16)
    engine = colibri.Model(result.image)
    print(f"model: {engine.num_parameters:,} parameters, image {engine.image_size:,} B, arena {engine.arena_size:,} B")
    print(f"{'batch':>5} {'C engine us':>12} {'torch us':>10} {'numpy ref us':>13} {'torch/C':>8} {'ref/C':>7}")
    for batch in (1, engine.max_batch):
        x = np.random.default_rng(0).standard_normal((batch, engine.input_size)).astype(np.float32)
        xt = torch.from_numpy(x)
        with torch.no_grad():
            c = per_call_us(lambda: engine.forward(x))
            t = per_call_us(lambda: model(xt))
            r = per_call_us(lambda: reference.run(result.graph, x), repeat=3)
        print(f"{batch:>5} {c:>12.1f} {t:>10.1f} {r:>13.1f} {t / c:>8.1f} {r / c:>7.1f}")


if __name__ == "__main__":
    main()
