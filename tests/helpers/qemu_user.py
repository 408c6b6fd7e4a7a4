"""The C drivers of other Linux architectures under QEMU's user mode (qemu-aarch64, qemu-riscv64), and the
model corpus both backends' end-to-end tests run against the x86-64 host's reference kernels."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import torch

from colibri import nn as cnn
from colibri.frontends.exporter import export

from helpers.build import ROOT

AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"


def qemu_aarch64(cpu: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A dynamically linked AArch64 program, its libraries from the cross sysroot."""
    return subprocess.run(["qemu-aarch64", "-cpu", cpu, "-L", AARCH64_SYSROOT, *args],
                          capture_output=True, text=True, timeout=timeout)


def qemu_riscv64(cpu: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # The drivers are static: no sysroot needed at run time.
    return subprocess.run(["qemu-riscv64", "-cpu", cpu, *args], capture_output=True, text=True, timeout=timeout)


BATCH = 9  # blocks of 4 tokens plus a tail, and expert rings of 1..9 tokens


# NEON vs reference over a whole model: |opt - ref| <= E2E_RTOL * (1 + |ref|) elementwise.
# The kernels' own bound is the dot-product reordering error (about in · 2^-24 relative to
# Σ|w·x|); through a few layers, norms and the gate it stays below 1e-6 on these models.
E2E_RTOL = 2e-5


def corpus_model(routing: str, index: int) -> torch.nn.Module:
    torch.manual_seed(100 + index)
    acts = cnn.ACTIVATIONS
    d_in, d, out = 37, 53, 19
    moe = cnn.MoE(d, 5, 67, top_k=2 if routing != "top1" else 1, routing=routing,
                  renormalize=routing == "softmax_topk" and index % 2 == 0,
                  activation=acts[index % len(acts)], gated=index % 2 == 1,
                  num_shared=index % 3 == 0 and 1 or 0, shared_hidden=21,
                  shared_gate=index % 3 == 0 and index % 2 == 0)
    layers = [torch.nn.Linear(d_in, d), torch.nn.LayerNorm(d), moe,
              cnn.make_activation(acts[(index + 3) % len(acts)]), torch.nn.RMSNorm(d), torch.nn.Linear(d, out)]
    return torch.nn.Sequential(*layers).eval()


def differential_feature_models() -> list[Path]:
    """The differential fuzz corpus's feature models (its token models run through colibri_lm_forward_ex:
    tests/lm/test_lm_threads.py and tests/lm/test_lm_tokenizer_decode.py)."""
    from colibri import image

    return [p for p in sorted((ROOT / "fuzz" / "corpus" / "differential").glob("*.clb"))
            if not image.read(p.read_bytes()).is_token_model]


def corpus_images() -> list[tuple[str, bytes]]:
    images = [(p.stem, p.read_bytes()) for p in differential_feature_models()]
    int8_layers = ["layers.0", "layers.2.experts.*", "layers.5"]
    variants = [("f32", {}), ("f16", {"dtype": "f16"}), ("q8", {"dtype": "q8"}),
                ("q8-int8act", {"dtype": "q8", "int8_act": int8_layers}),
                ("q8-blocks", {"dtype": "q8", "int8_blocks": int8_layers}),
                ("q4-blocks", {"dtype": "q4", "int8_blocks": int8_layers})]
    for i, routing in enumerate(cnn.ROUTINGS):
        for j, (name, kw) in enumerate(variants):
            model = corpus_model(routing, i * len(variants) + j)
            images.append((f"gen-{routing}-{name}", bytes(export(model, None, max_batch=BATCH, **kw).image)))
    return images


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, NaN matching NaN (x86-64 and AArch64 make different default NaNs)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))
