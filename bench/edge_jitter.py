"""Latency jitter of a mapped model under memory pressure, with and without mlock (issue 11): printed, not asserted.

    .venv/bin/python bench/edge_jitter.py [--layers 2 --experts 32 --d 256 --hidden 512] [--tokens 200] [--skew 0]
        [--memory-max-fraction 0.5] [--headroom 4] [--lock-fraction 0.25] [--cgroup DIR]
    make bench-edge-jitter

Generates a page-aligned, format-v3 model (bench/edge_mmap.py's: GLU f16 experts, top-2 routing),
runs a calibration pass to count how often routing picks each expert, and selects the most used
experts (--lock-fraction of them) to pin. Then, each run in its own child process from a cold page
cache, one token at a time, it prints the per-token latency p50 / p99 / max and major faults per token:

- without memory pressure: no lock, and the selected experts mlock'd (Model(path, lock=[...]));
- under memory pressure: four runs inside a memory cgroup whose limit is below the model size (the
  interpreter's own anonymous memory as the unpressured run measured it, plus --headroom MiB for the
  kernel's, plus --memory-max-fraction of the model, which the pinned experts must fit in), so the
  kernel must evict the file's pages while the tokens run: no lock and mlock'd, each with the route
  callback's MADV_WILLNEED and without advice (advise=False). --skew gives the router a Zipf-like
  expert popularity (trained routers are uneven; the random one is near uniform). Pinned experts cannot be evicted and never fault again. After each
  run, the group's peak usage and how often it hit its limit show that the pressure was real.

The cgroup: --cgroup DIR (an existing, writable memory cgroup: v2 with memory.max or v1 with
memory.limit_in_bytes), or else one created here and removed after: cgroup v2 first (a child of this
process's own cgroup, which needs the memory controller in its cgroup.subtree_control), else cgroup v1
(a child of this process's own memory group, else of the v1 memory hierarchy's root). Which one was
used is printed. In v1, page cache is charged to the group that first touches it: the child joins the
group and drops the file's cached pages before mapping it, so the model's pages are charged to the
group and compete with the process's own memory under memory.limit_in_bytes, as they do under v2's
memory.max. Where no memory cgroup can be had (none mounted, no permission) the pressure runs are
skipped and the reasons are printed: nothing is simulated in their place. On a systemd machine,
`systemd-run --user --scope -p MemoryMax=...` gives a delegated v2 cgroup: pass its directory as --cgroup.

ONNX Runtime's memory on the same kind of model: bench/edge_mmap.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_mmap import build, drop_cache, majflt, mib  # noqa: E402

import colibri  # noqa: E402
from colibri import image  # noqa: E402


def inputs(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, 16)).astype(np.float32)


def child(args: argparse.Namespace) -> None:
    """One measured run (already in its cgroup, if any: see run()), token by token from a cold cache."""
    if args.join and not joined(Path(args.join), Path("/proc/self/cgroup").read_text()):
        raise SystemExit(f"writing {args.join}/cgroup.procs did not move this process into it "
                         f"(/proc/self/cgroup: {Path('/proc/self/cgroup').read_text()!r})")
    lock = [tuple(e) for e in json.loads(args.lock)] or None
    drop_cache(args.model)
    m = colibri.Model(args.model, verify="none", lock=lock, advise=not args.no_advice)
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


@dataclass
class PressureGroup:
    """A memory cgroup the measured runs join: v2 (memory.max) or v1 (memory.limit_in_bytes)."""
    path: Path
    version: int
    created: bool

    @property
    def limit_file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"

    def set_limit(self, limit: int) -> None:
        (self.path / self.limit_file).write_text(str(limit))

    def reset_counters(self) -> None:
        # v1's high-water mark and limit-hit count are resettable by writing 0; v2's are not (reported as read).
        if self.version == 1:
            (self.path / "memory.max_usage_in_bytes").write_text("0")
            (self.path / "memory.failcnt").write_text("0")

    def counters(self) -> str:
        """What shows the limit was reached: the group's peak usage and how often it hit the limit."""
        if self.version == 1:
            peak = int((self.path / "memory.max_usage_in_bytes").read_text())
            hits = int((self.path / "memory.failcnt").read_text())
            return f"group peak usage {mib(peak)}, limit hit {hits} times (memory.failcnt)"
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        peak = self.path / "memory.peak"
        text = f"{mib(int(peak.read_text()))} group peak usage, " if peak.exists() else ""
        return text + f"memory.events max {events.get('max', '?')} (cumulative)"


