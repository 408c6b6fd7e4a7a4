"""A 7 B-parameter MoE language model decoding from a mapped file in less memory than the model, beside
llama.cpp (`make bench-lm-scale`, issue 27).

    .venv/bin/python bench/lm_scale.py                    (the 7 B model; hours, ~40 GB of disk)
    .venv/bin/python bench/lm_scale.py --size medium      (2.4 B parameters, the 7 B's layers, 8 of them)
    .venv/bin/python bench/lm_scale.py --size tiny        (the same steps on a 1 M-parameter model)
    .venv/bin/python bench/lm_scale.py --engines colibri  (no llama.cpp)

The model: Mixtral's architecture, 8 experts top-2 (7b: hidden 2048, 24 layers, experts of 5632, 16
query / 4 KV heads, vocab 32000: 7.0 B parameters). Seeded random weights, N(0, 0.02) for every matrix
(norms 1), each tensor from its own seed, written straight to bf16 safetensors shards a shard at a time
with an index and a config.json: the model is never whole in memory.

Steps, each skipped when its stamp (build/bench-lm-scale/<size>/stamps/) says it is done, so a rerun
reuses what is there; the disk they still need is printed first, and the bench refuses to start when
the disk has less:

1. the Hugging Face folder (bf16 shards);
2. Colibri: `colibri export DIR x.clb --dtype q4|q8` (the streamed folder export; its wall time and
   peak RSS from /usr/bin/time are printed), on x86-64 with `--int8-blocks 'layers.*'` (int8
   activation blocks: the integer dot-product decode kernels; the printed file line says which);
3. llama.cpp: convert_hf_to_gguf.py to a bf16 GGUF (the vocabulary a sentencepiece model trained on
   the machine's licence texts, as `make bench-lm` does; the token ids both engines see are random),
   llama-quantize to Q4_0 and Q8_0 at its defaults, the bf16 GGUF deleted. The Colibri q8 export waits
   until that bf16 file is gone, which keeps the peak of disk down.

Then the runs, from a cold page cache each (drop_caches when writable, and posix_fadvise DONTNEED on
the model file; which one is printed), engines alternating: each engine's C driver (bench/lm_driver.c
`decode`: the mapped file, verify on use, on_route advice; bench/llama_decode.c: llama.cpp's defaults)
runs a 16-token prompt and 64 greedy decode steps inside a memory cgroup (v2 memory.max, else v1
memory.limit_in_bytes) at each limit (7b: 4 GiB, 3 GiB, none) and 1 and 2 threads, and, under the
second limit, Colibri with the hottest experts over the prompt mlock'd, then with every tensor that
is no expert's mlock'd (lock=dense). Each run prints open to first
token, tok/s with p50 / p99 per step, major faults per step, RssAnon (peak RSS without the mapped file's
pages) and VmHWM, the group's peak and page cache, and whether it finished or was OOM-killed. Under a
limit each engine's tokens must equal its unlimited run's (printed). Then the issue's targets, each met
or not. Results: build/bench-lm-scale/<size>/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "host_tools"))
import lm_vs_llama_cpp as peer  # noqa: E402
from edge_jitter import PressureGroup, cgroup_for_pressure  # noqa: E402
from hf_export import mixtral_tensors  # noqa: E402

CORE = ROOT / "firmware" / "colibri_core"
GiB, MiB = 2**30, 2**20


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int = 8
    top_k: int = 2
    shard_bytes: int = 2 * 10**9
    limits_mib: tuple = (4096, 3072, None)  # the board class, below the q4 file, none
    lock_mib: int = 1024  # the hottest experts pinned under the second limit, up to this much

    @property
    def params(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in mixtral_tensors(self.namespace()))

    def namespace(self) -> argparse.Namespace:
        return argparse.Namespace(hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, vocab=self.vocab,
                                  layers=self.layers, experts=self.experts, intermediate=self.intermediate)


SIZES = {
    "7b": Size(hidden=2048, layers=24, intermediate=5632, heads=16, kv_heads=4, vocab=32000),
    # The 7 B's layer shapes (so its experts, 19.5 MB each at q4, page in the same way) in 8 layers: 2.43 B
    # parameters, a 1.4 GB q4 file; the limits at the 7 B's ratios to the model (x 0.35), still below the q4
    # file. For iterating on the paging in minutes rather than hours.
    "medium": Size(hidden=2048, layers=8, intermediate=5632, heads=16, kv_heads=4, vocab=32000,
                   limits_mib=(1408, 1056, None), lock_mib=352),
    # CI-sized: the same steps in seconds; its limits only exercise the cgroup path (the model fits).
    "tiny": Size(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=512, shard_bytes=400_000,
                 limits_mib=(256, 128, None), lock_mib=1),
}
PROMPT, DECODE = 16, 64
MAX_SEQ_LEN = 128
COLIBRI_DTYPES = {"q4": "Q4_0", "q8": "Q8_0"}
# Bytes per parameter of each file, for the disk plan: bf16; Q8_0 and Colibri q8 (int8 and a scale per
# row block), Q4_0 and Colibri q4 (4 bits and an f16 scale per 32); 3% over for tables, norms, the head.
BYTES_PER_PARAM = {"hf": 2.0, "gguf-bf16": 2.0, "Q8_0": 34 / 32 * 1.03, "Q4_0": 18 / 32 * 1.03,
                   "Q4_0-pure": 18 / 32 * 1.03,
                   "q8": 34 / 32 * 1.03, "q4": 18 / 32 * 1.03}
DISK_MARGIN = GiB
# On x86-64 Colibri's q4 and q8 files are exported with int8 activation blocks on every layer
# (docs/quantization.md): the integer dot-product kernels decode them 2-4x faster than f32 activations
# with int4 / int8 weights. The other backends have no block kernels, so elsewhere the files keep f32
# activations.
INT8_BLOCKS = ["--int8-blocks", "layers.*"] if platform.machine().lower() in ("x86_64", "amd64") else []


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


# ---- the model ------------------------------------------------------------------------------------

def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns (uint16), rounded to nearest even."""
    u = x.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def tensor_values(name: str, shape: tuple, seed: int) -> np.ndarray:
    """One tensor's f32 values: N(0, 0.02) for matrices, 1 for norms; its own seed, so any shard can be
    made alone and the folder does not depend on how it is sharded."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def write_folder(folder: Path, size: Size, seed: int) -> int:
    """The Hugging Face folder, one bf16 shard in memory at a time; its bytes."""
    import torch
    from safetensors.torch import save_file

    plan = list(mixtral_tensors(size.namespace()))
    shards: list[list] = [[]]
    used = 0
    for name, shape in plan:
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and used + nbytes > size.shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            bits = to_bf16_bits(tensor_values(name, shape, seed))
            tensors[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            weight_map[name] = file
            total += bits.nbytes
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": size.hidden, "intermediate_size": size.intermediate, "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads,
        "num_local_experts": size.experts, "num_experts_per_tok": size.top_k, "vocab_size": size.vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    }, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return total


# ---- the steps ------------------------------------------------------------------------------------

@dataclass
class Step:
    name: str
    makes: list[str]  # the files it leaves (names in Plan.files)
    frees: list[str] = field(default_factory=list)  # the files it deletes when done
    needs: list[str] = field(default_factory=list)


class Plan:
    """The files of one size, the steps that make them, and the disk those still to run need."""

    def __init__(self, size_name: str, out: Path, engines: set[str], q4_from: str = "hf"):
        self.size = SIZES[size_name]
        self.out = out
        self.stamps = out / "stamps"
        self.files = {"hf": out / "hf", "gguf-bf16": out / "gguf" / "model-bf16.gguf",
                      "q4": out / "colibri" / "model-q4.clb", "q8": out / "colibri" / "model-q8.clb",
                      "Q4_0": out / "gguf" / "model-Q4_0.gguf", "Q8_0": out / "gguf" / "model-Q8_0.gguf",
                      "Q4_0-pure": out / "gguf" / "model-Q4_0-pure.gguf"}
        steps = [Step("generate", ["hf"])]
        if "colibri" in engines and q4_from == "hf":
            steps.append(Step("colibri q4", ["q4"], needs=["hf"]))
        if "llama.cpp" in engines or q4_from == "gguf":
            steps += [Step("gguf bf16", ["gguf-bf16"], needs=["hf"]),
                      Step("llama-quantize Q4_0", ["Q4_0"], needs=["gguf-bf16"])]
            if "colibri" in engines and q4_from == "gguf":
                steps.append(Step("llama-quantize Q4_0 pure", ["Q4_0-pure"], needs=["gguf-bf16"]))
            steps.append(Step("llama-quantize Q8_0", ["Q8_0"], needs=["gguf-bf16"], frees=["gguf-bf16"]))
            if "colibri" in engines and q4_from == "gguf":
                steps.append(Step("colibri q4 from Q4_0", ["q4"], needs=["Q4_0-pure"], frees=["Q4_0-pure"]))
        if "colibri" in engines:
            steps.append(Step("colibri q8", ["q8"], needs=["hf"]))
        self.steps = steps

    def stamped(self, step: Step) -> bool:
        return (self.stamps / step.name.replace(" ", "_")).exists()

    def done(self, step: Step) -> bool:
        """Stamped, and its files are there or were freed by a step that is done."""
        freed = {k for s in self.steps if s is not step and self.stamped(s) for k in s.frees}
        return self.stamped(step) and all(self.files[k].exists() or k in freed for k in step.makes)

    def invalidate(self) -> None:
        """Unstamps the steps whose files a pending step needs but the disk no longer has (the folder and the
        bf16 GGUF are deleted once used), until every pending step's inputs will be made."""
        changed = True
        while changed:
            changed = False
            for s in self.steps:
                if self.done(s):
                    continue
                for k in s.needs:
                    maker = next(m for m in self.steps if k in m.makes)
                    if self.stamped(maker) and not self.files[k].exists():
                        (self.stamps / maker.name.replace(" ", "_")).unlink()
                        changed = True

    def mark(self, step: Step, seconds: float, **info) -> None:
        self.stamps.mkdir(parents=True, exist_ok=True)
        (self.stamps / step.name.replace(" ", "_")).write_text(json.dumps({"seconds": seconds, **info}))

    def record(self, step: Step) -> dict:
        return json.loads((self.stamps / step.name.replace(" ", "_")).read_text())

    def estimate(self, key: str) -> int:
        return int(self.size.params * BYTES_PER_PARAM[key])

    def disk_needed(self) -> tuple[int, list[str]]:
        """The most the steps still to run add to the disk at once, and the lines of that plan. The
        Colibri exports and the llama.cpp conversions run side by side after the folder is written;
        Colibri's q8 export starts once the bf16 GGUF is deleted."""
        pending = [s for s in self.steps if not self.done(s)]
        lines, first, second = [], 0, 0
        for s in pending:
            grow = sum(self.estimate(k) for k in s.makes)
            freed = sum(self.estimate(k) for k in s.frees)
            late = s.name == "colibri q8" and any(t.frees for t in pending)
            if late:
                second += grow
            else:
                first += grow
            second -= freed
            lines.append(f"  {s.name:22} +{grow / 1e9:6.1f} GB" + (f", then -{freed / 1e9:.1f} GB" if freed else "")
                         + (" (after that deletion)" if late else ""))
        return max(first, first + second), lines

    def lanes(self) -> list[list[Step]]:
        """The folder first; then Colibri's exports beside llama.cpp's conversions."""
        head = [s for s in self.steps if s.name == "generate"]
        colibri = [s for s in self.steps if s.name.startswith("colibri") and "hf" in s.needs]
        llama = [s for s in self.steps if s not in head and s not in colibri]
        return [head, colibri, llama]


