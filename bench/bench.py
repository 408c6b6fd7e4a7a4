"""`make bench`: Colibri beside PyTorch, ONNX Runtime, LiteRT and TFLM, one thread each, one run.

    .venv/bin/python bench/bench.py [--quick] [--out build/bench]

Models (bench/models.py): meter and edge (issue 10) and examples/smart_meter's forecaster.
Every engine runs in its own subprocess (so its peak RSS is its own, from getrusage), is
checked against PyTorch on the whole input pool before it is timed (an engine that gets a
different answer is reported as wrong and not timed), then timed over the pool cycled in
batches so routing varies: median microseconds per forward over repeated passes. The same
run measures numpy's read bandwidth over an array the size of edge's weights (as cache-resident
as the timed loop keeps them) and over one larger than the last-level cache, and prints the
bandwidth-bound time of edge at batch 1. Writes build/bench/bench.json and bench.png.
Wall-clock on a shared machine: compare ratios from the same run.
"""
from __future__ import annotations

import os

# Before numpy/torch load: their thread pools read these once.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
os.environ.update(THREAD_ENV)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

# (model, batch) in the order printed; pool rows per model (a multiple of every batch).
CONFIGS = [("meter", 1), ("smart_meter", 1), ("edge", 1), ("edge", 8), ("edge", 64)]
POOL = {"meter": 256, "smart_meter": 256, "edge": 128}
# The engine every ratio is taken against, and the order of the columns.
ENGINES = ["colibri-c", "colibri-c-ref", "colibri-c-f16", "colibri-c-q8", "colibri-c-q8i8", "colibri", "torch", "torch-gather", "onnxruntime",
           "onnxruntime-masked", "onnxruntime-loop", "litert", "tflm"]
BASELINE = "colibri-c"
# The C driver's rows: (image dtype, reference kernels?). "colibri" is the Python binding (f32),
# which adds Python's call overhead.
C_ENGINES = {"colibri-c": ("f32", False), "colibri-c-ref": ("f32", True), "colibri-c-f16": ("f16", False),
             "colibri-c-q8": ("q8", False), "colibri-c-q8i8": ("q8i8", False)}
# Correctness against PyTorch, relative to max(1, max|reference|): f32 engines differ from
# torch only in summation order; f16/q8 weights carry their quantisation error, and a token
# near a routing tie may pick another expert, so those need 99% of rows within the bound.
TOLERANCE = {"colibri-c-f16": 2e-2, "colibri-c-q8": 8e-2, "colibri-c-q8i8": 8e-2}
F32_TOLERANCE = 1e-4
PYPI = {"onnxruntime": "onnxruntime", "onnxruntime-loop": "onnxruntime", "onnxruntime-masked": "onnxruntime", "litert": "ai_edge_litert",
        "tflm": "tflite_micro"}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------- preparation (parent)

def bytes_per_token(module) -> int:
    """f32 weight bytes one token reads: every dense weight, each MoE's router and k experts."""
    import torch
    from colibri import nn as cnn

    total, inside = 0, set()
    for m in module.modules():
        if isinstance(m, cnn.MoE):
            per_expert = sum(p.numel() for p in m.experts[0].parameters())
            total += sum(p.numel() for p in m.router.parameters()) + m.top_k * per_expert
            inside.update(id(p) for p in m.parameters())
    total += sum(p.numel() for p in module.parameters() if id(p) not in inside)
    return total * torch.finfo(torch.float32).bits // 8


