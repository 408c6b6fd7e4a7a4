"""Seconds per weight matrix of the q4 and q8 quantisers (issue 26: the streamed export's cost).

    .venv/bin/python bench/quant_speed.py [--shape 2816x1024 --shape 5632x2048] [--repeat 3] [--spec]
    make bench-quant

Each matrix is seeded N(0, 1/cols) f32, as bench/hf_export.py's folder holds them: 2816x1024 is an
expert matrix of the 2.3 GB Mixtral folder, 5632x2048 one of the 7 B model. Printed per shape: the
median wall time of `quantize_q4` (default group 32, clip search, 0.5 % compensation; its search on
Q4_SEARCH_THREADS threads, the process's cores, and on one) and of
`quantize_q8` (compact, as the export stores it), each as wall and CPU seconds (the process's
time.process_time: what the machine's other load moves least). With --spec also `quantize_q4` with its
clip search done by `q4_scales_spec` (the readable form the fast search replaced, the code before it),
and whether both give the same bytes.
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="ROWSxCOLS (repeatable; default 2816x1024 and 5632x2048)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spec", action="store_true", help="also time the clip search's readable form")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in (a.shape or ["2816x1024", "5632x2048"])]
    print("seconds per matrix, wall/cpu, median of", a.repeat)
    threads = Q.Q4_SEARCH_THREADS
    print(f"{'matrix':>11} {f'q4 {threads} thr':>13} {'q4 1 thread':>13} {'q8':>13}"
          + (f" {'q4 spec':>13} {'same bytes':>10}" if a.spec else ""))
    for rows, cols in shapes:
        w = (np.random.default_rng(0).standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        t4, fast = timed(lambda w=w: Q.quantize_q4(w), a.repeat)
        with mock.patch.object(Q, "Q4_SEARCH_THREADS", 1):
            t1, _ = timed(lambda w=w: Q.quantize_q4(w), a.repeat)
        t8, _ = timed(lambda w=w: Q.quantize_q8(w, compact=True), a.repeat)
        line = f"{rows:>5}x{cols:<5} {t4:>13} {t1:>13} {t8:>13}"
        if a.spec:
            with mock.patch.object(Q, "_q4_scales", Q.q4_scales_spec):
                ts, spec = timed(lambda w=w: Q.quantize_q4(w), a.repeat)
            line += f" {ts:>13} {str(q4_bytes(fast) == q4_bytes(spec)):>10}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
