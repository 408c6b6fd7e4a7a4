"""Latency jitter of a mapped model under memory pressure, with and without mlock (issue 11): printed, not asserted.

    .venv/bin/python bench/edge_jitter.py [--layers 2 --experts 32 --d 256 --hidden 512] [--tokens 200]
        [--memory-max-fraction 0.5] [--lock-fraction 0.25] [--cgroup DIR]
    make bench-edge-jitter

Generates a page-aligned, format-v3 model (bench/edge_mmap.py's: GLU f16 experts, top-2 routing),
runs a calibration pass to count how often routing picks each expert, and selects the most used
experts (--lock-fraction of them) to pin. Then, each run in its own child process from a cold page
cache, one token at a time, it prints the per-token latency p50 / p99 / max and major faults per token:

- without memory pressure: no lock, and the selected experts mlock'd (Model(path, lock=[...]));
- under memory pressure: the same two runs inside a cgroup v2 whose memory.max is below the model size
  (the interpreter's own anonymous memory as the unpressured run measured it, plus 16 MiB, plus
  --memory-max-fraction of the model, plus the pinned bytes), so the kernel must evict the file's
  pages while the tokens run; pinned experts cannot be evicted and never fault again.

The cgroup: --cgroup DIR (an existing cgroup v2 directory with the memory controller, writable), or
else a child of this process's own cgroup v2, created and removed here, which needs the memory
controller enabled in that cgroup's cgroup.subtree_control. Where neither is possible (no cgroup v2,
memory only on cgroup v1, no permission) the pressure runs are skipped and the reason is printed:
nothing is simulated in their place. On a systemd machine, `systemd-run --user --scope -p
MemoryMax=...` gives a delegated cgroup: pass its directory as --cgroup.

ONNX Runtime on the same model: see the last line of the output.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_mmap import build, drop_cache, majflt, mib  # noqa: E402

import colibri  # noqa: E402
from colibri import image  # noqa: E402


def inputs(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, 16)).astype(np.float32)


def child(args: argparse.Namespace) -> None:
    """One measured run: join the cgroup first (before the model is mapped), then token by token."""
    if args.join:
        Path(args.join, "cgroup.procs").write_text(str(os.getpid()))
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
        if not Path(args.join).resolve().as_posix().endswith(own.rstrip("/")) or own == "/":
            raise SystemExit(f"writing {args.join}/cgroup.procs did not move this process into it "
                             f"(/proc/self/cgroup says {own}): not a cgroup v2 directory")
    lock = [tuple(e) for e in json.loads(args.lock)] or None
    drop_cache(args.model)
    m = colibri.Model(args.model, verify="none", lock=lock)
    x = inputs(args.tokens, args.seed)
    times, faults = [], []
    for row in x:
        f0, t0 = majflt(), time.perf_counter()
        m.forward(row[None, :])
        times.append(time.perf_counter() - t0)
        faults.append(majflt() - f0)
    anon = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("RssAnon:"))) * 1024
    print(json.dumps({"times": times, "faults": faults, "resident": m.file.resident(), "anon": anon}))


def cgroup_for_pressure(explicit: Path | None) -> tuple[Path | None, bool, str]:
    """A cgroup v2 directory whose memory.max can be set, whether we created it, or why there is none."""
    if explicit is not None:
        if not (explicit / "memory.max").exists():
            return None, False, f"{explicit} has no memory.max (not a cgroup v2 directory with the memory controller)"
        if not os.access(explicit / "memory.max", os.W_OK) or not os.access(explicit / "cgroup.procs", os.W_OK):
            return None, False, f"{explicit}/memory.max or cgroup.procs is not writable by this user"
        return explicit, False, ""
    mount = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            mount = Path(fields[4])
            break
    if mount is None:
        return None, False, "no cgroup v2 hierarchy is mounted"
    own = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")), None)
    if own is None:
        return None, False, "this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)"
    here = mount / own.lstrip("/")
    controllers = (here / "cgroup.controllers").read_text().split() if (here / "cgroup.controllers").exists() else []
    if "memory" not in controllers:
        return None, False, (f"the memory controller is not available in cgroup v2 here ({here}/cgroup.controllers: "
                             f"{' '.join(controllers) or 'none'}; on a hybrid hierarchy it is on cgroup v1)")
    subtree = (here / "cgroup.subtree_control").read_text().split()
    if "memory" not in subtree:
        return None, False, (f"the memory controller is not enabled for children of {here} "
                             f"(cgroup.subtree_control: {' '.join(subtree) or 'none'}); pass a delegated --cgroup")
    target = here / f"colibri-jitter-{os.getpid()}"
    try:
        target.mkdir()
    except OSError as exc:
        return None, False, f"cannot create a cgroup under {here}: {exc.strerror}"
    return target, True, ""


def run(model: Path, tokens: int, seed: int, lock: list, cgroup: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--tokens", str(tokens), "--seed", str(seed),
           "--lock", json.dumps(lock)]
    if cgroup is not None:
        cmd += ["--join", str(cgroup)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"measured run failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def report(name: str, r: dict) -> str:
    t = np.array(r["times"][1:]) * 1e3  # the first token pays the cold open: reported apart
    return (f"{name}: p50 {np.percentile(t, 50):.3f} ms, p99 {np.percentile(t, 99):.3f} ms, max {t.max():.3f} ms "
            f"per token; {np.mean(r['faults'][1:]):.2f} major faults/token; first token {r['times'][0] * 1e3:.1f} ms; "
            f"{mib(r['resident'])} of the file resident at the end")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--lock-fraction", type=float, default=0.25, help="share of the experts to pin, most used first")
    ap.add_argument("--memory-max-fraction", type=float, default=0.5,
                    help="memory.max: this share of the model size, plus the pinned bytes")
    ap.add_argument("--cgroup", type=Path, default=None, help="a delegated cgroup v2 directory to run in")
    ap.add_argument("--dir", type=Path, default=None, help="where the model file goes (default: a temporary folder)")
    # the measured child process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--lock", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--join", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    folder = Path(tempfile.mkdtemp(prefix="colibri-jitter-", dir=args.dir))
    path = folder / "edge.clb"
    data = image.write(build(args.layers, args.experts, args.d, args.hidden), page_aligned=True)
    path.write_bytes(data)
    size = len(data)
    del data
    expert_bytes = 3 * args.hidden * args.d * 2
    print(f"model: {args.layers} MoE layers x {args.experts} GLU f16 experts ({mib(expert_bytes)} each), top-2, "
          f"page-aligned format v3: {mib(size)}; {args.tokens} tokens, one at a time")
    cgroup, created = None, False
    try:
        # Calibration on other inputs than the measured ones: how often routing picks each expert.
        counts = np.zeros((args.layers, args.experts), np.int64)

        def count(layer: int, experts: list[int], tokens: list[int]) -> None:
            for record, n in zip(experts, tokens):
                counts[layer, record - layer * args.experts] += n

        calib = colibri.Model(path, verify="none")
        for row in inputs(args.tokens, seed=99):
            calib.forward(row[None, :], on_route=count)
        del calib
        n_lock = max(1, round(args.lock_fraction * args.layers * args.experts))
        hottest = np.argsort(-counts, axis=None, kind="stable")[:n_lock]
        lock = [[int(i // args.experts), int(i % args.experts)] for i in hottest]
        share = counts.flat[hottest].sum() / counts.sum()
        print(f"pinned: the {n_lock} most used experts ({mib(n_lock * expert_bytes)}), {share:.0%} of the "
              f"calibration's expert calls")

        free = run(path, args.tokens, 1, [], None)
        print(report("no pressure, no lock", free))
        print(report("no pressure, mlock'd", run(path, args.tokens, 1, lock, None)))

        cgroup, created, why = cgroup_for_pressure(args.cgroup)
        if cgroup is None:
            print(f"under memory pressure: SKIPPED: {why}")
        else:
            limit = free["anon"] + 16 * 2**20 + int(args.memory_max_fraction * size) + n_lock * expert_bytes
            (cgroup / "memory.max").write_text(str(limit))
            print(f"under memory pressure: cgroup {cgroup}, memory.max {mib(limit)} (model {mib(size)})")
            print(report("  in the cgroup, no lock", run(path, args.tokens, 1, [], cgroup)))
            print(report("  in the cgroup, mlock'd", run(path, args.tokens, 1, lock, cgroup)))
        if importlib.util.find_spec("onnxruntime") is None:
            print("ONNX Runtime peak RSS: NOT MEASURED: onnxruntime is not installed in this venv "
                  "(COLIBRI_BENCH=1 ./scripts/setup.sh installs it)")
        else:
            print("ONNX Runtime peak RSS: NOT MEASURED: this script has no ONNX export of the model yet")
    finally:
        if created:  # its processes have exited
            cgroup.rmdir()
        path.unlink(missing_ok=True)
        folder.rmdir()


if __name__ == "__main__":
    main()