def prepare(work: Path, models: list[str], skipped: dict[str, str]) -> dict:
    """Images, exports, input pools and PyTorch's outputs for every model, under `work`."""
    import torch

    import colibri
    import models as M

    torch.set_num_threads(1)
    info = {}
    for name in models:
        if name == "smart_meter":
            module, origin = M.smart_meter()
        else:
            module, origin = M.MODELS[name](), "seeded random weights"
        n_in = next(p for p in module.parameters()).shape[1]
        batches = [b for m, b in CONFIGS if m == name]
        x = np.random.default_rng(1).standard_normal((POOL[name], n_in)).astype(np.float32)
        with torch.no_grad():
            ref = module(torch.from_numpy(x)).numpy()
            gathered = M.gather_variant(module)(torch.from_numpy(x)).numpy()
        # The peers run the gather variant: it must be the same function as the module.
        gerr = float(np.abs(gathered - ref).max() / max(1.0, np.abs(ref).max()))
        assert gerr <= F32_TOLERANCE, f"{name}: the gather variant differs from the module by {gerr:.2e}"
        np.save(work / f"{name}_x.npy", x)
        np.save(work / f"{name}_ref.npy", ref)
        torch.save(module, work / f"{name}.pt")
        torch.save(M.gather_variant(module), work / f"{name}-gather.pt")
        images = {}
        for dtype in ("f32", "f16", "q8"):
            result = colibri.export(module, work / f"{name}_{dtype}.clb", max_batch=max(batches), dtype=dtype)
            images[dtype] = len(result.image)
        # q8 with int8 activations in every layer and expert (INT8_ACT): the same weights, int32 sums.
        result = colibri.export(module, work / f"{name}_q8i8.clb", max_batch=max(batches), dtype="q8", int8_act=["*"])
        images["q8i8"] = len(result.image)
        info[name] = {"origin": origin, "params": sum(p.numel() for p in module.parameters()),
                      "bytes_per_token": bytes_per_token(module), "images": images, "batches": batches}
        if installed("onnx") and installed("onnxruntime"):
            export_onnx(M.gather_variant(module), torch.from_numpy(x[:max(batches)]), work / f"{name}.onnx")
            # The module as written (a loop over experts, each on the tokens routed to it): traced,
            # it may or may not keep routing; the check before timing says which.
            export_onnx(module, torch.from_numpy(x[:max(batches)]), work / f"{name}-loop.onnx")
            # Every expert on every token, the unchosen gated to 0 (TFLM's variant): right answers,
            # num_experts/top_k times the work, but whole-batch GEMMs.
            export_onnx(M.masked_variant(module), torch.from_numpy(x[:max(batches)]), work / f"{name}-masked.onnx")
        if installed("litert_torch"):
            for b in batches:
                variants = [("litert", M.gather_variant, "")]
                if name != "edge":  # TFLM is for microcontroller-sized models
                    variants.append(("tflm", M.masked_variant, "_tflm"))
                for engine, variant, suffix in variants:
                    try:
                        export_tflite(variant(module), torch.from_numpy(x[:b]), work / f"{name}_b{b}{suffix}.tflite")
                    except Exception as exc:  # noqa: BLE001  (a converter failure is reported, not fatal)
                        skipped[f"{engine}:{name}:{b}"] = f"conversion failed: {type(exc).__name__}: {exc}"[:200]
    return info


def export_onnx(module, x, path: Path) -> None:
    import torch

    with torch.no_grad():
        torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"], dynamo=False,
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17)


def export_tflite(module, x, path: Path) -> None:
    import litert_torch

    litert_torch.convert(module, (x,)).export(str(path))


# ---------------------------------------------------------------- workers (one per subprocess)

def runner(engine: str, name: str, batch: int, work: Path):
    """(forward(x[batch, in]) -> y, extra facts) for one engine."""
    extra: dict = {}
    if engine == "colibri":
        import colibri

        model = colibri.Model(work / f"{name}_f32.clb")
        extra.update(arena_bytes=model.arena_size, image_bytes=model.image_size)
        return model.forward, extra
    if engine.startswith("torch"):
        import torch

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        extra["threads"] = f"torch.set_num_threads(1), interop 1 (now {torch.get_num_threads()})"
        suffix = "-gather" if engine == "torch-gather" else ""
        module = torch.load(work / f"{name}{suffix}.pt", weights_only=False).eval()
        torch.set_grad_enabled(False)
        return (lambda a: module(torch.from_numpy(a)).numpy()), extra
    if engine.startswith("onnxruntime"):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        suffix = engine.removeprefix("onnxruntime")
        sess = ort.InferenceSession(str(work / f"{name}{suffix}.onnx"), opts, providers=["CPUExecutionProvider"])
        extra["threads"] = "intra_op 1, inter_op 1, sequential"
        return (lambda a: sess.run(None, {"x": a})[0]), extra
    if engine == "litert":
        from ai_edge_litert.interpreter import Interpreter

        interp = Interpreter(model_path=str(work / f"{name}_b{batch}.tflite"), num_threads=1)
        interp.allocate_tensors()
        i, o = interp.get_input_details()[0]["index"], interp.get_output_details()[0]["index"]
        extra["threads"] = "num_threads=1"

        def run(a):
            interp.set_tensor(i, a)
            interp.invoke()
            return interp.get_tensor(o)
        return run, extra
    if engine == "tflm":
        from tflite_micro.python.tflite_micro import runtime

        interp = runtime.Interpreter.from_file(str(work / f"{name}_b{batch}_tflm.tflite"), arena_size=1 << 20)

        def run(a):
            interp.set_input(a, 0)
            interp.invoke()
            return interp.get_output(0)
        extra["arena_bytes"] = tflm_arena(interp)
        extra["threads"] = "single-threaded by design"
        return run, extra
    raise ValueError(engine)