def timed_process(cmd: list[str], log: Path, cwd: Path = ROOT) -> tuple[float, int]:
    """Wall seconds and peak RSS (GNU time, the whole process) of a step's command; its output to log."""
    rss_file = log.with_suffix(".rss")
    t0 = time.perf_counter()
    with log.open("w") as out:
        r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd], stdout=out, stderr=out,
                           cwd=cwd)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({r.returncode}); the last of {shown(log)}:\n"
                         + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return seconds, int(rss_file.read_text().split()[-1]) * 1024


def gguf_workdir(plan: Plan) -> Path:
    """The folder the converter reads: the shards and config linked, and a sentencepiece vocabulary."""
    work = plan.out / "gguf" / "hf-with-vocab"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for f in plan.files["hf"].iterdir():
        if f.suffix in (".json", ".safetensors"):
            os.symlink(f.resolve(), work / f.name)
    shutil.copy(peer.vocabulary(work, plan.size.vocab), work / "tokenizer.model")
    return work


def run_step(plan: Plan, step: Step, seed: int) -> dict:
    logs = plan.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / (step.name.replace(" ", "_") + ".log")
    files = plan.files
    for k in step.makes:
        files[k].parent.mkdir(parents=True, exist_ok=True)
    info: dict = {}
    t0 = time.perf_counter()
    if step.name == "generate":
        info["bytes"] = write_folder(files["hf"], plan.size, seed)
        seconds, rss = time.perf_counter() - t0, None
    elif step.name == "colibri q4 from Q4_0":
        # The streamed GGUF import: llama-quantize's Q4_0 blocks carried into q4 as they are, so Colibri's
        # int4 weights are llama.cpp's, bit for bit (--pure: every matrix Q4_0, the import reads no Q6_K).
        colibri_cli = Path(sys.executable).parent / "colibri"
        seconds, rss = timed_process([str(colibri_cli), "export", str(files["Q4_0-pure"]), str(files["q4"]),
                                      "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(PROMPT),
                                      *INT8_BLOCKS], log)
        info["bytes"] = files["q4"].stat().st_size
        info["cli_says"] = next((line for line in log.read_text().splitlines() if line.startswith("wrote ")), "")
    elif step.name.startswith("colibri"):
        dtype = step.makes[0]
        colibri_cli = Path(sys.executable).parent / "colibri"
        seconds, rss = timed_process([str(colibri_cli), "export", str(files["hf"]), str(files[dtype]),
                                      "--dtype", dtype, "--max-seq-len", str(MAX_SEQ_LEN),
                                      "--max-batch", str(PROMPT), *INT8_BLOCKS], log)
        info["bytes"] = files[dtype].stat().st_size
        info["cli_says"] = next((line for line in log.read_text().splitlines() if line.startswith("wrote ")), "")
    elif step.name == "gguf bf16":
        work = gguf_workdir(plan)
        tmp = files["gguf-bf16"].with_suffix(".tmp")
        seconds, rss = timed_process([sys.executable, "-c", peer._CONVERT, str(peer.LLAMA_SRC), str(work),
                                      "--outfile", str(tmp), "--outtype", "bf16"], log)
        tmp.rename(files["gguf-bf16"])
        shutil.rmtree(work)
        info["bytes"] = files["gguf-bf16"].stat().st_size
    else:  # llama-quantize
        key = step.makes[0]
        ftype, pure = key.split("-")[0], ["--pure"] if key.endswith("-pure") else []
        tmp = files[key].with_suffix(".tmp")
        seconds, rss = timed_process([str(peer.LLAMA_BIN / "llama-quantize"), *pure, str(files["gguf-bf16"]),
                                      str(tmp), ftype, "2"], log)
        ftype = key
        tmp.rename(files[ftype])
        info["bytes"] = files[ftype].stat().st_size
    for k in step.frees:
        path = files[k]
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    info["peak_rss_bytes"] = rss
    plan.mark(step, seconds, **info)
    return {"seconds": seconds, **info}


