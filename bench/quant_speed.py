"""Seconds per weight matrix of the q4 and q8 quantisers (issue 26: the streamed export's cost).

    .venv/bin/python bench/quant_speed.py [--shape 2816x1024 --shape 5632x2048] [--repeat 3] [--spec]
    make bench-quant

Each matrix is seeded N(0, 1/cols) f32, as bench/hf_export.py's folder holds them: 2816x1024 is an
expert matrix of the 2.3 GB Mixtral folder, 5632x2048 one of the 7 B model. Printed per shape, as wall
and CPU seconds (the process's time.process_time: what the machine's other load moves least), medians
of --repeat runs:

- `quantize_q4` (default group 32, clip search, 0.5 % compensation) with its clip search in C
  (colibri.quant._q4_search, the default when built; its int4 values and residuals in C too) and with
  the numpy search a checkout without a build uses, each on Q4_SEARCH_THREADS threads (the process's
  cores) and on one;
- `quantize_q8` (compact, as the export stores it);
- the clip search alone (`_q4_scales` of that matrix's groups): C and numpy, on both thread counts;
- with --spec also `quantize_q4` with its search done by `q4_scales_spec` (the readable form, the code
  before the fast searches), and whether the C and numpy paths give its bytes.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from unittest import mock

import numpy as np

from colibri.image import codecs
from colibri.quant import quantize as Q


def timed(fn, repeat: int) -> tuple[str, object]:
    """'wall/cpu' medians of `repeat` calls, and the last result."""
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return f"{statistics.median(wall):.3f}/{statistics.median(cpu):.3f}", out


def q4_bytes(qw) -> bytes:
    return codecs.q4_pack(qw.q) + codecs.q4_params_payload(qw)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="ROWSxCOLS (repeatable; default 2816x1024 and 5632x2048)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spec", action="store_true", help="also time the clip search's readable form")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in (a.shape or ["2816x1024", "5632x2048"])]
    threads = Q.Q4_SEARCH_THREADS
    kernel = Q._q4_search.kernel() if Q._q4_search else "not built"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(f"{cpu_name()}, {os.cpu_count()} cores; C search kernel {kernel}; load average {load}")
    print("seconds per matrix, wall/cpu, median of", a.repeat)
    paths = {"C": Q._q4_search, "numpy": None}
    if Q._q4_search is None:
        del paths["C"]
    head = [f"q4 {p} {n}t" for p in paths for n in (threads, 1)] + ["q8"]
    head += ["spec", "same bytes"] if a.spec else []
    print(f"{'matrix':>11} " + " ".join(f"{h:>13}" for h in head))
    searches = []
    for rows, cols in shapes:
        w = (np.random.default_rng(0).standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        cells, results = [], {}
        for name, module in paths.items():
            with mock.patch.object(Q, "_q4_search", module):
                for n in (threads, 1):
                    with mock.patch.object(Q, "Q4_SEARCH_THREADS", n):
                        t, results[name] = timed(lambda w=w: Q.quantize_q4(w), a.repeat)
                    cells.append(t)
        t8, _ = timed(lambda w=w: Q.quantize_q8(w, compact=True), a.repeat)
        cells.append(t8)
        if a.spec:
            with mock.patch.object(Q, "_q4_scales", Q.q4_scales_spec), mock.patch.object(Q, "_q4_search", None):
                ts, spec = timed(lambda w=w: Q.quantize_q4(w), a.repeat)
            same = all(q4_bytes(r) == q4_bytes(spec) for r in results.values())
            cells += [ts, str(same)]
        print(f"{rows:>5}x{cols:<5} " + " ".join(f"{c:>13}" for c in cells), flush=True)
        # the search alone, on the groups quantize_q4 hands it (the 0.5 % largest set aside)
        g = w.reshape(rows, -1, Q.Q4_DEFAULT_GROUP)
        m = np.ones(g.shape, bool)
        m.ravel()[Q._largest(np.abs(w).ravel(), round(Q.DEFAULT_COMPENSATION * w.size))] = False
        row = []
        for name, search in (("C", Q._q4_scales_c), ("numpy", Q._q4_scales_numpy)):
            if name in paths:
                for n in (threads, 1):
                    with mock.patch.object(Q, "Q4_SEARCH_THREADS", n):
                        row.append(timed(lambda s=search, g=g, m=m: s(g, m, True), a.repeat)[0])
        searches.append((rows, cols, row))
    print(f"\nclip search alone\n{'matrix':>11} " + " ".join(f"{h:>13}" for h in head[: 2 * len(paths)]))
    for rows, cols, row in searches:
        print(f"{rows:>5}x{cols:<5} " + " ".join(f"{c:>13}" for c in row))


if __name__ == "__main__":
    main()
