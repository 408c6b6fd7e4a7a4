"""Mapped model files on Linux (issue 11): what mapping instead of copying buys, printed, not asserted.

    .venv/bin/python bench/edge_mmap.py [--layers 2 --experts 64 --d 512 --hidden 1024] [--tokens 32] [--keep]
    make bench-edge-mmap         (about 400 MB: 2 MoE layers x 64 GLU f16 experts of 3 MiB)
    make bench-edge-mmap-full    (about 1.6 GB: 4 x 128)

Generates a page-aligned, format-v3 model of many experts (random f16 weights; routing picks 2 of
N per token) in a temporary folder (--dir), then, each from a cold page cache (the file's pages
dropped with posix_fadvise(DONTNEED) after an fsync):

- open: colibri.Model(path) (mapped; structure checked, no weight read) vs Model(path, copy=True);
- time to first output: open plus one token;
- after N tokens, one at a time: resident bytes of the mapping in this process (/proc/self/smaps Rss
  of the file) and in the page cache (mincore) against the file size;
- major page faults per token (getrusage ru_majflt) with the route callback's MADV_WILLNEED on the
  selected experts and without it (advise=False; both verify="none", so only the advice differs),
  and with the default verify="on_use" (each expert's CRCs on its first use).

Times are wall clock on this machine (shared cores, a virtual disk); they vary run to run.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri import image
from colibri.format import Act, ExpertKind, Routing
from colibri.ir import Expert, F16Weight, Graph, Linear, MoE


def build(layers: int, experts: int, d: int, hidden: int, seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)

    def f16(rows: int, cols: int, scale: float) -> F16Weight:
        return F16Weight((rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16))

    body: list = [Linear(rng.standard_normal((d, 16), dtype=np.float32) * 0.25, np.zeros(d, np.float32))]
    for _ in range(layers):
        body.append(MoE(
            routing=Routing.TOPK_SOFTMAX, top_k=2,
            router_weight=rng.standard_normal((experts, d), dtype=np.float32) * 0.05,
            expert_map=np.arange(experts, dtype=np.int32),
            experts=[Expert(ExpertKind.GLU, Act.SILU, w1=f16(hidden, d, d ** -0.5), w2=f16(d, hidden, hidden ** -0.5),
                            w3=f16(hidden, d, d ** -0.5)) for _ in range(experts)],
        ))
    body.append(Linear(rng.standard_normal((8, d), dtype=np.float32) * 0.05))
    return Graph(layers=body, input_size=16, output_size=8, max_batch=1)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapped_rss(path: Path) -> int:
    """Bytes of the file's mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def majflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def tokens_run(path: Path, x: np.ndarray, **opts) -> dict:
    drop_cache(path)
    t0 = time.perf_counter()
    m = colibri.Model(path, **opts)
    t_open = time.perf_counter() - t0
    f0 = majflt()
    m.forward(x[:1])
    t_first = time.perf_counter() - t0
    rss_first = mapped_rss(path)
    for row in x[1:]:
        m.forward(row[None, :])
    t_all = time.perf_counter() - t0
    faults = majflt() - f0
    out = {"open": t_open, "first": t_first, "all": t_all, "faults": faults / len(x), "rss": mapped_rss(path), "rss_first": rss_first,
           "cached": m.file.resident() if m.file is not None else None}
    del m
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dir", type=Path, default=None, help="where the model file goes (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the model file")
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="colibri-edge-", dir=args.dir))
    path = folder / "edge.clb"
    t0 = time.perf_counter()
    graph = build(args.layers, args.experts, args.d, args.hidden)
    data = image.write(graph, page_aligned=True)
    del graph
    with open(path, "wb") as fh:
        fh.write(data)
    size = len(data)
    del data
    expert_bytes = 3 * args.hidden * args.d * 2
    print(f"model: {args.layers} MoE layers x {args.experts} GLU f16 experts (d {args.d}, hidden {args.hidden}, "
          f"{mib(expert_bytes)} each), top-2, page-aligned format v3: {mib(size)} "
          f"(written in {time.perf_counter() - t0:.1f} s)")
    x = np.random.default_rng(1).standard_normal((args.tokens, 16)).astype(np.float32)
    try:
        copy = tokens_run(path, x[:1], copy=True)
        mapped = tokens_run(path, x[:1], verify="none")
        print(f"open, cold cache: mapped {mapped['open'] * 1e3:,.1f} ms, copy=True {copy['open'] * 1e3:,.1f} ms "
              f"(reads and checks all {mib(size)})")
        print(f"time to first output, cold cache: mapped {mapped['first'] * 1e3:,.1f} ms, "
              f"copy=True {copy['first'] * 1e3:,.1f} ms; mapping resident after it {mib(mapped['rss_first'])} "
              f"({mapped['rss_first'] / size:.1%} of the file)")
        touched = args.layers * min(args.experts, 2 * args.tokens) * expert_bytes
        for name, opts in (("WILLNEED (route callback)", {"verify": "none"}),
                           ("no advice (advise=False)", {"verify": "none", "advise": False}),
                           ("WILLNEED + verify on use (default)", {})):
            r = tokens_run(path, x, **opts)
            print(f"{args.tokens} tokens, {name}: {r['faults']:,.1f} major faults/token, "
                  f"{r['all'] / args.tokens * 1e3:,.2f} ms/token (first {r['first'] * 1e3:,.1f} ms); "
                  f"mapping resident {mib(r['rss'])} ({r['rss'] / size:.1%} of the file; page cache "
                  f"{mib(r['cached'])}); at most {mib(touched)} of experts routed")
    finally:
        if args.keep:
            print(f"kept {path}")
        else:
            path.unlink(missing_ok=True)
            folder.rmdir()


if __name__ == "__main__":
    main()
