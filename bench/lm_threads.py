"""Token models on threads: decode and prefill tok/s of colibri.LM at 1 and 2 workers
(colibri_lm_forward_ex over posix/colibri_pool), with the logits checked bit for bit between them.

    .venv/bin/python bench/lm_threads.py [--rounds 5] [--dtypes f32,q8] [--models mixtral,tiny]
    (or: make bench-lm-threads)

Models: a random-weight Hugging Face Mixtral of the class issue 23 measures (hidden 512, 8 layers,
8 experts x 1408 top-2, GQA 8/2, vocab 4096; weights N(0, 0.02), 148 M parameters), exported by
colibri.export at each dtype and cached in build/bench/lm_threads/; and the trained tiny King James
model (examples/tiny_lm/model, a Qwen3-MoE of hidden 64). Decode: 128 tokens one call each after a
16-token prompt; prefill: 64 tokens in one call. Each round runs every worker count once, the counts
alternating, and the table gives the median round. The load average is printed before and after,
and, for each run, the CPU time the process got over its wall time and the CPU milliseconds per
token: on a shared machine a second worker only pays when a second core is idle, and a thread the
scheduler parks in the middle of a parallel loop stalls the loop for a time slice.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host_tools"))
import colibri  # noqa: E402

CACHE = ROOT / "build" / "bench" / "lm_threads"
TINY = ROOT / "examples" / "tiny_lm" / "model"
PROMPT, DECODE, PREFILL = 16, 128, 64
MAX_SEQ_LEN = 256


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mixtral(seed: int = 0):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=MAX_SEQ_LEN, initializer_range=0.02,
                           sliding_window=None, tie_word_embeddings=False)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # N(0, 0.02) everywhere (HF's init leaves norms at 1, biases absent)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def tiny():
    import torch
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


def image(name: str, dtype: str) -> Path:
    path = CACHE / f"{name}-{dtype}.clb"
    if not path.exists():
        import torch

        torch.set_num_threads(1)
        CACHE.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        model = mixtral() if name == "mixtral" else tiny()
        # The export check runs the image against PyTorch over 32 positions (f32 within 1e-4).
        colibri.export(model, path, max_seq_len=MAX_SEQ_LEN, max_batch=PREFILL, dtype=dtype)
        print(f"exported {path.relative_to(ROOT)} ({path.stat().st_size / 1e6:.1f} MB) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    return path


def decode(lm: colibri.LM, ids: np.ndarray) -> tuple[float, np.ndarray, float]:
    """tok/s of DECODE single-token calls after a PROMPT-token prefill, their logits, CPU/wall."""
    lm.reset()
    lm.forward_tokens(ids[:PROMPT])
    rows = []
    cpu, t = time.process_time(), time.perf_counter()
    for token in ids[PROMPT:PROMPT + DECODE]:
        rows.append(lm.forward_tokens([token])[0])
    wall = time.perf_counter() - t
    return DECODE / wall, np.stack(rows), (time.process_time() - cpu) / wall


def prefill(lm: colibri.LM, ids: np.ndarray) -> tuple[float, np.ndarray, float]:
    lm.reset()
    cpu, t = time.process_time(), time.perf_counter()
    logits = lm.forward_tokens(ids[:PREFILL])
    wall = time.perf_counter() - t
    return PREFILL / wall, logits, (time.process_time() - cpu) / wall


def measure(path: Path, workers: list[int], rounds: int) -> dict:
    lms = {w: colibri.LM(path, workers=w) for w in workers}
    ids = np.random.default_rng(1).integers(0, lms[workers[0]].vocab_size, PROMPT + DECODE)
    dec: dict[int, list[float]] = {w: [] for w in workers}
    pre: dict[int, list[float]] = {w: [] for w in workers}
    busy: dict[int, list[float]] = {w: [] for w in workers}
    pbusy: dict[int, list[float]] = {w: [] for w in workers}
    want_dec = want_pre = None
    for r in range(rounds):
        for w in (workers if r % 2 == 0 else workers[::-1]):
            tps, logits, cpus = decode(lms[w], ids)
            ptps, plogits, pcpus = prefill(lms[w], ids)
            if want_dec is None:
                want_dec, want_pre = logits, plogits
            if logits.tobytes() != want_dec.tobytes() or plogits.tobytes() != want_pre.tobytes():
                raise SystemExit(f"{path.name}: {w} workers' logits differ from the first run's")
            dec[w].append(tps)
            pre[w].append(ptps)
            busy[w].append(cpus)
            pbusy[w].append(pcpus)
    return {w: (statistics.median(dec[w]), statistics.median(pre[w]), statistics.median(busy[w]),
                statistics.median(pbusy[w]), lms[w].arena_size) for w in workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="f32,q8")
    ap.add_argument("--models", default="mixtral,tiny")
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores; load average before: {os.getloadavg()}")
    rows = []
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            path = image(name, dtype)
            kernels = colibri.LM(path).kernels
            res = measure(path, workers, args.rounds)
            rows.append((name, dtype, kernels, res))
            one = res[workers[0]]
            for w in workers:
                dec, pre, cpus, pcpus, arena = res[w]
                # CPU time per token: what the work costs, whatever share of the cores the process got.
                print(f"{name:8} {dtype:4} {w} worker(s): decode {dec:8.1f} tok/s ({dec / one[0]:.2f}x, CPU/wall "
                      f"{cpus:.2f}, {1e3 * cpus / dec:.2f} CPU ms/token), prefill {PREFILL} {pre:8.1f} tok/s "
                      f"({pre / one[1]:.2f}x, CPU/wall {pcpus:.2f}, {1e3 * pcpus / pre:.3f} CPU ms/token), "
                      f"arena {arena / 1e6:.2f} MB", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print("\n| model | dtype | " + " | ".join(f"decode tok/s, {w} w" for w in workers) + " | " +
          " | ".join(f"prefill {PREFILL} tok/s, {w} w" for w in workers) + " |")
    print("|---|---|" + "---|" * (2 * len(workers)))
    for name, dtype, _, res in rows:
        print(f"| {name} | {dtype} | " + " | ".join(f"{res[w][0]:.1f}" for w in workers) + " | " +
              " | ".join(f"{res[w][1]:.1f}" for w in workers) + " |")
    print(f"(median of {args.rounds} rounds; logits bit-identical across worker counts; kernels: {rows[0][2]})")


if __name__ == "__main__":
    main()