def _mounts(mountinfo: str) -> list[tuple[Path, str, str, list[str]]]:
    """(mount point, root inside the hierarchy, filesystem type, super options) of each mount."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-")
        out.append((Path(fields[4]), fields[3], fields[sep + 1], fields[sep + 3].split(",")))
    return out


def _inside(mount: Path, root: str, own: str) -> Path:
    """The directory of cgroup `own` (as /proc/self/cgroup names it) under a mount of hierarchy root `root`."""
    rel = os.path.relpath(own, root) if own.startswith(root) else own.lstrip("/")
    return mount if rel == "." else mount / rel


def locate_v2(mountinfo: str, proc_cgroup: str) -> tuple[Path | None, str]:
    """This process's cgroup v2 directory, if the memory controller can be given to a child of it."""
    mount = next(((m, r) for m, r, fs, _ in _mounts(mountinfo) if fs == "cgroup2"), None)
    if mount is None:
        return None, "no cgroup v2 hierarchy is mounted"
    own = next((line[3:] for line in proc_cgroup.splitlines() if line.startswith("0::")), None)
    if own is None:
        return None, "this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)"
    here = _inside(*mount, own)
    controllers = (here / "cgroup.controllers").read_text().split() if (here / "cgroup.controllers").exists() else []
    if "memory" not in controllers:
        return None, (f"cgroup v2: the memory controller is not available in {here} (cgroup.controllers: "
                      f"{' '.join(controllers) or 'none'}; on a hybrid hierarchy it is on cgroup v1)")
    subtree = (here / "cgroup.subtree_control").read_text().split()
    if "memory" not in subtree:
        return None, (f"cgroup v2: the memory controller is not enabled for children of {here} "
                      f"(cgroup.subtree_control: {' '.join(subtree) or 'none'}); pass a delegated --cgroup")
    return here, ""


def locate_v1(mountinfo: str, proc_cgroup: str) -> tuple[list[Path], str]:
    """Where a cgroup v1 memory group may be created: under this process's own group first (its
    limits then still apply above ours), else the hierarchy's mounted root."""
    mount = next(((m, r) for m, r, fs, opts in _mounts(mountinfo) if fs == "cgroup" and "memory" in opts), None)
    if mount is None:
        return [], "cgroup v1: no hierarchy with the memory controller is mounted"
    own = next((line.split(":", 2)[2] for line in proc_cgroup.splitlines()
                if "memory" in line.split(":", 2)[1].split(",")), None)
    if own is None:
        return [], "cgroup v1: /proc/self/cgroup names no memory group for this process"
    here = _inside(*mount, own)
    return ([here, mount[0]] if here != mount[0] else [here]), ""


def cgroup_for_pressure(explicit: Path | None) -> tuple[PressureGroup | None, str]:
    """A memory cgroup whose limit can be set (v2 preferred, else v1), or why there is none."""
    if explicit is not None:
        version = 2 if (explicit / "memory.max").exists() else 1 if (explicit / "memory.limit_in_bytes").exists() else 0
        if not version:
            return None, f"{explicit} has neither memory.max (v2) nor memory.limit_in_bytes (v1): not a memory cgroup"
        group = PressureGroup(explicit, version, False)
        if not os.access(explicit / group.limit_file, os.W_OK) or not os.access(explicit / "cgroup.procs", os.W_OK):
            return None, f"{explicit}/{group.limit_file} or cgroup.procs is not writable by this user"
        return group, ""
    mountinfo = Path("/proc/self/mountinfo").read_text()
    proc_cgroup = Path("/proc/self/cgroup").read_text()
    name = f"colibri-jitter-{os.getpid()}"
    v2, why_v2 = locate_v2(mountinfo, proc_cgroup)
    if v2 is not None:
        try:
            (v2 / name).mkdir()
            return PressureGroup(v2 / name, 2, True), ""
        except OSError as exc:
            why_v2 = f"cgroup v2: cannot create a group under {v2}: {exc.strerror}"
    parents, why_v1 = locate_v1(mountinfo, proc_cgroup)
    refused = []
    for parent in parents:
        try:
            (parent / name).mkdir()
            return PressureGroup(parent / name, 1, True), ""
        except OSError as exc:
            refused.append(f"{parent}: {exc.strerror}")
    if refused:
        why_v1 = f"cgroup v1: cannot create a memory group ({'; '.join(refused)})"
    return None, f"{why_v2}; {why_v1}"