# ---- the runs -------------------------------------------------------------------------------------

def drop_caches(paths: list[Path]) -> str:
    """A cold page cache for these files: the kernel's whole cache dropped when /proc/sys/vm/drop_caches is
    writable (root), and always posix_fadvise DONTNEED on each file. Which one happened."""
    os.sync()
    how = "posix_fadvise(DONTNEED) on the model file"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        how = "drop_caches (the whole page cache) and " + how
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def group_stat(group: PressureGroup) -> dict:
    stat = dict(line.split() for line in (group.path / "memory.stat").read_text().splitlines())
    if group.version == 1:
        return {"peak_bytes": int((group.path / "memory.max_usage_in_bytes").read_text()),
                "cache_bytes": int(stat.get("total_cache", stat.get("cache", 0))),
                "limit_hits": int((group.path / "memory.failcnt").read_text())}
    events = dict(line.split() for line in (group.path / "memory.events").read_text().splitlines())
    peak = group.path / "memory.peak"
    return {"peak_bytes": int(peak.read_text()) if peak.exists() else None, "cache_bytes": int(stat.get("file", 0)),
            "limit_hits": int(events.get("max", 0))}


def set_limit(group: PressureGroup, limit: int | None) -> None:
    """The group's limit in bytes, or none (v2 "max", v1 -1)."""
    (group.path / group.limit_file).write_text(str(limit) if limit is not None else
                                               "max" if group.version == 2 else "-1")


