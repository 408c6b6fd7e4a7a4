"""colibri_edge under load with hostile clients (issue 25): figures printed, not asserted.

    .venv/bin/python bench/edge_load.py [--clients 16] [--seconds 10] [--hostile 0,0.25,0.5] [--model edge|small]
    make bench-edge-load     (--repeat 3: three runs per share, their medians)

For each hostile share, a fresh colibri_edge (examples/linux_edge) serves a model on a Unix socket for
--seconds while --clients clients use it, that share of them hostile. Well-behaved clients (this process,
one event loop) each send a request every --period ms (1 to 4 tokens, a fixed pool of inputs) and wait
for its answer; every answer is compared bit for bit (its text: %.9g round-trips f32) with the engine's
own output for that input (colibri.Model, the same C engine through the Python binding). The hostile
clients run in a second process, cycling through five kinds:

- garbage: floods junk lines (random bytes, NULs, non-numbers, wrong widths, a 1.1 MiB line) and reads;
- silent: pipelines full-batch requests and never reads (the service stops reading it, then drops it
  at the send timeout; it reconnects);
- slow reader: pipelines requests and reads 1 KiB every 100 ms;
- slow writer: sends a request one byte every 50 ms (dropped at the request timeout; reconnects);
- idle: holds 24 connections that never send, reconnecting each one the service closes (which pushes
  the service to its client limit, where it evicts them).

Printed: p50/p99/max latency of the well-behaved clients' answers, answers checked and wrong ones,
reconnections they had to make, the service's RSS and open fds sampled every 0.25 s (min/max, and the
series for the largest share), its log size, the CPU share the service and the hostile process used
(CPU, h.CPU: of one core), and whether the service stayed up. Latencies are wall clock on
shared cores: they vary run to run (the load average is printed). --check turns the deterministic
parts into an exit status (no wrong answer, the service alive, fds within the client limit): the CI
run in tests/edge/test_edge_clients.py.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri.frontends.exporter import export

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "linux_edge"
sys.path.insert(0, str(ROOT / "bench"))
import models  # noqa: E402

MAX_CLIENTS = 64  # the service's -c in this bench
SERVICE_ARGS = ["-c", str(MAX_CLIENTS), "-t", "2000", "-r", "2000", "-i", "10000", "-L", "2000"]
HOSTILE_KINDS = ("garbage", "silent", "slow-reader", "slow-writer", "idle")


def small(seed: int = 0):
    """A seconds-sized model for the CI run: 6 -> 24, two MoE layers, -> 4 (tests/edge/test_edge_service.py's)."""
    import torch
    from colibri import nn as cnn
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), cnn.MoE(24, 5, 32, top_k=2, routing="topk_softmax",
                                                               activation="silu", gated=True),
                               cnn.MoE(24, 4, 16, top_k=1, routing="top1", num_shared=1, shared_hidden=8),
                               torch.nn.Linear(24, 4)).eval()


def request_text(x: np.ndarray) -> bytes:
    return (";".join(",".join(repr(float(v)) for v in row) for row in x) + "\n").encode()