def joined(target: Path, proc_cgroup: str) -> bool:
    """Whether /proc/self/cgroup places this process in `target` (a v2 or a v1 memory group)."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        v2 = controllers == "" and (target / "memory.max").exists()
        v1 = "memory" in controllers.split(",") and (target / "memory.limit_in_bytes").exists()
        if (v1 or v2) and path != "/" and target.resolve().as_posix().endswith(path.rstrip("/")):
            return True
    return False


def run(model: Path, tokens: int, seed: int, lock: list, group: PressureGroup | None = None,
        advise: bool = True) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--tokens", str(tokens), "--seed", str(seed),
           "--lock", json.dumps(lock)]
    if not advise:
        cmd.append("--no-advice")
    if group is not None:
        group.reset_counters()
        # Join before the interpreter starts: memory charged before a move stays with the old group
        # (v1 without move_charge_at_immigrate, and always in v2), so the interpreter's own memory
        # would escape the limit. The child checks /proc/self/cgroup that it is in the group.
        cmd = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group.path), *cmd,
               "--join", str(group.path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == -9 and group is not None:
        raise SystemExit(f"the measured run was killed in {group.path} (out of memory under its {group.limit_file}: "
                         f"the interpreter's own memory did not fit; raise --memory-max-fraction)")
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
    ap.add_argument("--skew", type=float, default=0.0,
                    help="router bias -skew*log(1+expert): a Zipf-like expert popularity (0: the random router's)")
    ap.add_argument("--lock-fraction", type=float, default=0.25, help="share of the experts to pin, most used first")
    ap.add_argument("--memory-max-fraction", type=float, default=0.5,
                    help="the cgroup's limit leaves this share of the model size for its pages (pinned ones included)")
    ap.add_argument("--headroom", type=float, default=4.0,
                    help="MiB of the limit above the interpreter's own memory and the model's share (kernel memory)")
    ap.add_argument("--cgroup", type=Path, default=None, help="a delegated cgroup v2 directory to run in")
    ap.add_argument("--dir", type=Path, default=None, help="where the model file goes (default: a temporary folder)")
    # the measured child process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--lock", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--join", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-advice", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    folder = Path(tempfile.mkdtemp(prefix="colibri-jitter-", dir=args.dir))
    path = folder / "edge.clb"
    data = image.write(build(args.layers, args.experts, args.d, args.hidden, skew=args.skew), page_aligned=True)
    path.write_bytes(data)
    size = len(data)
    del data
    expert_bytes = 3 * args.hidden * args.d * 2
    print(f"model: {args.layers} MoE layers x {args.experts} GLU f16 experts ({mib(expert_bytes)} each), top-2, "
          f"page-aligned format v3: {mib(size)}; router skew {args.skew:g}; {args.tokens} tokens, one at a time")
    group = None
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

        group, why = cgroup_for_pressure(args.cgroup)
        if group is None:
            print(f"under memory pressure: SKIPPED: {why}")
        else:
            room = int(args.memory_max_fraction * size)  # for the model's pages, pinned ones included
            if n_lock * expert_bytes > room:
                raise SystemExit(f"the pinned experts ({mib(n_lock * expert_bytes)}) do not fit in the limit's room for "
                                 f"the model ({mib(room)}): lower --lock-fraction or raise --memory-max-fraction")
            limit = free["anon"] + int(args.headroom * 2**20) + room
            group.set_limit(limit)
            charged = ("; v1 charges the mapped file's page cache to the group, so the model's pages "
                       "compete with the process's own memory" if group.version == 1 else "")
            print(f"under memory pressure: cgroup v{group.version} {group.path}, {group.limit_file} {mib(limit)} "
                  f"(model {mib(size)}, pinned {mib(n_lock * expert_bytes)}, the interpreter's own memory "
                  f"{mib(free['anon'])}){charged}")
            for name, pinned, advise in (("no lock, WILLNEED", [], True), ("no lock, no advice", [], False),
                                         ("mlock'd, WILLNEED", lock, True), ("mlock'd, no advice", lock, False)):
                r = run(path, args.tokens, 1, pinned, group, advise)
                print(report(f"  in the cgroup, {name}", r) + f"; {group.counters()}")
        print("ONNX Runtime peak RSS: measured by bench/edge_mmap.py (make bench-edge-mmap), on its larger model")
    finally:
        if group is not None and group.created:  # its processes have exited
            group.path.rmdir()
        path.unlink(missing_ok=True)
        folder.rmdir()


if __name__ == "__main__":
    main()