@contextlib.contextmanager
def fds_to(f):
    """fds 1 and 2 (C and C++ code print there too, past sys.stdout) into the open file f."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd in saved:
        os.dup2(f.fileno(), fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        libc.fflush(None)
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)


def tflm_arena(interp) -> int:
    """The arena TFLM's recording allocator reports (it prints it from C, past sys.stdout,
    and the worker's stdout carries its JSON)."""
    import re
    import tempfile

    with tempfile.TemporaryFile() as f:
        with fds_to(f):
            interp.print_allocations()
        f.seek(0)
        text = f.read().decode(errors="replace")
    m = re.search(r"Arena allocation total (\d+) bytes", text)
    if not m:
        raise RuntimeError(f"TFLM reported no arena total: {text[:200]!r}")
    return int(m.group(1))


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM): getrusage's ru_maxrss would carry the parent's
    peak across fork and exec, and the parent holds every converter."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check(y: np.ndarray, ref: np.ndarray, engine: str) -> tuple[bool, float]:
    scale = max(1.0, float(np.abs(ref).max()))
    rows = np.abs(y.reshape(ref.shape) - ref).max(axis=1) / scale
    if engine in TOLERANCE:
        return bool(np.quantile(rows, 0.99) <= TOLERANCE[engine]), float(np.quantile(rows, 0.99))
    return bool(rows.max() <= F32_TOLERANCE), float(rows.max())


def time_blocks(block, calls: int, budget: float) -> float:
    """Median seconds per call over passes of `block` (each `calls` forwards)."""
    block()
    times: list[float] = []
    end = time.perf_counter() + budget
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 5000):
        t0 = time.perf_counter()
        block()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def worker(engine: str, name: str, batch: int, work: Path, budget: float, timed: bool = True) -> dict:
    x, ref = np.load(work / f"{name}_x.npy"), np.load(work / f"{name}_ref.npy")
    chunks = [np.ascontiguousarray(x[i : i + batch]) for i in range(0, len(x), batch)]
    if engine in C_ENGINES:
        out = c_worker(engine, name, batch, work, budget if timed else 0.0, x, ref)
        if not timed:
            out.pop("us", None)
        return out
    fn, extra = runner(engine, name, batch, work)
    ok, err = check(np.concatenate([np.asarray(fn(c)) for c in chunks]), ref, engine)
    out = {"ok": ok, "error": err, **extra}
    if ok and timed:
        def block():
            for c in chunks:
                fn(c)
        out["us"] = time_blocks(block, len(chunks), budget) * 1e6
    out["rss_mb"] = peak_rss_mb()
    return out


def c_driver() -> Path:
    return ROOT / "build" / "bench" / "colibri_bench"


def c_worker(engine: str, name: str, batch: int, work: Path, budget: float, x: np.ndarray,
             ref: np.ndarray) -> dict:
    """The C driver (bench/colibri_bench.c): colibri_forward with no Python in the loop."""
    dtype, reference = C_ENGINES[engine]
    outf = work / f"{name}_b{batch}_{engine}.out"
    res = subprocess.run([str(c_driver()), str(work / f"{name}_{dtype}.clb"), str(batch), str(work / f"{name}_x.f32"),
                          str(len(x)), str(outf), f"{budget}", *(["reference"] if reference else [])],
                         capture_output=True, text=True, check=True)
    facts = json.loads(res.stdout)
    ok, err = check(np.fromfile(outf, dtype=np.float32), ref, engine)
    out = {"ok": ok, "error": err, "arena_bytes": facts["arena_bytes"], "image_bytes": facts["image_bytes"],
           "rss_mb": facts["rss_kib"] / 1024, "kernels": facts["kernels"]}
    if ok:
        out["us"] = facts["us"]
    return out


