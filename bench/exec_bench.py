"""Parallel experts: the edge model (bench/models.py) at batch 1, 8 and 64, single-threaded colibri_forward
beside colibri_forward_ex over the POSIX layer's thread pool (posix/colibri_pool.c), in microseconds per call.

    .venv/bin/python bench/exec_bench.py [--workers 2] [--seconds 3] [--dtypes f32,q8]   (or: make bench-exec)

bench/exec_bench.c does the timing in C (alternating rounds of ~20 ms, medians) and checks every parallel
output bit for bit against the single-threaded one. The machine's load average is printed before and
after, and the CPUs the process got during the parallel rounds (its CPU time over wall time): wall-clock
speedup from a second worker needs a second idle core, which a shared machine may not have.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
CORE = ROOT / "firmware" / "colibri_core"
OUT = ROOT / "build" / "bench"
DTYPES = {"f32": {}, "f16": {"dtype": "f16"}, "q8": {"dtype": "q8"}}


def build() -> Path:
    subprocess.run(["make", "-s", "-C", str(CORE), "host"], check=True)
    OUT.mkdir(parents=True, exist_ok=True)
    exe = OUT / "exec_bench"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2", "-D_POSIX_C_SOURCE=200809L",
                    "-ffp-contract=off", "-fno-math-errno", f"-I{CORE / 'include'}", f"-I{CORE / 'posix'}",
                    str(ROOT / "bench" / "exec_bench.c"), str(CORE / "build" / "host" / "libcolibri.a"),
                    "-lm", "-pthread", "-o", str(exe)], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0, help="timing per batch size")
    ap.add_argument("--dtypes", default="f32,q8")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()

    import models  # noqa: PLC0415  (bench/models.py: torch)
    from colibri.frontends.exporter import export  # noqa: PLC0415

    exe = build()
    batches = [b for b in args.batches.split(",") if b]
    rows = []
    load0 = os.getloadavg()
    print(f"edge model, {args.workers} workers vs 1, {os.cpu_count()} CPUs, load average before "
          f"{load0[0]:.2f} (1 min)")
    print(f"{'dtype':<6}{'batch':>6}{'1 thread µs':>14}{f'{args.workers} workers µs':>16}{'speedup':>9}"
          f"{'best 1':>11}{'best n':>11}{'speedup':>9}{'CPUs got':>10}  (median of rounds; best round)")
    for dtype in [d for d in args.dtypes.split(",") if d]:
        image = OUT / f"edge-{dtype}.clb"
        export(models.edge(), image, max_batch=max(int(b) for b in batches), **DTYPES[dtype])
        r = subprocess.run([str(exe), str(image), str(args.seconds), str(args.workers), *batches],
                           capture_output=True, text=True, check=True)
        for line in r.stdout.splitlines():
            row = json.loads(line) | {"dtype": dtype}
            rows.append(row)
            print(f"{dtype:<6}{row['batch']:>6}{row['us_1']:>14,.1f}{row['us_n']:>16,.1f}"
                  f"{row['us_1'] / row['us_n']:>8.2f}×{row['best_1']:>11,.1f}{row['best_n']:>11,.1f}"
                  f"{row['best_1'] / row['best_n']:>8.2f}×{row['cpus_n']:>10.2f}")
    print(f"kernels: {rows[0]['kernels']}" if rows else "no rows")
    load1 = os.getloadavg()
    print(f"load average after {load1[0]:.2f} (1 min); outputs bit-identical to single-threaded in every round")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load_before": load0, "load_after": load1}, indent=1))


if __name__ == "__main__":
    main()