def answer_text(y: np.ndarray) -> bytes:
    """The service's answer line for output rows y (its printf("%.9g") of each f32)."""
    return (";".join(",".join("%.9g" % float(v) for v in row) for row in y) + "\n").encode()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_stats(pid: int) -> tuple[float, int]:
    """The service's resident set (MB) and open file descriptors."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


# ---- hostile clients (a process of their own) -----------------------------------------------------------


class Hostile:
    def __init__(self, kind: str, path: str, bad_request: bytes, rng: random.Random):
        self.kind, self.path, self.bad_request, self.rng = kind, path, bad_request, rng
        self.socks: list[socket.socket] = []
        self.pending: dict[socket.socket, bytes] = {}
        self.next_at = 0.0
        self.reconnects = 0

    def connect(self) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(self.path)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError, OSError):
            s.close()
            return None
        self.socks.append(s)
        self.pending[s] = b""
        return s

    def lost(self, s: socket.socket) -> None:
        self.socks.remove(s)
        self.pending.pop(s, None)
        s.close()
        self.reconnects += 1

    def junk(self) -> bytes:
        r = self.rng.random()
        if r < 0.02:
            return b"1," * 600_000 + b"\n"  # past the 1 MiB limit
        if r < 0.3:
            return self.rng.randbytes(self.rng.randrange(1, 200)) + b"\n"
        if r < 0.5:
            return b"nan,\x00,abc;;;\n"
        return self.bad_request[: self.rng.randrange(1, len(self.bad_request))] + b"\n"

    def step(self, now: float) -> None:
        want = 24 if self.kind == "idle" else 1
        while len(self.socks) < want and self.connect():
            pass
        for s in list(self.socks):
            try:
                if self.kind == "garbage" or (self.kind in ("slow-reader", "idle") and now >= self.next_at):
                    try:
                        data = s.recv(1 << 16 if self.kind == "garbage" else 1024)
                        if not data:
                            self.lost(s)
                            continue
                    except BlockingIOError:
                        pass
                if self.kind == "slow-writer":
                    if now >= self.next_at:
                        if not self.pending[s]:
                            self.pending[s] = self.bad_request
                        s.send(self.pending[s][:1])
                        self.pending[s] = self.pending[s][1:]
                    continue
                if self.kind == "idle":
                    continue
                if not self.pending[s]:
                    self.pending[s] = self.junk() if self.kind == "garbage" else self.bad_request * 16
                n = s.send(self.pending[s])
                self.pending[s] = self.pending[s][n:]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.lost(s)
        if now >= self.next_at:
            self.next_at = now + {"slow-reader": 0.1, "slow-writer": 0.05, "idle": 0.05}.get(self.kind, 0)


def run_hostile(kinds: list[str], path: str, bad_request: bytes, stop_at: float, out) -> None:
    rng = random.Random(7)
    clients = [Hostile(k, path, bad_request, rng) for k in kinds]
    while time.monotonic() < stop_at:
        now = time.monotonic()
        for c in clients:
            c.step(now)
        time.sleep(0.002)
    out.send({k: sum(c.reconnects for c in clients if c.kind == k) for k in set(kinds)})


# ---- well-behaved clients --------------------------------------------------------------------------------


class Good:
    def __init__(self, path: str, sel: selectors.BaseSelector):
        self.path, self.sel = path, sel
        self.sock: socket.socket | None = None
        self.buf = b""
        self.sent_at = 0.0
        self.idx = -1
        self.next_at = 0.0
        self.reconnects = 0

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)
        self.sel.register(self.sock, selectors.EVENT_READ, self)
        self.buf, self.idx = b"", -1

    def reconnect(self) -> None:
        """The service closed the connection: the next request goes on a new one, at once."""
        self.sel.unregister(self.sock)
        self.sock.close()
        self.sock, self.idx, self.next_at = None, -1, 0.0
        self.reconnects += 1


def run_good(n: int, path: str, pool: list[tuple[bytes, bytes]], seconds: float, period: float, pid: int):
    sel = selectors.DefaultSelector()
    clients = [Good(path, sel) for _ in range(n)]
    rng = random.Random(1)
    latencies, wrong, samples = [], 0, []
    start = time.monotonic()
    stop_at, next_sample = start + seconds, start
    for i, c in enumerate(clients):
        c.next_at = start + period * i / n
    while (now := time.monotonic()) < stop_at:
        if now >= next_sample:
            try:
                samples.append((now - start, *service_stats(pid)))
            except (FileNotFoundError, ProcessLookupError):
                break
            next_sample = now + 0.25
        for c in clients:
            if c.idx < 0 and now >= c.next_at:
                if c.sock is None:  # connected when it has a request to send, as a real client is
                    c.connect()
                c.idx = rng.randrange(len(pool))
                c.sent_at = time.monotonic()
                try:
                    c.sock.sendall(pool[c.idx][0])
                except (BrokenPipeError, ConnectionResetError):
                    c.reconnect()
        wake = min([c.next_at for c in clients if c.idx < 0] + [next_sample, stop_at])
        for key, _ in sel.select(max(0.0, wake - time.monotonic())):
            c = key.data
            try:
                data = c.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                c.reconnect()
                continue
            c.buf += data
            if c.buf.endswith(b"\n") and c.idx >= 0:
                got = time.monotonic()
                latencies.append(got - c.sent_at)
                wrong += c.buf != pool[c.idx][1]
                c.buf, c.idx = b"", -1
                c.next_at = max(c.sent_at + period, got)
    return latencies, wrong, sum(c.reconnects for c in clients), samples


def one_run(exe: Path, lib: Path, model: Path, work: Path, good_n: int, hostile_n: int, args, pool, bad_request):
    sock = work / "edge.sock"
    log = work / f"edge-{hostile_n}.log"
    proc = subprocess.Popen([str(exe), "-s", str(sock), *SERVICE_ARGS, str(lib), str(model)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + 60
    while b"ready (colibri" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"colibri_edge did not start: {log.read_text()}")
        time.sleep(0.02)
    kinds = [args.kinds[i % len(args.kinds)] for i in range(hostile_n)]
    receive, send = multiprocessing.Pipe(duplex=False)
    hostile = multiprocessing.Process(target=run_hostile, args=(kinds, str(sock), bad_request,
                                                                time.monotonic() + args.seconds + 0.5, send))
    hostile.start()
    time.sleep(0.3)  # the hostile ones first: their connections are in place when measuring starts
    cpu0, hostile_cpu0, wall0 = cpu_seconds(proc.pid), cpu_seconds(hostile.pid), time.monotonic()
    latencies, wrong, reconnects, samples = run_good(good_n, str(sock), pool, args.seconds, args.period / 1000,
                                                     proc.pid)
    wall = time.monotonic() - wall0
    try:
        cpu = (cpu_seconds(proc.pid) - cpu0) / wall
        hostile_cpu = (cpu_seconds(hostile.pid) - hostile_cpu0) / wall
    except FileNotFoundError:
        cpu = hostile_cpu = float("nan")
    hostile_reconnects = receive.recv() if receive.poll(10) else {}
    hostile.join(10)
    alive = proc.poll() is None
    if alive:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return dict(latencies=np.array(latencies) * 1000, wrong=wrong, reconnects=reconnects, samples=samples,
                alive=alive, exit=proc.returncode, log_bytes=log.stat().st_size,
                log_lines=len(log.read_bytes().splitlines()), hostile=hostile_reconnects, cpu=cpu,
                hostile_cpu=hostile_cpu)


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--hostile", default="0,0.25,0.5", help="hostile shares, comma separated")
    p.add_argument("--period", type=float, default=100, help="ms between a well-behaved client's requests")
    p.add_argument("--model", choices=("edge", "small"), default="edge")
    p.add_argument("--kinds", default=",".join(HOSTILE_KINDS), help="hostile kinds to cycle through")
    p.add_argument("--repeat", type=int, default=1, help="runs per share (the medians of p50/p99 are printed)")
    p.add_argument("--check", action="store_true", help="exit 1 on a wrong answer, a death or fds past the limit")
    args = p.parse_args()
    args.kinds = args.kinds.split(",")
    if not args.kinds or set(args.kinds) - set(HOSTILE_KINDS):
        p.error(f"--kinds takes some of {','.join(HOSTILE_KINDS)}")

    r = subprocess.run(["make", "-s", "-C", str(EXAMPLE)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    exe, lib = EXAMPLE / "build" / "host" / "colibri_edge", EXAMPLE / "build" / "host" / "libcolibri.so.0"
    shares = [float(s) for s in args.hostile.split(",")]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "model.clb"
        net = models.edge() if args.model == "edge" else small()
        export(net, model, max_batch=8)
        engine = colibri.Model(model.read_bytes())
        width = engine.info["input_size"]
        rng = np.random.default_rng(0)
        pool = []
        for i in range(32):
            x = rng.standard_normal((1 + i % 4, width)).astype(np.float32)
            pool.append((request_text(x), answer_text(engine.forward(x))))
        bad_request = request_text(rng.standard_normal((8, width)).astype(np.float32))
        print(f"colibri_edge load: model {args.model} ({model.stat().st_size / 1e6:.1f} MB, in {width}, "
              f"out {engine.info['output_size']}), {args.clients} clients, {args.seconds:g} s per share, a request "
              f"of 1-4 tokens every {args.period:g} ms per well-behaved client; service {' '.join(SERVICE_ARGS)}")
        print(f"{cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} before")
        print(f"{'hostile':>8} {'good':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'answers':>8} {'wrong':>6} "
              f"{'reconn':>6} {'RSS MB':>11} {'fds':>7} {'log':>9} {'CPU':>4} {'h.CPU':>5}  alive")
        last, medians = None, []
        for share in [s for s in shares for _ in range(args.repeat)]:
            hostile_n = round(share * args.clients)
            good_n = args.clients - hostile_n
            res = one_run(exe, lib, model, work, good_n, hostile_n, args, pool, bad_request)
            lat, samples = res["latencies"], res["samples"]
            rss = [s[1] for s in samples] or [0]
            fds = [s[2] for s in samples] or [0]
            p50, p99, mx = (np.percentile(lat, 50), np.percentile(lat, 99), lat.max()) if len(lat) else (0, 0, 0)
            print(f"{share:>7.0%} {good_n:>5} {p50:>7.2f} {p99:>7.2f} {mx:>7.1f} {len(lat):>8} {res['wrong']:>6} "
                  f"{res['reconnects']:>6} {min(rss):>5.1f}-{max(rss):<5.1f} {min(fds):>3}-{max(fds):<3} "
                  f"{res['log_lines']:>4} lines {res['cpu']:>4.0%} {res['hostile_cpu']:>5.0%}  "
                  f"{'yes' if res['alive'] else 'NO (exit %s)' % res['exit']}")
            if res["hostile"]:
                print(f"{'':>8} hostile reconnections (dropped or evicted by the service): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(res["hostile"].items())))
            if res["wrong"] or not res["alive"] or max(fds) > MAX_CLIENTS + 16 or not len(lat):
                failures.append(f"{share:.0%} hostile: {res['wrong']} wrong, alive {res['alive']}, "
                                f"fds up to {max(fds)}, {len(lat)} answers")
            last = (share, samples)
            medians.append((share, p50, p99))
        if last and last[1]:
            step = max(1, len(last[1]) // 12)
            print(f"service over time at {last[0]:.0%} hostile (s: RSS MB / fds): "
                  + "  ".join(f"{t:.1f}: {r:.1f}/{f}" for t, r, f in last[1][::step]))
        if args.repeat > 1:
            for share in shares:
                runs = [m for m in medians if m[0] == share]
                print(f"{share:>7.0%} hostile, median of {len(runs)} runs: p50 "
                      f"{np.median([m[1] for m in runs]):.2f} ms, p99 {np.median([m[2] for m in runs]):.2f} ms "
                      f"(p99 from {min(m[2] for m in runs):.1f} to {max(m[2] for m in runs):.1f})")
    print(f"load average {os.getloadavg()[0]:.2f} after")
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