def bandwidth(n_bytes: int, budget: float) -> float:
    """GB/s of np.sum over a float32 array of n_bytes, timed in a loop (so as cache-resident as it fits)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    t = time_blocks(lambda: a.sum(), 1, budget)
    return n_bytes / t / 1e9


def llc_bytes() -> int:
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        s = f.read_text().strip()
        sizes.append(int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]] if s[-1].isalpha() else int(s))
    return max(sizes, default=32 << 20)


# ---------------------------------------------------------------- orchestration

def spawn(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env={**os.environ, **THREAD_ENV})
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "failed": tail[:200]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def availability(work: Path, skipped: dict[str, str]) -> list[str]:
    engines = []
    for e in ENGINES:
        if e in C_ENGINES and not c_driver().exists():
            skipped[e] = f"{c_driver().relative_to(ROOT)} not built (make bench builds it)"
        elif e in PYPI and not installed(PYPI[e]):
            skipped[e] = f"PyPI package for {PYPI[e]} not installed (pip install -e '.[bench]')"
        elif e in ("litert", "tflm") and not installed("litert_torch"):
            skipped[e] = "no PyTorch->TFLite converter installed (litert-torch); nothing to run"
        else:
            engines.append(e)
    return engines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per engine and config")
    ap.add_argument("--models", default="meter,smart_meter,edge")
    ap.add_argument("--worker", nargs=3, metavar=("ENGINE", "MODEL", "BATCH"))
    ap.add_argument("--bandwidth", type=int, metavar="BYTES")
    ap.add_argument("--baseline", action="store_true", help="peak RSS of a worker that runs no engine")
    ap.add_argument("--check-only", action="store_true", help="with --worker: the correctness check, no timing")
    ap.add_argument("--no-device", action="store_true",
                    help="skip the Cortex-M7 (QEMU) and image-size figures (scripts/measure.py's m7 group)")
    args = ap.parse_args(argv)
    work = args.out
    if args.worker:
        e, m, b = args.worker
        print(json.dumps(worker(e, m, int(b), work, args.budget, timed=not args.check_only)))
        return 0
    if args.baseline:
        print(json.dumps({"rss_mb": peak_rss_mb()}))
        return 0
    if args.bandwidth:
        print(json.dumps({"gbs": bandwidth(args.bandwidth, args.budget)}))
        return 0

    work.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    skipped: dict[str, str] = {}
    print("threads: " + ", ".join(f"{k}={v}" for k, v in THREAD_ENV.items())
          + "; torch.set_num_threads(1); ORT intra_op=1 inter_op=1; LiteRT num_threads=1; TFLM and Colibri single-threaded")
    log = work / "convert.log"
    print(f"exporting the models (the converters' output goes to {log.relative_to(ROOT) if log.is_relative_to(ROOT) else log})")
    with log.open("w") as f, fds_to(f):
        info = prepare(work, models, skipped)
    for name in models:
        np.load(work / f"{name}_x.npy").tofile(work / f"{name}_x.f32")
        i = info[name]
        print(f"{name}: {i['params']:,} params ({i['origin']}), f32 image {i['images']['f32']:,} B, "
              f"f16 {i['images']['f16']:,} B, q8 {i['images']['q8']:,} B, {i['bytes_per_token']:,} weight B per token")
    engines = availability(work, skipped)
    results: dict[str, dict[str, dict]] = {}
    for name, batch in CONFIGS:
        if name not in models:
            continue
        key = f"{name} b{batch}"
        results[key] = {}
        for e in engines:
            if f"{e}:{name}:{batch}" in skipped:
                continue
            if e == "tflm" and name == "edge":
                skipped[f"tflm:{name}:{batch}"] = "a 33 MB model is outside TFLM's scope (microcontrollers); not run"
                continue
            r = spawn(["--worker", e, name, str(batch), "--out", str(work), "--budget", str(args.budget)])
            if "failed" in r:
                why = r["failed"].replace("onnxruntime.capi.onnxruntime_pybind11_state.", "")
                if e == "onnxruntime-loop":  # the traced loop bakes in the routing of its example batch
                    why = f"the traced module breaks on a routing unlike its example batch's: {why}"
                skipped[f"{e}:{name}:{batch}"] = f"failed: {why}"[:240]
                continue
            results[key][e] = r
    bw = {}
    if "edge" in models:
        big = max(4 * llc_bytes(), 256 << 20)
        bw["edge_weights_bytes"] = info["edge"]["images"]["f32"]
        bw["resident_gbs"] = spawn(["--bandwidth", str(bw["edge_weights_bytes"]), "--budget", str(args.budget)]).get("gbs")
        bw["dram_bytes"] = big
        bw["dram_gbs"] = spawn(["--bandwidth", str(big), "--budget", str(2 * args.budget)]).get("gbs")
        bw["llc_bytes"] = llc_bytes()
        bw["edge_b1_bytes_per_token"] = info["edge"]["bytes_per_token"]
    bw["python_numpy_rss_mb"] = spawn(["--baseline"]).get("rss_mb")
    report(results, skipped, bw, info)
    goals = targets(results, bw, info)
    device = {} if args.no_device else device_figures()
    goals += device_targets(device)
    if goals:
        print("\nissue 10 targets (this run):")
        for what, figures, met in goals:
            print(f"  [{'met' if met else 'not yet'}] {what}: {figures}")
    (work / "bench.json").write_text(json.dumps({"results": results, "skipped": skipped, "bandwidth": bw,
                                                 "targets": [list(g) for g in goals], "device": device,
                                                 "models": info, "threads": THREAD_ENV}, indent=1))
    chart(results, work / "bench.png")
    print(f"wrote {work / 'bench.json'} and {work / 'bench.png'}")
    return 0


def report(results: dict, skipped: dict, bw: dict, info: dict) -> None:
    print(f"\n{'model, batch':<16} {'engine':<18} {'median us':>11} {'/Colibri':>9} {'peak RSS MB':>11} "
          f"{'arena B':>9} {'err vs torch':>12}")
    for key, row in results.items():
        base = row.get(BASELINE, row.get("colibri", {})).get("us")
        for e, r in row.items():
            us = f"{r['us']:,.1f}" if "us" in r else "WRONG"
            ratio = f"{r['us'] / base:.2f}" if "us" in r and base else "-"
            arena = f"{r['arena_bytes']:,}" if "arena_bytes" in r else "-"
            print(f"{key:<16} {e:<18} {us:>11} {ratio:>9} {r['rss_mb']:>11.1f} {arena:>9} {r['error']:>12.1e}")
    print("\nfastest correct peer per model and batch (tokens/s; Colibri = the C driver):")
    for key, row in results.items():
        peers = {e: r["us"] for e, r in row.items() if not e.startswith("colibri") and "us" in r}
        base = row.get(BASELINE, {}).get("us")
        if peers and base:
            best = min(peers, key=peers.get)
            batch = int(key.rpartition("b")[2])
            print(f"  {key:<16} {best} {peers[best]:,.1f} us ({batch / peers[best] * 1e6:,.0f} tokens/s); "
                  f"Colibri {base:,.1f} us ({batch / base * 1e6:,.0f} tokens/s): peer/Colibri {peers[best] / base:.2f}")
    kernels = sorted({r["kernels"] for row in results.values() for e, r in row.items() if "kernels" in r})
    print(f"(peak RSS of a Python worker with numpy and no engine: {bw['python_numpy_rss_mb']:.1f} MB; colibri-c* is "
          f"the C driver alone, kernels: {', '.join(kernels) or 'n/a'}; colibri-c-ref runs the reference kernels, "
          "colibri-c-q8i8 the q8 image with int8 activations in every layer and expert, colibri the Python binding. Peers run torch.topk + index_select routing (bench/models.py GatherMoE) except: "
          "torch = the colibri.nn module as written; onnxruntime-masked and tflm compute every expert and gate the "
          "unchosen to 0 (TFLM lacks TOPK_V2, ONE_HOT and the converter's bounds-checked gathers); "
          "onnxruntime-loop = the module as written, traced)")
    if skipped:
        print("\nnot measured:")
        for k, why in skipped.items():
            print(f"  {k}: {why}")
    if "edge_b1_bytes_per_token" in bw:
        tok = bw["edge_b1_bytes_per_token"]
        print(f"\nread bandwidth (numpy sum, one thread; last-level cache {bw['llc_bytes'] / 2**20:.0f} MiB):")
        for label, nbytes, gbs in (("edge-weights-sized array", bw["edge_weights_bytes"], bw["resident_gbs"]),
                                   ("larger than the LLC", bw["dram_bytes"], bw["dram_gbs"])):
            if gbs:
                print(f"  {label} ({nbytes / 2**20:.1f} MiB): {gbs:.1f} GB/s -> edge batch 1 "
                      f"({tok / 1e6:.2f} MB of weights per token) bound {tok / gbs / 1e3:,.0f} us")
        base = results.get("edge b1", {}).get(BASELINE, {}).get("us")
        if base and bw.get("resident_gbs"):
            print(f"  Colibri edge batch 1: {base:,.0f} us = {base / (tok / bw['resident_gbs'] / 1e3):.2f}x the "
                  f"edge-weights-sized bound, {base / (tok / bw['dram_gbs'] / 1e3):.2f}x the DRAM bound")


def targets(results: dict, bw: dict, info: dict | None = None) -> list[tuple[str, str, bool]]:
    """Issue 10's host targets: (target, the figures of this run, met?) for those this run measured."""
    def us(key, engine):
        return results.get(key, {}).get(engine, {}).get("us")

    def rss(key, engine):
        return results.get(key, {}).get(engine, {}).get("rss_mb")

    def best_peer(key):
        peers = {e: r["us"] for e, r in results.get(key, {}).items() if not e.startswith("colibri") and "us" in r}
        return min(peers.items(), key=lambda kv: kv[1]) if peers else (None, None)

    out = []
    c1, (p1, p1us) = us("edge b1", BASELINE), best_peer("edge b1")
    if c1 and p1us:
        out.append(("edge f32 b1 >= 1.3x faster than the fastest correct peer",
                    f"{p1} {p1us:,.0f} us / Colibri {c1:,.0f} us = {p1us / c1:.2f}x", p1us / c1 >= 1.3))
    if c1 and bw.get("resident_gbs"):
        bound = bw["edge_b1_bytes_per_token"] / bw["resident_gbs"] / 1e3
        out.append(("edge f32 b1 within 1.15x of the bandwidth bound (model-sized array)",
                    f"{c1:,.0f} / {bound:,.0f} us = {c1 / bound:.2f}x", c1 / bound <= 1.15))
    # Against ONNX Runtime: its fastest correct variant, and its smallest peak RSS, at batch 1.
    ort_variants = ("onnxruntime", "onnxruntime-masked", "onnxruntime-loop")
    q8 = us("edge b1", "colibri-c-q8")
    ort = min((us("edge b1", e) for e in ort_variants if us("edge b1", e)), default=None)
    if q8 and ort:
        out.append(("edge q8 b1 >= 3x faster than ONNX Runtime f32",
                    f"{ort:,.0f} / {q8:,.0f} us = {ort / q8:.2f}x", ort / q8 >= 3))
    q8i8 = us("edge b1", "colibri-c-q8i8")
    if q8i8 and ort:
        out.append(("edge q8 with int8 activations b1 >= 3x faster than ONNX Runtime f32",
                    f"{ort:,.0f} / {q8i8:,.0f} us = {ort / q8i8:.2f}x", ort / q8i8 >= 3))
    f16 = us("edge b1", "colibri-c-f16")
    if f16 and c1:
        out.append(("edge f16 b1 faster than f32", f"f16 {f16:,.0f} us, f32 {c1:,.0f} us", f16 < c1))
    for key in ("edge b8", "edge b64"):
        c, (p, pus) = us(key, BASELINE), best_peer(key)
        if c and pus:
            out.append((f"{key}: throughput >= the best peer's", f"{p} {pus:,.0f} us, Colibri {c:,.0f} us per call",
                        c <= pus))
    m, lite = us("meter b1", BASELINE), us("meter b1", "litert")
    if m:
        out.append(("meter f32 b1 <= 1.0 us", f"{m:.2f} us", m <= 1.0))
    if m and lite:
        out.append(("meter f32 b1 >= 2.5x faster than LiteRT", f"{lite:.1f} / {m:.2f} us = {lite / m:.2f}x",
                    lite / m >= 2.5))
    arena = results.get("meter b1", {}).get(BASELINE, {}).get("arena_bytes")
    tflm = results.get("meter b1", {}).get("tflm", {}).get("arena_bytes")
    if arena and tflm:
        out.append(("meter arena below TFLM's", f"Colibri {arena:,} B, TFLM {tflm:,} B", arena < tflm))
    images = (info or {}).get("smart_meter", {}).get("images")
    if images:
        ratio = images["q8"] / images["f32"]
        out.append(("smart meter q8 image <= 0.30 of its f32 image",
                    f"{images['q8']:,} / {images['f32']:,} B = {ratio:.3f}", ratio <= 0.30))
    cr = rss("edge b1", BASELINE)
    orss = min((rss("edge b1", e) for e in ort_variants if rss("edge b1", e)), default=None)
    if cr and orss:
        out.append(("edge peak RSS <= 40% of ONNX Runtime's", f"{cr:.0f} MB vs {orss:.0f} MB = {cr / orss:.0%}",
                    cr <= 0.4 * orss))
    return out


