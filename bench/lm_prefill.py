"""Token models' prefill and decode speed per weight dtype, with and without INT8_BLOCKS, one thread:
prefill tok/s (64 tokens in one colibri_lm_forward call) and decode tok/s (128 single-token calls after
a 16-token prompt), optionally of two builds of the engine side by side.

    .venv/bin/python bench/lm_prefill.py [--rounds 5] [--models mixtral,tiny] [--forms f32,f16,q8,...]
        [--engine DIR ...]      (or: make bench-lm-prefill)

Models: the random-weight Hugging Face Mixtral of bench/lm_threads.py (hidden 512, 8 layers, 8 experts
x 1408 top-2, GQA 8/2, vocab 4096, 148 M parameters) and the trained tiny King James model
(examples/tiny_lm/model, hidden 64). Forms: f32, f16, q8 and q4 with f32 activations (the default),
q8-blocks, q4-blocks with INT8_BLOCKS on every layer that allows it: the experts, the LM head and the
attention projections (colibri.export(..., int8_blocks=["layers.*"])), and q8-blocks-ffn, q4-blocks-ffn
with it on the experts and the head only (the attention projections with f32 activations). Images are
cached in build/bench/lm_prefill/ and exported again when the exporter or the settings changed
(bench/image_cache.py).

--engine DIR (repeatable) names a host_tools directory whose colibri package (and built binding) is
measured, e.g. one of an older checkout: each round runs every engine once in a process of its own,
the order alternating between rounds, so a drift in the machine's load hits every engine alike; the
table gives each figure's median over the rounds. Without --engine, this checkout's.
Each figure is given by the process's CPU time (what the work costs, whatever share of a core the
scheduler gave: the steadier one on a shared machine) and by the wall clock. The load average is
printed before and after: on a shared machine the figures are only comparable within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "bench" / "lm_prefill"
PROMPT, DECODE, PREFILL = 16, 128, 64
MAX_SEQ_LEN = 256
FORMS = {
    "f32": ("f32", {}),
    "f16": ("f16", {}),
    "q8": ("q8", {"int8_blocks": []}),
    "q8-blocks": ("q8", {"int8_blocks": ["layers.*"]}),
    "q4": ("q4", {"int8_blocks": []}),
    "q4-blocks": ("q4", {"int8_blocks": ["layers.*"]}),
    "q8-blocks-ffn": ("q8", "ffn"),
    "q4-blocks-ffn": ("q4", "ffn"),
}


def ffn_blocks(model) -> list[str]:
    """INT8_BLOCKS patterns for a Hugging Face decoder's experts and LM head, not its attention: the image
    is EMBED, 8 layers per decoder layer (docs/lm.md "A decoder layer"), the final norm, the head."""
    cfg = model.config
    patterns = ["layers.*.experts.*", f"layers.{2 + 8 * cfg.num_hidden_layers}"]
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        patterns.append("layers.*.shared.*")
    return patterns


def image(name: str, form: str) -> Path:
    path = CACHE / f"{name}-{form}.clb"
    sys.path.insert(0, str(ROOT / "bench"))
    import image_cache

    settings = {"model": name, "form": form, "max_seq_len": MAX_SEQ_LEN, "max_batch": PREFILL}
    if not image_cache.is_fresh(path, settings):
        import torch

        sys.path.insert(0, str(ROOT / "host_tools"))
        sys.path.insert(0, str(ROOT / "bench"))
        import colibri
        import lm_threads

        torch.set_num_threads(1)
        CACHE.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        model = lm_threads.mixtral() if name == "mixtral" else lm_threads.tiny()
        dtype, extra = FORMS[form]
        if extra == "ffn":
            extra = {"int8_blocks": ffn_blocks(model)}
        colibri.export(model, path, max_seq_len=MAX_SEQ_LEN, max_batch=PREFILL, dtype=dtype, check=False, **extra)
        image_cache.mark_fresh(path, settings)
        print(f"exported {path.relative_to(ROOT)} ({path.stat().st_size / 1e6:.1f} MB) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    return path


def run_one(host_tools: str, paths: list[str]) -> dict:
    """One round in this process: every image's decode and prefill tok/s with host_tools' colibri."""
    sys.path.insert(0, host_tools)
    import numpy as np

    import colibri

    out = {"kernels": None, "figures": {}}
    for p in paths:
        lm = colibri.LM(p)
        out["kernels"] = lm.kernels
        ids = [int(t) for t in np.random.default_rng(1).integers(0, lm.vocab_size, PROMPT + DECODE)]
        lm.forward_tokens(ids[:PREFILL])  # warm: pages and caches
        lm.reset()
        t, c = time.perf_counter(), time.process_time()
        lm.forward_tokens(ids[:PREFILL])
        pre, pre_cpu = PREFILL / (time.perf_counter() - t), PREFILL / (time.process_time() - c)
        lm.reset()
        lm.forward_tokens(ids[:PROMPT])
        t, c = time.perf_counter(), time.process_time()
        for token in ids[PROMPT:PROMPT + DECODE]:
            lm.forward_tokens([token])
        dec, dec_cpu = DECODE / (time.perf_counter() - t), DECODE / (time.process_time() - c)
        out["figures"][p] = (pre, dec, pre_cpu, dec_cpu)
        del lm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default="mixtral,tiny")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--engine", action="append", default=[], help="a host_tools directory to measure")
    ap.add_argument("--run-one", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        print(json.dumps(run_one(args.run_one[0], args.run_one[1:])))
        return

    sys.path.insert(0, str(ROOT / "bench"))
    from lm_threads import _cpu

    engines = [str(Path(e).resolve()) for e in args.engine] or [str(ROOT / "host_tools")]
    keys = [(m, f) for m in args.models.split(",") for f in args.forms.split(",")]
    paths = {k: str(image(*k)) for k in keys}
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores; load average before: {os.getloadavg()}", flush=True)
    got: dict[str, dict[tuple, list]] = {e: {k: [] for k in keys} for e in engines}
    kernels = {}
    for r in range(args.rounds):
        for e in (engines if r % 2 == 0 else engines[::-1]):
            res = subprocess.run([sys.executable, __file__, "--run-one", e, *paths.values()], capture_output=True,
                                 text=True, check=True)
            one = json.loads(res.stdout.strip().splitlines()[-1])
            kernels[e] = one["kernels"]
            for k in keys:
                got[e][k].append(one["figures"][paths[k]])
        print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    names = [Path(e).parent.name if len(engines) > 1 else "colibri" for e in engines]
    head = " | ".join(f"prefill {PREFILL}, {n}" for n in names) + " | " + " | ".join(f"decode, {n}" for n in names)
    for clock, off in (("process CPU time", 2), ("wall clock", 0)):
        print(f"\ntok/s by {clock}, one thread, median of {args.rounds} rounds (kernels: {kernels[engines[0]]})\n")
        print(f"| model | form | {head} |" + (" prefill ratio | decode ratio |" if len(engines) == 2 else ""))
        print("|---|---|" + "---|" * (2 * len(engines) + (2 if len(engines) == 2 else 0)))
        for k in keys:
            pre = [statistics.median(x[off] for x in got[e][k]) for e in engines]
            dec = [statistics.median(x[off + 1] for x in got[e][k]) for e in engines]
            row = f"| {k[0]} | {k[1]} | " + " | ".join(f"{v:.1f}" for v in pre) + " | " + " | ".join(
                f"{v:.1f}" for v in dec) + " |"
            if len(engines) == 2:
                row += f" {pre[1] / pre[0]:.2f}x | {dec[1] / dec[0]:.2f}x |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