@dataclass
class Run:
    engine: str
    dtype: str
    threads: int
    limit_mib: int | None
    lock: str = "none"
    finished: bool = False
    oom_killed: bool = False
    error: str = ""
    result: dict = field(default_factory=dict)
    group: dict = field(default_factory=dict)
    cache_drop: str = ""

    @property
    def label(self) -> str:
        limit = f"{self.limit_mib / 1024:g} GiB" if self.limit_mib else "no limit"
        lock = {"none": "", "dense": ", dense tensors mlock'd"}.get(self.lock, ", hot experts mlock'd")
        return f"{self.engine:9} {self.dtype:4} {self.threads}t {limit:9}{lock}"


def prompt_ids(vocab: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng([seed, 16]).integers(0, vocab, PROMPT)]


def pin(threads: int) -> str:
    return ",".join(str(c) for c in range(min(threads, os.cpu_count() or 1)))


def execute(run: Run, path: Path, ids: list[int], group: PressureGroup | None, drivers: dict,
            timeout: float | None = None) -> Run:
    ids_text = ",".join(map(str, ids))
    if run.engine == "colibri":
        cmd = [str(drivers["colibri"]), "decode", str(path), str(run.threads), ids_text, str(DECODE), run.lock]
    else:
        cmd = [str(drivers["llama.cpp"]), str(path), str(run.threads), ids_text, str(DECODE)]
    cmd = ["taskset", "-c", pin(run.threads), *cmd]
    run.cache_drop = drop_caches([path])
    if group is not None:
        set_limit(group, run.limit_mib * MiB if run.limit_mib else None)
        group.reset_counters()
        # Joined before exec: everything the driver maps or allocates is charged to the group.
        cmd = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group.path), *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {timeout:.0f} s (killed)"
        if group is not None:
            run.group = group_stat(group)
        return run
    if group is not None:
        run.group = group_stat(group)
    if r.returncode in (-9, 137):
        run.oom_killed = True
    elif r.returncode != 0:
        run.error = f"exit {r.returncode}: {r.stderr.strip()[-500:]}"
    else:
        run.result = json.loads(r.stdout.splitlines()[-1])
        run.finished = True
    return run


