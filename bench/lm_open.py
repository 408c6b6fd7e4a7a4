"""Opening model files by structure (issue 27): what `colibri.LM(path)` and `colibri.Model(path)` cost at
open, and what the first token costs, printed, not asserted.

    .venv/bin/python bench/lm_open.py [--layers 8 --d 512 --hidden 1408 --experts 8 --vocab 8192] [--repeat 3]
    make bench-lm-open     (a ~300 MB f16 token model and a ~200 MB f16 feature model)

Builds, in a temporary folder (--dir), a random token model of the Qwen2-MoE shape (per layer: RMSNorm,
GQA attention 8/2 heads of 64, RMSNorm, 8 routed GLU experts top-2 and one shared expert; weights f16)
and a feature model of MoE layers (bench/edge_mmap.py's), each written with the layout colibri.export
picks by default (image.writer.linux_layout: page-aligned with per-tensor CRCs above 16 MiB). Then, each
in a fresh process, from a warm page cache and from a cold one (the file's pages dropped with
posix_fadvise(POSIX_FADV_DONTNEED) after an fsync; no global drop_caches), the median of --repeat runs:

- open: the constructor's wall time, and the growth of the process's RSS over it;
- first: open plus the first output (a 16-token prompt for the token model, one row for the feature
  model): what a new user waits for;
- mapped: bytes of the file mapped into the process after that (smaps Rss);
- for verify="on_use" (the default: tables and every-token tensors at open, each expert on first use),
  "full" (every payload at open) and "none" (no payload CRC at all). on_use minus none is what checking
  costs the first output; its share is printed.

Then the advice ahead (ModelFile.set_ahead): a cold-cache decode of 32 tokens with verify="none" (so no
read at open warms the attention pages) at ahead 0, 1 and 2: time to the first token, decode tok/s and
major faults per token.

Timings are wall clock on a shared machine with a virtual disk; they vary run to run (medians printed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri import image
from colibri.model.format import Act, DType, ExpertKind, Routing
from colibri.model.ir import (Attention, Embedding, Expert, F16Weight, Graph, Linear, MoE, ResidualAdd, ResidualPush,
                              RMSNorm)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from edge_mmap import build as feature_graph, drop_cache  # noqa: E402

PROMPT = 16


def token_graph(layers: int, d: int, hidden: int, experts: int, vocab: int, seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)

    def f16(rows: int, cols: int) -> F16Weight:
        return F16Weight((rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5).astype(np.float16))

    def glu() -> Expert:
        return Expert(ExpertKind.GLU, Act.SILU, w1=f16(hidden, d), w2=f16(d, hidden), w3=f16(hidden, d))

    heads, kv_heads, hd = 8, 2, d // 8
    out: list = [Embedding(rng.standard_normal((vocab, d), dtype=np.float32).astype(np.float16).astype(np.float32))]
    for _ in range(layers):
        att = Attention(n_heads=heads, n_kv_heads=kv_heads, head_dim=hd, q_w=f16(heads * hd, d), k_w=f16(kv_heads * hd, d),
                        v_w=f16(kv_heads * hd, d), o_w=f16(d, heads * hd), rope_theta=10000.0, max_seq_len=128,
                        kv_dtype=DType.F32)
        moe = MoE(routing=Routing.SOFTMAX_TOPK, top_k=2, router_weight=rng.standard_normal((experts, d), dtype=np.float32) * 0.05,
                  experts=[glu() for _ in range(experts)], expert_map=np.arange(experts, dtype=np.int32), renormalize=True,
                  shared=[glu()], shared_gate=rng.standard_normal((1, d), dtype=np.float32) * 0.05)
        out += [ResidualPush(), RMSNorm(d, 1e-5, np.ones(d, np.float32)), att, ResidualAdd(),
                ResidualPush(), RMSNorm(d, 1e-5, np.ones(d, np.float32)), moe, ResidualAdd()]
    out += [RMSNorm(d, 1e-5, np.ones(d, np.float32)), Linear(f16(vocab, d))]
    return Graph(layers=out, input_size=vocab, output_size=vocab, max_batch=16)


def write(graph: Graph, path: Path) -> None:
    """The layout colibri.export picks by default (compact where this checkout has no such rule)."""
    rule = getattr(image.writer, "linux_layout", None) if hasattr(image, "writer") else None
    if rule is None:
        from colibri.image import writer
        rule = getattr(writer, "linux_layout", lambda g: False)
    image.write_atomically(path, image.write(graph, page_aligned=rule(graph)))


# ---- one measurement, in a child process -------------------------------------------------------------

def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def mapped_rss(path: Path) -> int:
    import re
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def child(kind: str, path: Path, opts: dict, decode: int) -> dict:
    import resource

    def majflt() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_majflt

    before = rss()
    t0 = time.perf_counter()
    if kind == "lm":
        ahead = opts.pop("ahead", None)
        m = colibri.LM(path, **opts)
        if ahead is not None:
            m.file.set_ahead(ahead)
    else:
        m = colibri.Model(path, **opts)
    t_open = time.perf_counter() - t0
    grown = rss() - before
    f0 = majflt()
    if kind == "lm":
        logits = m.forward_tokens(np.arange(PROMPT) % m.vocab_size)
        t_first = time.perf_counter() - t0
        token = int(np.argmax(logits[-1]))
        t1 = time.perf_counter()
        for _ in range(decode):
            token = int(np.argmax(m.forward_tokens([token])[-1]))
        t_decode = time.perf_counter() - t1
    else:
        m.forward(np.ones((1, m.input_size), np.float32))
        t_first = time.perf_counter() - t0
        t_decode = 0.0
    return {"open": t_open, "rss": grown, "first": t_first, "mapped": mapped_rss(path), "decode": t_decode,
            "faults": (majflt() - f0) / max(1, decode + 1)}


def measure(kind: str, path: Path, cold: bool, opts: dict, repeat: int, decode: int = 0) -> dict:
    runs = []
    for _ in range(repeat):
        if cold:
            drop_cache(path)
        else:
            with open(path, "rb") as fh:  # warm: every page of the file in the page cache
                while fh.read(1 << 24):
                    pass
        code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import lm_open; "
                f"print(json.dumps(lm_open.child({kind!r}, lm_open.Path({str(path)!r}), {opts!r}, {decode})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--feature-layers", type=int, default=2)
    ap.add_argument("--feature-experts", type=int, default=32)
    ap.add_argument("--feature-d", type=int, default=512)
    ap.add_argument("--feature-hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    print(f"colibri {colibri.__version__ if hasattr(colibri, '__version__') else ''} on {cpu}, "
          f"{os.cpu_count()} CPUs (shared), load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        lm_path, fm_path = Path(tmp) / "lm.clb", Path(tmp) / "feature.clb"
        write(token_graph(args.layers, args.d, args.hidden, args.experts, args.vocab), lm_path)
        write(feature_graph(args.feature_layers, args.feature_experts, args.feature_d, args.feature_hidden), fm_path)
        for kind, path in (("lm", lm_path), ("feature", fm_path)):
            data = path.read_bytes()[:80]
            flags = int.from_bytes(data[16:20], "little")
            print(f"\n{'token' if kind == 'lm' else 'feature'} model: {mib(path.stat().st_size)}, format "
                  f"v{int.from_bytes(data[4:6], 'little')}, {'page-aligned' if flags & 1 else 'compact'}")
            print(f"  {'cache':5} {'verify':7} {'open':>9} {'RSS at open':>12} {'first out':>10} {'mapped':>11}")
            first = {}
            for cold in (False, True):
                for verify in ("on_use", "full", "none"):
                    try:
                        r = measure(kind, path, cold, {"verify": verify}, args.repeat)
                    except subprocess.CalledProcessError as exc:  # an older checkout refusing an option
                        print(f"  {'cold' if cold else 'warm':5} {verify:7} refused: {exc.stderr.strip().splitlines()[-1]}")
                        first[(cold, verify)] = float("nan")
                        continue
                    first[(cold, verify)] = r["first"]
                    print(f"  {'cold' if cold else 'warm':5} {verify:7} {r['open'] * 1e3:7.1f} ms {mib(r['rss']):>12} "
                          f"{r['first'] * 1e3:7.1f} ms {mib(r['mapped']):>11}")
            for cold in (False, True):
                share = (first[(cold, "on_use")] - first[(cold, "none")]) / first[(cold, "on_use")]
                print(f"  checking's share of the first output ({'cold' if cold else 'warm'}): {share:.0%} "
                      f"(on_use {first[(cold, 'on_use')] * 1e3:.1f} ms vs none {first[(cold, 'none')] * 1e3:.1f} ms)")
        print(f"\nadvice ahead, token model, cold cache, verify='none', prompt {PROMPT} then {args.decode} tokens:")
        for ahead in (0, 1, 2):
            try:
                r = measure("lm", lm_path, True, {"verify": "none", "ahead": ahead}, args.repeat, args.decode)
            except subprocess.CalledProcessError as exc:
                print(f"  ahead {ahead}: not available here ({exc.stderr.strip().splitlines()[-1]})")
                break
            print(f"  ahead {ahead}: first token {r['first'] * 1e3:7.1f} ms, decode {args.decode / r['decode']:6.1f} tok/s, "
                  f"{r['faults']:.1f} major faults/token")


if __name__ == "__main__":
    main()
