"""Mapped model files on Linux (issue 11): what mapping instead of copying buys, printed, not asserted.

    .venv/bin/python bench/edge_mmap.py [--layers 2 --experts 64 --d 512 --hidden 1024] [--tokens 32] [--skew 0] [--keep]
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
  and with the default verify="on_use" (each expert's CRCs on its first use);
- against ONNX Runtime on the same model (when onnx and onnxruntime are installed: the bench extra,
  COLIBRI_BENCH=1 ./scripts/setup.sh): the weights put in a PyTorch module as bench/models.py's
  GatherMoE (the export-friendly variant bench/bench.py times: top-k routing kept, each token reads
  only its experts' rows; experts stored f16 as in Colibri's image, widened after the gather),
  exported by bench/bench.py's export_onnx and re-saved in ONNX's external-data format (one .data
  file beside the .onnx, required past 2 GB, and what lets ORT map the weights rather than read them
  into the protobuf). Each engine then runs the same N tokens in its own process from a cold page
  cache: the process's peak RSS (VmHWM) and its resident anonymous and file-backed bytes at the end
  (the shared libraries included; the weights file's share apart), with the outputs compared so
  that both run the same function.

Times are wall clock on this machine (shared cores, a virtual disk); they vary run to run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri import image
from colibri.model.format import Act, ExpertKind, Routing
from colibri.model.ir import Expert, F16Weight, Graph, Linear, MoE


def build(layers: int, experts: int, d: int, hidden: int, seed: int = 0, skew: float = 0.0) -> Graph:
    """`skew` > 0 gives the router a bias of -skew * log(1 + expert): expert e is then picked about
    (1 + e) ** -skew as often as expert 0 (a Zipf-like popularity, as trained routers show), so the most
    used experts carry most of the calls; 0 leaves the random router's near-uniform choice."""
    rng = np.random.default_rng(seed)

    def f16(rows: int, cols: int, scale: float) -> F16Weight:
        return F16Weight((rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16))

    body: list = [Linear(rng.standard_normal((d, 16), dtype=np.float32) * 0.25, np.zeros(d, np.float32))]
    for _ in range(layers):
        body.append(MoE(
            routing=Routing.TOPK_SOFTMAX, top_k=2,
            router_weight=rng.standard_normal((experts, d), dtype=np.float32) * 0.05,
            expert_map=np.arange(experts, dtype=np.int32),
            router_bias=(-skew * np.log1p(np.arange(experts))).astype(np.float32) if skew else None,
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


def status_bytes(field: str) -> int:
    """A /proc/self/status figure (VmRSS, RssAnon, RssFile) in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def ort_export(graph: Graph, onnx_path: Path, x: np.ndarray) -> None:
    """The same weights as a PyTorch module with bench/models.py's GatherMoE, exported by bench/bench.py's
    export_onnx, re-saved with every initializer in one external-data file beside onnx_path."""
    import onnx
    import torch
    from torch import nn

    import models as M
    from bench import export_onnx
    from colibri import nn as cnn

    body: list = []
    for layer in graph.layers:
        if isinstance(layer, Linear):
            lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            lin.weight.data = torch.from_numpy(np.asarray(layer.weight, np.float32))
            if layer.bias is not None:
                lin.bias.data = torch.from_numpy(np.asarray(layer.bias, np.float32))
            body.append(lin)
            continue
        n, d = layer.router_weight.shape
        # On the meta device: no f32 copy of every expert is allocated only to be replaced by the f16 weights.
        with torch.device("meta"):
            moe = cnn.MoE(d, n, layer.experts[0].hidden, top_k=layer.top_k, routing="topk_softmax",
                          activation="silu", gated=True, expert_bias=False)
        moe.router = nn.Linear(d, n, bias=layer.router_bias is not None)
        moe.router.weight.data = torch.from_numpy(layer.router_weight)
        if layer.router_bias is not None:
            moe.router.bias.data = torch.from_numpy(layer.router_bias)
        for mine, theirs in zip(moe.experts, layer.experts):
            for name in ("w1", "w2", "w3"):
                getattr(mine, name).weight = nn.Parameter(torch.from_numpy(getattr(theirs, name).data), requires_grad=False)
        body.append(M.GatherMoE(moe))
        del moe
    module = nn.Sequential(*body).eval()
    inline = onnx_path.with_suffix(".inline.onnx")
    export_onnx(module, torch.from_numpy(x[:1]), inline)
    del module, body
    proto = onnx.load(str(inline))
    inline.unlink()
    onnx.save_model(proto, str(onnx_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=onnx_path.name + ".data", size_threshold=0)


def measure_child(engine: str, model: Path, tokens: int) -> None:
    """One engine, its own process, cold page cache: N tokens one at a time, memory figures as JSON."""
    x = np.random.default_rng(1).standard_normal((tokens, 16)).astype(np.float32)
    if engine == "colibri":
        drop_cache(model)
        m = colibri.Model(model)
        ys = [m.forward(row[None, :]) for row in x]
    else:
        import onnxruntime as ort

        drop_cache(model)
        drop_cache(Path(str(model) + ".data"))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        ys = [sess.run(None, {"x": row[None, :]})[0] for row in x]
    weights = model if engine == "colibri" else Path(str(model) + ".data")
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork and exec, so it would report the parent's.
    print(json.dumps({"peak": status_bytes("VmHWM"), "anon": status_bytes("RssAnon"), "file": status_bytes("RssFile"),
                      "weights": mapped_rss(weights), "y": np.concatenate(ys).tolist()}))


def measured(engine: str, model: Path, tokens: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--measure-child", engine, "--model", str(model), "--tokens", str(tokens)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the {engine} run failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def ort_comparison(graph: Graph, path: Path, size: int, tokens: int) -> None:
    missing = [m for m in ("onnx", "onnxruntime", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ONNX Runtime peak RSS: NOT MEASURED: {', '.join(missing)} not installed in this venv "
              f"(COLIBRI_BENCH=1 ./scripts/setup.sh installs them)")
        return
    onnx_path = path.with_suffix(".onnx")
    data = Path(str(onnx_path) + ".data")
    try:
        t0 = time.perf_counter()
        ort_export(graph, onnx_path, np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32))
        print(f"ONNX export (GatherMoE, f16 experts, external data): {mib(onnx_path.stat().st_size)} graph + "
              f"{mib(data.stat().st_size)} {data.name} (in {time.perf_counter() - t0:.1f} s)")
        ours, theirs = measured("colibri", path, tokens), measured("onnxruntime", onnx_path, tokens)
        a, b = np.array(ours.pop("y")), np.array(theirs.pop("y"))
        err = float(np.abs(a - b).max() / max(1e-30, np.abs(a).max()))
        if err > 1e-3:
            raise SystemExit(f"ONNX Runtime's outputs differ from Colibri's by {err:.2e} (relative): not the same model")
        for name, r in (("Colibri (mapped, verify on use)", ours), ("ONNX Runtime (external data)", theirs)):
            print(f"{tokens} tokens, {name}: peak RSS {mib(r['peak'])} ({r['peak'] / size:.1%} of the model's "
                  f"{mib(size)}); at the end {mib(r['anon'])} anonymous + {mib(r['file'])} file-backed resident, "
                  f"of which {mib(r['weights'])} mapped from the weights file")
        print(f"ONNX Runtime peak RSS / Colibri peak RSS: {theirs['peak'] / ours['peak']:.1f}x "
              f"(outputs agree to {err:.1e} relative)")
    finally:
        onnx_path.unlink(missing_ok=True)
        data.unlink(missing_ok=True)


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--skew", type=float, default=0.0,
                    help="router bias -skew*log(1+expert): a Zipf-like expert popularity (0: the random router's)")
    ap.add_argument("--dir", type=Path, default=None, help="where the model file goes (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the model file")
    ap.add_argument("--no-onnx", action="store_true", help="skip the ONNX Runtime comparison")
    ap.add_argument("--measure-child", choices=["colibri", "onnxruntime"], help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_child:
        measure_child(args.measure_child, args.model, args.tokens)
        return

    folder = Path(tempfile.mkdtemp(prefix="colibri-edge-", dir=args.dir))
    path = folder / "edge.clb"
    t0 = time.perf_counter()
    graph = build(args.layers, args.experts, args.d, args.hidden, skew=args.skew)
    data = image.write(graph, page_aligned=True)
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
        if args.no_onnx:
            print("ONNX Runtime peak RSS: NOT MEASURED: --no-onnx")
        else:
            ort_comparison(graph, path, size, args.tokens)
    finally:
        if args.keep:
            print(f"kept {path}")
        else:
            path.unlink(missing_ok=True)
            folder.rmdir()


if __name__ == "__main__":
    main()