def per_token(run: Run) -> dict:
    t = np.array(run.result["times"])
    f = np.array(run.result["faults"])
    read = np.array(run.result.get("read_bytes", [-1]))
    return {"tps": len(t) / t.sum(), "p50_ms": 1e3 * float(np.percentile(t, 50)),
            "p99_ms": 1e3 * float(np.percentile(t, 99)), "faults": float(f.mean()),
            "read_mib": float(read.mean()) / MiB if (read >= 0).all() else None}


def report(run: Run) -> str:
    g = run.group
    where = (f"; group peak {g['peak_bytes'] / MiB:.0f} MiB, its page cache {g['cache_bytes'] / MiB:.0f} MiB, "
             f"limit hit {g['limit_hits']}x" if g else "")
    if run.oom_killed:
        return f"  {run.label}: OOM-killed{where}"
    if not run.finished:
        return f"  {run.label}: FAILED ({run.error}){where}"
    s, r = per_token(run), run.result
    opened = (f", {r['open_read_bytes'] / MiB:.0f} MiB read by it" if r.get("open_read_bytes", -1) >= 0 else "")
    read = f", {s['read_mib']:.1f} MiB read/token" if s["read_mib"] is not None else ""
    return (f"  {run.label}: first token {r['first_token_s']:.2f} s (open {r['open_s'] * 1e3:.0f} ms{opened}, "
            f"{r['first_resident_bytes'] / MiB:.0f} MiB of the file resident then), "
            f"{s['tps']:.2f} tok/s, p50 {s['p50_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms, "
            f"{s['faults']:.0f} major faults/token{read}; RssAnon {r['rss_anon_kib'] / 1024:.0f} MiB, "
            f"VmHWM {r['vm_hwm_kib'] / 1024:.0f} MiB{where}")


def hottest(driver: Path, path: Path, ids: list[int], budget: int) -> tuple[str, int, float]:
    """The experts routing used most over the prompt, as many as fit in `budget` bytes: the LOCK argument,
    their bytes and their share of the prompt's expert calls."""
    r = subprocess.run([str(driver), "hot", str(path), ",".join(map(str, ids))], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"lm_driver hot failed: {r.stderr.strip()}")
    rows = sorted(json.loads(r.stdout), key=lambda row: -row[2])
    chosen, used = [], 0
    for layer, expert, tokens, nbytes in rows:
        if tokens == 0 or used + nbytes > budget:
            break
        chosen.append((layer, expert, tokens))
        used += nbytes
    share = sum(c[2] for c in chosen) / max(1, sum(row[2] for row in rows))
    return ",".join(f"{layer}:{expert}" for layer, expert, _ in chosen) or "none", used, share


def llama_decode_driver(out: Path) -> Path:
    src = ROOT / "bench" / "llama_decode.c"
    exe = out / "llama_decode"
    lib = peer.LLAMA_BIN / "libllama.so"
    if not exe.exists() or exe.stat().st_mtime < max(src.stat().st_mtime, lib.stat().st_mtime):
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-D_POSIX_C_SOURCE=200809L",
                        f"-I{peer.LLAMA_SRC / 'include'}", f"-I{peer.LLAMA_SRC / 'ggml' / 'include'}", str(src),
                        f"-L{peer.LLAMA_BIN}", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,-rpath,{peer.LLAMA_BIN.resolve()}", "-o", str(exe)], check=True)
    return exe


def colibri_decode_driver(out: Path) -> Path:
    return peer.colibri_driver()  # bench/lm_driver.c, in peer.OUT


# ---- targets --------------------------------------------------------------------------------------

def find(runs: list[Run], **match) -> Run | None:
    return next((r for r in runs if all(getattr(r, k) == v for k, v in match.items())), None)