def device_figures() -> dict[str, float]:
    """Issue 10's size and Cortex-M7 figures, measured as README's are (scripts/measure.py): the meter
    model's instructions on the emulated Cortex-M7 (QEMU -icount: instructions, not cycles) with the
    cmsis and the reference kernels, and the weight-dominated model's q8/f32 image ratio."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import measure

    print("\nCortex-M7 (QEMU mps2-an500 runner, -icount) and image sizes, as scripts/measure.py measures them:")
    figures = {f.key: f for f in measure.group_m7()}
    for f in figures.values():
        print(f"  {f.key:<26} {f.text:>10}  {f.what}")
    out = {k: f.value for k, f in figures.items()}
    out["quant.ratio.q8"] = measure.weight_dominated_ratios()["q8"]
    print(f"  {'quant.ratio.q8':<26} {out['quant.ratio.q8']:>10.3f}  q8 image / f32, d 128, 8 experts x hidden 512, E 0.5%")
    return out


def device_targets(d: dict[str, float]) -> list[tuple[str, str, bool]]:
    out = []
    if "m7.meter.f32.per_mac" in d:
        out.append(("Cortex-M7 meter f32 <= 1.4 instructions per active MAC",
                    f"{d['m7.meter.f32']:,.0f} instructions = {d['m7.meter.f32.per_mac']:.2f} per MAC "
                    f"(reference kernels {d['m7.meter.f32.ref']:,.0f})", d["m7.meter.f32.per_mac"] <= 1.4))
        out.append(("Cortex-M7 meter q8, int8 activations <= 0.6x f32's instructions",
                    f"{d['m7.meter.q8i8']:,.0f} = {d['m7.meter.q8i8.vs_f32']:.2f}x", d["m7.meter.q8i8.vs_f32"] <= 0.6))
        out.append(("Cortex-M7 meter q8, f32 activations <= 1.0x f32's instructions",
                    f"{d['m7.meter.q8']:,.0f} = {d['m7.meter.q8.vs_f32']:.2f}x", d["m7.meter.q8.vs_f32"] <= 1.0))
    if "quant.ratio.q8" in d:
        out.append(("d128/hidden-512 q8 image (E 0.5%) <= 0.262 of f32", f"{d['quant.ratio.q8']:.3f}",
                    d["quant.ratio.q8"] <= 0.262))
    return out


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    engines = [e for e in ENGINES if any(e in results[k] and "us" in results[k][e] for k in keys)]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    width = 0.8 / max(1, len(engines))
    # tab20: a colour per engine (20 of them, more than the engines), in light/dark pairs.
    colors = dict(zip(engines, plt.get_cmap("tab20").colors))
    for j, e in enumerate(engines):
        xs = [i + j * width for i, k in enumerate(keys) if "us" in results[k].get(e, {})]
        ys = [results[k][e]["us"] for k in keys if "us" in results[k].get(e, {})]
        ax.bar(xs, ys, width, label=e, color=colors[e])
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], keys)
    ax.set_ylabel("median µs per forward (log)")
    ax.set_title("Colibri and peers, one thread each (make bench)")
    ax.legend(ncol=6, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
