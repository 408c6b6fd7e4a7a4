"""The tiny King James model through the Colibri C engine: held-out perplexity per weight dtype,
image and arena bytes, and host decode speed.

Exports model/ (Hugging Face Qwen3-MoE) to f32, f16, q8 and q4 token-model images with a 256-position
KV cache (cached in build/tiny_lm/, re-made when the weights or the exporter change), then scores
the held-out text exactly as train.held_out_nll does — consecutive 256-byte windows, each from an
empty context, every byte but a window's first predicted once — with colibri.LM's logits.
The f32 figure must match PyTorch's (metrics.json); f16 and q8 show what quantisation costs.

    .venv/bin/python examples/tiny_lm/evaluate.py [--dtypes f32,f16,q8] [--windows N]
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "host_tools"))
import corpus  # noqa: E402
from train import CONTEXT, METRICS, MODEL_DIR  # noqa: E402

import colibri  # noqa: E402

CACHE_DIR = ROOT / "build" / "tiny_lm"
DTYPES = ("f32", "f16", "q8", "q4")
# The deployment shape: one token a forward call, as the firmware decodes; the prompt is fed a
# token at a time too. A larger max_batch only grows the arena (activation rows), not the result.
MAX_BATCH = 1
# Decode speed: a short prompt, then as many new tokens as the cache holds.
SPEED_PROMPT = b"And God said, Let there be light:"


def _export_key(dtype: str) -> str:
    """What an image depends on: the weights, the config, the dtype and the exporter's code."""
    h = hashlib.sha256()
    for f in (MODEL_DIR / "config.json", MODEL_DIR / "model.safetensors"):
        h.update(f.read_bytes())
    package = ROOT / "host_tools" / "colibri"
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + f.read_bytes())
    h.update(f"{dtype} {CONTEXT} {MAX_BATCH}".encode())
    return h.hexdigest()[:16]


def image_path(dtype: str, cache_dir: Path = CACHE_DIR) -> Path:
    """The model's image in `dtype`, exported on first use and cached under a key of its inputs."""
    path = cache_dir / f"tiny_lm-{dtype}-{_export_key(dtype)}.clb"
    if path.exists():
        return path
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(1)
    model = Qwen3MoeForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.glob(f"tiny_lm-{dtype}-*.clb"):
        stale.unlink()
    # The export check runs the image against PyTorch over 32 positions (f32: within 1e-4 relative,
    # else it refuses to write).
    colibri.export(model, path, max_seq_len=CONTEXT, max_batch=MAX_BATCH, dtype=dtype)
    return path


def held_out_nll(lm: colibri.LM, text: bytes, windows: int | None = None) -> tuple[float, int]:
    """Mean NLL (nats per byte) and bytes scored, train.held_out_nll's windows through the engine."""
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    n = len(ids) // CONTEXT if windows is None else min(windows, len(ids) // CONTEXT)
    total, count = 0.0, 0
    for w in range(n):
        window = ids[w * CONTEXT : (w + 1) * CONTEXT]
        lm.reset()
        logits = lm.forward_tokens(window)[:-1].astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        total += float((log_z - logits[np.arange(CONTEXT - 1), window[1:]]).sum())
        count += CONTEXT - 1
    return total / count, count


def decode_tokens_per_second(lm: colibri.LM, repeats: int = 3) -> float:
    """New tokens per second of lm.generate (greedy, the loop in C), the best of `repeats`."""
    prompt = list(SPEED_PROMPT)
    new = lm.max_seq_len - len(prompt) + 1
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        lm.generate(prompt, new)
        best = min(best, time.perf_counter() - t0)
    return new / best


@dataclass
class Row:
    dtype: str
    image_bytes: int
    arena_bytes: int
    kv_cache_bytes: int
    nll: float
    scored: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2)


def evaluate(dtype: str, windows: int | None = None) -> Row:
    path = image_path(dtype)
    lm = colibri.LM(path)
    nll, scored = held_out_nll(lm, corpus.load().held_out, windows)
    return Row(dtype, path.stat().st_size, lm.arena_size, lm.kv_cache_bytes, nll, scored)


@click.command()
@click.option("--dtypes", default=",".join(DTYPES), show_default=True, help="weight dtypes, comma-separated")
@click.option("--windows", type=click.IntRange(min=1), default=None,
              help="score only the first N 256-byte windows (default: all the held-out text)")
@click.option("--no-speed", is_flag=True, help="skip the decode-speed measurement")
def main(dtypes: str, windows: int | None, no_speed: bool) -> None:
    recorded = json.loads((MODEL_DIR / METRICS).read_text())
    rows, speeds = [], {}
    for dtype in dtypes.split(","):
        if dtype not in DTYPES:
            raise click.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPES)}", param_hint="--dtypes")
        rows.append(evaluate(dtype, windows))
        if not no_speed:
            speeds[dtype] = decode_tokens_per_second(colibri.LM(image_path(dtype)))
    base = next((r for r in rows if r.dtype == "f32"), None)
    print(f"held-out text: {rows[0].scored} bytes scored (Jude, Revelation); C engine, {colibri.LM(image_path(rows[0].dtype)).kernels} kernels")
    print(f"{'dtype':6} {'image B':>9} {'arena B':>9} {'KV cache B':>10} {'perplexity':>10} {'bits/byte':>9} "
          f"{'vs f32':>8} {'decode tok/s':>12}")
    for r in rows:
        delta = f"{100 * (r.perplexity / base.perplexity - 1):+.2f}%" if base else "-"
        speed = f"{speeds[r.dtype]:,.0f}" if r.dtype in speeds else "-"
        print(f"{r.dtype:6} {r.image_bytes:>9,} {r.arena_bytes:>9,} {r.kv_cache_bytes:>10,} {r.perplexity:>10.4f} "
              f"{r.bits_per_byte:>9.4f} {delta:>8} {speed:>12}")
    if windows is None:
        torch_nll = recorded["held_out_nll_nats_per_byte"]
        print(f"PyTorch f32 (metrics.json): perplexity {math.exp(torch_nll):.4f}, {torch_nll:.6f} nats/byte")
        if base is not None:
            print(f"engine f32 - PyTorch: {base.nll - torch_nll:+.2e} nats/byte")


if __name__ == "__main__":
    main()