def targets(runs: list[Run], size: Size) -> list[tuple[str, str, bool | None]]:
    """(target, what was measured, met: True / False / None when not measured)."""
    out = []
    first, second = size.limits_mib[0], size.limits_mib[1]
    cold = [r for r in runs if r.engine == "colibri" and r.dtype == "q4" and r.finished and r.limit_mib is None]
    if cold:
        t = min(r.result["first_token_s"] for r in cold)
        out.append(("open to first token, q4, cold cache <= 2 s", f"{t:.2f} s", t <= 2.0))
    else:
        out.append(("open to first token, q4, cold cache <= 2 s", "not measured", None))

    def ratio(limit, dtype, threads) -> tuple[str, bool | None]:
        c = find(runs, engine="colibri", dtype=dtype, threads=threads, limit_mib=limit, lock="none")
        ll = find(runs, engine="llama.cpp", dtype=COLIBRI_DTYPES[dtype], threads=threads, limit_mib=limit)
        if c is None or ll is None or not c.finished:
            return ("not measured" if c is None or ll is None else "Colibri did not finish"), (None if c is None or
                                                                                               ll is None else False)
        if not ll.finished:
            return f"{per_token(c)['tps']:.2f} tok/s vs llama.cpp {'OOM-killed' if ll.oom_killed else 'failed'}", True
        x = per_token(c)["tps"] / per_token(ll)["tps"]
        return f"{x:.2f}x ({per_token(c)['tps']:.2f} vs {per_token(ll)['tps']:.2f} tok/s)", x >= 1.2

    for threads in (1, 2):
        text, ok = ratio(first, "q4", threads)
        out.append((f"{first / 1024:g} GiB group, q4 >= 1.2x llama.cpp Q4_0, {threads} thread(s)", text, ok))
    for threads in (1, 2):
        c = find(runs, engine="colibri", dtype="q4", threads=threads, limit_mib=second, lock="none")
        ll = find(runs, engine="llama.cpp", dtype="Q4_0", threads=threads, limit_mib=second)
        if c is None:
            out.append((f"{second / 1024:g} GiB group: Colibri q4 finishes, {threads} thread(s)", "not measured", None))
            continue
        text = (f"{per_token(c)['tps']:.2f} tok/s, {per_token(c)['faults']:.0f} faults/token" if c.finished
                else "OOM-killed" if c.oom_killed else c.error)
        if ll is not None:
            text += "; llama.cpp " + (f"{per_token(ll)['tps']:.2f} tok/s, {per_token(ll)['faults']:.0f} faults/token"
                                      if ll.finished else "OOM-killed" if ll.oom_killed else "failed")
        out.append((f"{second / 1024:g} GiB group: Colibri q4 finishes, {threads} thread(s)", text, c.finished))
    for dtype in ("q4", "q8"):
        for threads in (1, 2):
            text, ok = ratio(None, dtype, threads)
            out.append((f"no limit, {dtype} >= 1.2x llama.cpp {COLIBRI_DTYPES[dtype]}, {threads} thread(s)", text, ok))
    for dtype in ("q4", "q8"):
        c = [r for r in runs if r.engine == "colibri" and r.dtype == dtype and r.finished and r.lock == "none"]
        ll = [r for r in runs if r.engine == "llama.cpp" and r.dtype == COLIBRI_DTYPES[dtype] and r.finished]
        if not c or not ll:
            out.append((f"peak RSS without page cache, {dtype}: Colibri <= llama.cpp", "not measured", None))
            continue
        a = max(r.result["rss_anon_kib"] for r in c) * 1024
        b = max(r.result["rss_anon_kib"] for r in ll) * 1024
        out.append((f"peak RSS without page cache, {dtype}: Colibri <= llama.cpp",
                    f"{a / MiB:.0f} MiB vs {b / MiB:.0f} MiB (RssAnon)", a <= b))
    same = [check_tokens(runs, r) for r in runs if r.limit_mib is not None and r.finished]
    same = [s for s in same if s is not None]
    out.append(("tokens under a limit equal the unlimited run's", f"{sum(same)} of {len(same)} runs",
                all(same) if same else None))
    return [(t, m, None if ok is None else bool(ok)) for t, m, ok in out]  # numpy's bools are not JSON


def check_tokens(runs: list[Run], run: Run) -> bool | None:
    free = find(runs, engine=run.engine, dtype=run.dtype, threads=run.threads, limit_mib=None, lock="none")
    if free is None or not free.finished:
        return None
    return free.result["tokens"] == run.result["tokens"]


# ---- main -----------------------------------------------------------------------------------------

