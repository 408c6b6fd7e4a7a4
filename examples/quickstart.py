"""Quickstart: a PyTorch MoE model -> model image -> the C engine, checked against PyTorch.

    .venv/bin/python examples/quickstart.py [--out build/quickstart.clb]

Builds a small load-forecasting-shaped MoE (48 half-hourly readings in, the
next 24 out; 4 SwiGLU experts, Mixtral top-2 routing, a shared expert),
exports it, runs 512 inputs through the C engine and the numpy reference, and
prints how far each is from PyTorch, the image and arena sizes, and how the
router spread the tokens over the experts.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import colibri
from colibri import nn as cnn
from colibri import reference


def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 32),
        torch.nn.RMSNorm(32, eps=1e-6),
        cnn.Residual(cnn.MoE(32, 4, 64, top_k=2, routing="topk_softmax", gated=True, activation="silu",
                             expert_bias=False, num_shared=1, shared_hidden=32, shared_gate=True)),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 24),
    ).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("build/quickstart.clb"))
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    model = build_model()
    x = torch.randn(args.tokens, 48)
    result = colibri.export(model, args.out, max_batch=16, example_input=x[:16])
    engine = colibri.Model(args.out)

    with torch.no_grad():
        want = model(x).numpy()
    t0 = time.perf_counter()
    got = engine.forward(x.numpy())
    t_engine = time.perf_counter() - t0
    ref = reference.run(colibri.image.read(result.image), x.numpy())
    scale = 1 + np.abs(want).max()

    counts = np.zeros(4, dtype=int)
    moe = result.graph.moe_layers()[0]
    h = reference.run(colibri.model.ir.Graph(result.graph.layers[:3], 48, 32, 16), x.numpy())
    for sel in reference.route(moe, h):
        for slot, _ in sel:
            counts[slot] += 1

    print(f"model image  {args.out}  {engine.image_size:,} bytes, {engine.num_parameters:,} parameters")
    print(f"arena        {engine.arena_size:,} bytes for max_batch {engine.max_batch}")
    print(f"C engine  vs PyTorch: max |diff| {np.abs(got - want).max():.3g}  (tolerance {1e-5 * scale:.3g})")
    print(f"reference vs PyTorch: max |diff| {np.abs(ref - want).max():.3g}")
    print(f"expert load over {args.tokens} tokens (top-2): {counts.tolist()}")
    print(f"C engine: {args.tokens} tokens in {t_engine * 1e3:.2f} ms on this host")
    ok = np.abs(got - want).max() <= 1e-5 * scale and np.abs(ref - want).max() <= 1e-5 * scale
    print("AGREE" if ok else "DISAGREE")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