def cpu_line() -> str:
    return f"CPU: {peer.cpu_name()}, {os.cpu_count()} cores (shared machine: timings are noisy)"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--engines", default="colibri,llama.cpp", help="colibri, llama.cpp or both")
    ap.add_argument("--dtypes", default="q4,q8", help="Colibri dtypes (llama.cpp: Q4_0 beside q4, Q8_0 beside q8)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="default build/bench-lm-scale/<size>")
    ap.add_argument("--cgroup", type=Path, default=None, help="a delegated memory cgroup (else one is made)")
    ap.add_argument("--steps-only", action="store_true", help="make the files, run nothing")
    ap.add_argument("--q4-from", choices=("hf", "gguf"), default="hf",
                    help="Colibri's q4 file: exported from the folder (quantised by Colibri, with its clip search), "
                         "or imported from llama-quantize --pure Q4_0 (llama.cpp's int4 weights, bit for bit)")
    ap.add_argument("--limits", default=None,
                    help="the cgroup limits in MiB, comma-separated, 'none' for no limit (default: the size's, "
                         "7b: 4096,3072,none)")
    ap.add_argument("--run-timeout", type=float, default=420,
                    help="seconds a run may take before it is killed and reported as timed out")
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    engines = {e for e in args.engines.split(",") if e}
    if not engines <= {"colibri", "llama.cpp"}:
        raise SystemExit(f"--engines: colibri and/or llama.cpp, got {args.engines!r}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(dtypes) <= set(COLIBRI_DTYPES):
        raise SystemExit(f"--dtypes: q4 and/or q8, got {args.dtypes!r}")
    threads = [int(t) for t in args.threads.split(",")]
    run_limits = (size.limits_mib if args.limits is None else
                  tuple(None if x == "none" else int(x) for x in args.limits.split(",") if x))
    if ("llama.cpp" in engines or args.q4_from == "gguf") and not peer.llama_built():
        raise SystemExit(peer.SETUP_HINT)
    out = args.out or ROOT / "build" / "bench-lm-scale" / args.size
    out.mkdir(parents=True, exist_ok=True)
    peer.OUT = out  # where lm_vs_llama_cpp keeps the Colibri driver and the trained vocabulary
    plan = Plan(args.size, out, engines, args.q4_from)
    plan.steps = [s for s in plan.steps if not s.name.startswith("colibri") or s.makes[0] in dtypes]
    wanted = {COLIBRI_DTYPES[d] for d in dtypes} | ({"Q4_0-pure"} if "q4" in dtypes else set())
    plan.steps = [s for s in plan.steps if not s.name.startswith("llama-quantize") or s.makes[0] in wanted]
    quantize = [s for s in plan.steps if s.name.startswith("llama-quantize")]
    for s in quantize:
        s.frees = []
    if quantize:
        quantize[-1].frees = ["gguf-bf16"]

    print(cpu_line(), flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model: Mixtral, hidden {size.hidden}, {size.layers} "
          f"layers, {size.experts} experts x {size.intermediate} top-{size.top_k}, {size.heads}/{size.kv_heads} heads, "
          f"vocab {size.vocab}: {size.params / 1e9:.2f} B parameters", flush=True)
    plan.invalidate()
    peak, lines = plan.disk_needed()
    free = shutil.disk_usage(out).free
    print(f"disk: the steps still to run need {(peak + DISK_MARGIN) / 1e9:.1f} GB at their peak "
          f"({peak / 1e9:.1f} GB of files + {DISK_MARGIN / 1e9:.1f} GB margin); {free / 1e9:.1f} GB free on "
          f"{shown(out)}", flush=True)
    for line in lines:
        print(line, flush=True)
    if peak + DISK_MARGIN > free:
        raise SystemExit(f"not enough disk: {(peak + DISK_MARGIN) / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free "
                         f"on {out}")

    steps: dict[str, dict] = {}
    bf16_gone = threading.Event()

    def do(step: Step) -> None:
        if plan.done(step):
            steps[step.name] = {**plan.record(step), "reused": True}
            print(f"step {step.name}: done before ({steps[step.name]['seconds']:.0f} s then)", flush=True)
            return
        if step.name == "generate" and not any("hf" in s.needs and not plan.done(s) for s in plan.steps):
            return
        print(f"step {step.name}: started {time.strftime('%H:%M:%S UTC', time.gmtime())}", flush=True)
        got = run_step(plan, step, args.seed)
        steps[step.name] = got
        rss = f", peak RSS {got['peak_rss_bytes'] / MiB:.0f} MiB" if got.get("peak_rss_bytes") else ""
        print(f"step {step.name}: {got['seconds']:.0f} s, {got.get('bytes', 0) / 1e9:.2f} GB{rss}", flush=True)

    def lane(todo: list[Step]) -> None:
        for step in todo:
            if step.name == "colibri q8":
                bf16_gone.wait()
            do(step)
            if step.frees:
                bf16_gone.set()

    head, colibri_lane, llama_lane = plan.lanes()
    for step in head:
        do(step)
    if not any(s.frees for s in llama_lane):
        bf16_gone.set()
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(lane, colibri_lane), pool.submit(lane, llama_lane)]:
            f.result()
    result: dict = {"cpu": peer.cpu_name(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "size": args.size,
                    "params": size.params, "steps": steps,
                    "disk_used_bytes": sum(p.stat().st_size for k in ("q4", "q8", "Q4_0", "Q8_0")
                                           if (p := plan.files[k]).exists())}
    if args.steps_only:
        return result

    drivers = {"colibri": colibri_decode_driver(out)} if "colibri" in engines else {}
    if "llama.cpp" in engines:
        drivers["llama.cpp"] = llama_decode_driver(out)
    group, why = cgroup_for_pressure(args.cgroup)
    if group is None:
        print(f"no memory cgroup: {why}; the limited runs are skipped", flush=True)
    else:
        print(f"memory cgroup v{group.version}: {group.path} ({group.limit_file})", flush=True)
    ids = prompt_ids(size.vocab, args.seed)
    runs: list[Run] = []
    try:
        for dtype in dtypes:
            files = {"colibri": plan.files[dtype], "llama.cpp": plan.files[COLIBRI_DTYPES[dtype]]}
            print(f"\n== {dtype} / {COLIBRI_DTYPES[dtype]}: {PROMPT}-token prompt, {DECODE} greedy steps, cold cache, "
                  "engines alternating", flush=True)
            for name, path in files.items():
                if name in engines:
                    blocks = (" (int8 activation blocks on every layer, --int8-blocks 'layers.*')"
                              if name == "colibri" and INT8_BLOCKS else
                              " (f32 activations: no block kernels on this CPU)" if name == "colibri" else "")
                    print(f"  {name} file {shown(path)}: {path.stat().st_size / GiB:.2f} GiB{blocks}", flush=True)
            order = [e for e in ("colibri", "llama.cpp") if e in engines]
            limits = [lim for lim in (None, *run_limits) if group is not None or lim is None]
            limits = list(dict.fromkeys(limits))  # unlimited first: the tokens the others are checked against
            k = 0
            for limit in limits:
                for t in threads:
                    for engine in (order if k % 2 == 0 else order[::-1]):
                        run = execute(Run(engine, dtype if engine == "colibri" else COLIBRI_DTYPES[dtype], t, limit),
                                      files[engine], ids, group, drivers, args.run_timeout)
                        runs.append(run)
                        same = check_tokens(runs, run) if limit is not None and run.finished else None
                        print(report(run) + ("" if same is None else
                                             "; tokens = the unlimited run's" if same else
                                             "; TOKENS DIFFER from the unlimited run's"), flush=True)
                    k += 1
            second = size.limits_mib[1]
            if second in run_limits and "colibri" in engines and group is not None and second is not None:
                lock, nbytes, share = hottest(drivers["colibri"], files["colibri"], ids, size.lock_mib * MiB)
                print(f"  mlock: the {lock.count(':')} experts routing used most over the prompt "
                      f"({nbytes / MiB:.0f} MiB, {share:.0%} of its expert calls)", flush=True)
                # Then every tensor that is no expert's pinned (lock=dense): under the limit the kernel otherwise
                # evicts attention, embedding and head pages along with the experts, and they fault back.
                for t, pinned in [(t, pinned) for pinned in (lock, "dense") for t in threads]:
                    run = execute(Run("colibri", dtype, t, second, lock=pinned), files["colibri"], ids, group,
                                  drivers, args.run_timeout)
                    runs.append(run)
                    same = check_tokens(runs, run) if run.finished else None
                    print(report(run) + ("" if same is None else "; tokens = the unlimited run's" if same
                                         else "; TOKENS DIFFER from the unlimited run's"), flush=True)
    finally:
        if group is not None and group.created:
            group.path.rmdir()
    if runs:
        print(f"\ncold cache: {runs[0].cache_drop}", flush=True)
    met = targets(runs, size)
    print("\n== targets (issue 27)", flush=True)
    for target, measured, ok in met:
        verdict = "not measured" if ok is None else "MET" if ok else "MISSED"
        print(f"  {verdict:12} {target}: {measured}", flush=True)
    result["runs"] = [asdict(r) for r in runs]
    result["targets"] = [{"target": t, "measured": m, "met": ok} for t, m, ok in met]
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {shown(out / 'results.json')}", flush=True)
    return result


if __name__ == "__main__":
    main()
