"""Colibri beside llama.cpp on MoE language models (`make bench-lm`, issue 23): logits against Hugging Face,
decode and prefill tokens/s at 1 and 2 threads, peak RSS of a C process on each side, file bytes,
perplexity on the trained tiny King James model.

    .venv/bin/python bench/lm_vs_llama_cpp.py [--models mixtral,qwen2moe,olmoe,tiny,tiny_kj] [--rounds 3]
    .venv/bin/python bench/lm_vs_llama_cpp.py --quick            (CI-sized: the tiny model, few tokens)
    .venv/bin/python bench/lm_vs_llama_cpp.py --colibri-only     (no llama.cpp needed)
    .venv/bin/python bench/lm_vs_llama_cpp.py --gguf-import      (Colibri's GGUF import against llama.cpp)

llama.cpp is the tree PyPI's llama-cpp-python 0.3.36 sdist vendors, built by scripts/llama_cpp_setup.sh
(make bench-lm-setup) in build/llama.cpp. Models are random-weight Hugging Face MoE LMs (every matrix
N(0, 0.02)) saved as folders in build/bench-lm/hf with a sentencepiece vocabulary trained here (the
converter needs one; the token ids both engines see are random, so its content does not matter), and
examples/tiny_lm/model. Colibri: colibri.export at f32, f16, q8, q4, and q8/q4 with INT8_BLOCKS
activations on every layer ("q8b", "q4b"); llama.cpp: convert_hf_to_gguf.py to F32/F16, llama-quantize
to Q8_0 and Q4_0 (its defaults: routers stay F32, Q4_0's output head is raised to Q6_K/Q8_0).

1. Check: every file's logits on the same 64 random token ids against Hugging Face f32 (llama.cpp with
   flash attention off and an f32 KV cache; its defaults are printed beside), max |error| and that over
   max |HF logit|. At f32 this says both engines run the same model; at the other dtypes it is what the
   dtype costs.
2. Speed, engines alternating process by process, pinned (taskset: core 0 for 1 thread, cores 0-1 for 2):
   decode (DECODE tokens one call each after a PROMPT-token prompt) and prefill (PREFILL tokens in one
   call). Colibri: bench/lm_driver.c over libcolibri (colibri_lm_forward_ex, a colibri_pool of N
   workers). llama.cpp: llama-bench -t N at its defaults (flash attention auto, f16 cache, Q4_0 repacked
   at load), tg DECODE at depth PROMPT and pp PREFILL. Every call on both sides outputs its last token's
   logits only (llama-bench's batches mark only the last token; lm_driver passes logits_len = vocab), so
   both skip the layers after the last attention and the LM head for the other tokens: the same work.
   Medians over rounds. Peak RSS: each C process's
   ru_maxrss (wait4), the driver's and llama-bench's.
3. Perplexity per byte of the held-out King James text (examples/tiny_lm/evaluate.py's windows and
   images) through both engines' C drivers.

Results: build/bench-lm/results.json and the bar chart build/bench-lm/bench_lm.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host_tools"))
sys.path.insert(0, str(ROOT / "bench"))
import colibri  # noqa: E402
import gguf_exact  # noqa: E402  (bench/, beside this file)
import image_cache  # noqa: E402

CORE = ROOT / "firmware" / "colibri_core"
OUT = ROOT / "build" / "bench-lm"
LLAMA = ROOT / "build" / "llama.cpp"
LLAMA_SRC = LLAMA / "src"
LLAMA_BIN = LLAMA / "build" / "bin"
TINY_KJ = ROOT / "examples" / "tiny_lm" / "model"
SETUP_HINT = "llama.cpp not built: run make bench-lm-setup"
MAX_SEQ_LEN = 256
CHECK_TOKENS = 64

# Colibri dtype -> (export options, the llama.cpp file type it is set beside).
COLIBRI_DTYPES = {
    "f32": ({"dtype": "f32"}, "F32"),
    "f16": ({"dtype": "f16"}, "F16"),
    # f32 activations (what `colibri export` writes below 16 MiB); q8b/q4b: the int8 blocks it writes above
    "q8": ({"dtype": "q8", "int8_blocks": []}, "Q8_0"),
    "q4": ({"dtype": "q4", "int8_blocks": []}, "Q4_0"),
    "q8b": ({"dtype": "q8", "int8_blocks": ["layers.*"]}, "Q8_0"),
    "q4b": ({"dtype": "q4", "int8_blocks": ["layers.*"]}, "Q4_0"),
}
LLAMA_TYPES = ("F32", "F16", "Q8_0", "Q4_0")


@dataclass(frozen=True)
class Shape:
    """One benchmark run's sizes."""
    prompt: int
    decode: int
    prefill: int
    driver_rounds: int  # timed repetitions inside one process (llama-bench -r)


FULL = Shape(prompt=16, decode=128, prefill=64, driver_rounds=3)
QUICK = Shape(prompt=4, decode=16, prefill=16, driver_rounds=1)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


# ---- models ---------------------------------------------------------------------------------------

def _randomise(model) -> None:
    import torch

    with torch.no_grad():  # N(0, 0.02) on every matrix; norms stay at 1 (HF's init)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)


def _config(name: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig

    common = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  max_position_embeddings=MAX_SEQ_LEN, initializer_range=0.02, tie_word_embeddings=False)
    if name == "mixtral":  # 148 M parameters
        return MixtralConfig(**common, intermediate_size=1408, num_key_value_heads=2, num_local_experts=8,
                             num_experts_per_tok=2, sliding_window=None)
    if name == "qwen2moe":  # 126 M
        return Qwen2MoeConfig(**common, num_key_value_heads=8, num_experts=16, moe_intermediate_size=512,
                              num_experts_per_tok=4, shared_expert_intermediate_size=1024, intermediate_size=1024,
                              decoder_sparse_step=1, norm_topk_prob=False, use_sliding_window=False)
    if name == "olmoe":  # 113 M, q/k norm
        return OlmoeConfig(**common, num_key_value_heads=8, num_experts=16, intermediate_size=512,
                           num_experts_per_tok=2, norm_topk_prob=False)
    if name == "tiny":  # 0.25 M: the microcontroller class
        return MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=MAX_SEQ_LEN, initializer_range=0.02, sliding_window=None,
                             tie_word_embeddings=False)
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")


MODELS = ("mixtral", "qwen2moe", "olmoe", "tiny", "tiny_kj")


def hf_folder(name: str) -> Path:
    """The model as a Hugging Face folder (random weights, seed 0), made on first use."""
    if name == "tiny_kj":
        return TINY_KJ
    folder = OUT / "hf" / name
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name)).eval()
    _randomise(model)
    tmp = folder.with_name(name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def load_hf(name: str):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(hf_folder(name), dtype=torch.float32).eval()


def hf_logits(name: str, ids: np.ndarray) -> np.ndarray:
    import torch

    torch.set_num_threads(1)
    with torch.no_grad():
        return load_hf(name)(torch.from_numpy(ids[None].astype(np.int64))).logits[0].float().numpy()


# ---- Colibri --------------------------------------------------------------------------------------

def colibri_driver() -> Path:
    """bench/lm_driver.c over the host libcolibri.a, rebuilt when either is newer."""
    subprocess.run(["make", "-s", "-C", str(CORE), "host"], check=True)
    lib = CORE / "build" / "host" / "libcolibri.a"
    src = ROOT / "bench" / "lm_driver.c"
    exe = OUT / "lm_driver"
    if not exe.exists() or exe.stat().st_mtime < max(lib.stat().st_mtime, src.stat().st_mtime):
        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2",
                        "-D_POSIX_C_SOURCE=200809L",
                        f"-I{CORE / 'include'}", f"-I{CORE / 'posix'}", str(src), str(lib), "-lm", "-pthread",
                        "-o", str(exe)], check=True)
    return exe


def colibri_image(name: str, dtype: str) -> Path:
    """The model exported by colibri.export at `dtype` (max_batch 64, 256 positions), cached."""
    path = OUT / "colibri" / f"{name}-{dtype}.clb"
    settings = {"max_seq_len": MAX_SEQ_LEN, "max_batch": FULL.prefill, **COLIBRI_DTYPES[dtype][0]}
    if image_cache.is_fresh(path, settings):
        return path
    import torch

    torch.set_num_threads(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    colibri.export(load_hf(name), path, **settings)
    image_cache.mark_fresh(path, settings)
    print(f"  exported {shown(path)} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t:.0f} s)",
          flush=True)
    return path


def run_logits(cmd: list[str], ids: np.ndarray, window: int, vocab: int, tag: str,
               routes=None) -> np.ndarray | tuple[np.ndarray, dict[int, np.ndarray]]:
    """The driver's logits [len(ids), vocab]; with `routes` (a reader of the driver's ROUTES file) also
    each MoE layer's chosen experts per token, layer -> int [len(ids), k], sorted."""
    ids_file, out_file = OUT / f"{tag}.ids.i32", OUT / f"{tag}.logits.f32"
    routes_file = OUT / f"{tag}.routes"
    OUT.mkdir(parents=True, exist_ok=True)
    ids.astype(np.int32).tofile(ids_file)
    args = [a.replace("{IDS}", str(ids_file)).replace("{OUT}", str(out_file)).replace("{ROUTES}", str(routes_file))
            for a in cmd[1:]]
    r = subprocess.run(cmd[:1] + args, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    logits = np.fromfile(out_file, dtype=np.float32)
    ids_file.unlink()
    out_file.unlink()
    logits = logits.reshape(len(ids), -1)[:, :vocab]
    if routes is None:
        return logits
    chosen = routes(routes_file.read_bytes())
    routes_file.unlink()
    return logits, chosen


def _colibri_routes(raw: bytes) -> dict[int, np.ndarray]:
    """lm_driver's ROUTES records (int32 layer, experts E, tokens T, then T x E bytes) -> layer ->
    the chosen experts of each token, calls of one layer concatenated in order."""
    out: dict[int, list[np.ndarray]] = {}
    at = 0
    while at < len(raw):
        layer, experts, tokens = np.frombuffer(raw, np.int32, 3, at)
        at += 12
        mask = np.frombuffer(raw, np.uint8, tokens * experts, at).reshape(tokens, experts).astype(bool)
        at += tokens * experts
        k = mask.sum(axis=1)
        if (k != k[0]).any():
            raise SystemExit(f"lm_driver routes: layer {layer} sends tokens to {sorted(set(k))} experts")
        out.setdefault(int(layer), []).append(np.nonzero(mask)[1].reshape(tokens, k[0]))
    return {layer: np.concatenate(parts) for layer, parts in out.items()}


def _llama_routes(raw: bytes) -> dict[int, np.ndarray]:
    """llama_logits' --routes records (int32 layer, k, tokens T, then T x k expert ids) -> layer -> sorted ids."""
    out: dict[int, list[np.ndarray]] = {}
    at = 0
    while at < len(raw):
        layer, k, tokens = np.frombuffer(raw, np.int32, 3, at)
        at += 12
        out.setdefault(int(layer), []).append(np.sort(np.frombuffer(raw, np.int32, tokens * k, at).reshape(tokens, k),
                                                      axis=1))
        at += 4 * tokens * k
    return {layer: np.concatenate(parts) for layer, parts in out.items()}


def colibri_logits(driver: Path, image: Path, ids: np.ndarray, window: int, vocab: int, routes: bool = False):
    cmd = [str(driver), "logits", str(image), "1", "{IDS}", str(window), "{OUT}"] + (["{ROUTES}"] if routes else [])
    return run_logits(cmd, ids, window, vocab, "colibri", _colibri_routes if routes else None)


def timed(cmd: list[str], cpus: str) -> tuple[str, int]:
    """Runs cmd pinned to `cpus`; its stdout and its peak RSS in bytes. The peak comes from GNU time (-f %M,
    wait4's ru_maxrss of its child): Linux carries a process's high-water mark across exec, so a command
    forked straight from this Python process, torch loaded, would report the interpreter's RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file, err_file = Path(tmp) / "rss", Path(tmp) / "err"
        with err_file.open("w") as err:  # a file, not a pipe: the logs can be long
            r = subprocess.run(["taskset", "-c", cpus, "/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd],
                               stdout=subprocess.PIPE, stderr=err, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {err_file.read_text().strip()[-2000:]}")
        return r.stdout, int(rss_file.read_text().split()[-1]) * 1024


def colibri_speed(driver: Path, image: Path, threads: int, shape: Shape) -> dict:
    out, rss = timed([str(driver), "speed", str(image), str(threads), str(shape.prompt), str(shape.decode),
                      str(shape.prefill), str(shape.driver_rounds)], cpus=pin(threads))
    r = json.loads(out)
    r["max_rss_bytes"] = rss  # as llama.cpp's, from outside the process
    return r


def pin(threads: int) -> str:
    return ",".join(str(c) for c in range(min(threads, os.cpu_count() or 1)))


# ---- llama.cpp ------------------------------------------------------------------------------------

def llama_built() -> bool:
    return all((LLAMA_BIN / t).exists() for t in ("llama-bench", "llama-quantize")) and \
        (LLAMA_SRC / "convert_hf_to_gguf.py").exists()


def llama_driver() -> Path:
    """bench/llama_logits.c over the libllama the setup script built."""
    src = ROOT / "bench" / "llama_logits.c"
    exe = OUT / "llama_logits"
    lib = LLAMA_BIN / "libllama.so"
    if not exe.exists() or exe.stat().st_mtime < max(src.stat().st_mtime, lib.stat().st_mtime):
        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{LLAMA_SRC / 'include'}",
                        f"-I{LLAMA_SRC / 'ggml' / 'include'}", str(src), f"-L{LLAMA_BIN}", "-lllama", "-lggml",
                        "-lggml-base", f"-Wl,-rpath,{LLAMA_BIN.resolve()}", "-o", str(exe)], check=True)
    return exe


def vocabulary(folder: Path, vocab: int) -> Path:
    """A sentencepiece tokenizer.model for `folder`, trained on the machine's licence texts; the converter
    needs a vocabulary and pads it with [PAD] entries up to the model's vocab_size."""
    model = OUT / "vocab" / f"sp{vocab}.model"
    if not model.exists():
        import sentencepiece as spm

        model.parent.mkdir(parents=True, exist_ok=True)
        texts = sorted(str(p) for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
        spm.SentencePieceTrainer.train(input=",".join(texts), model_prefix=str(model.with_suffix("")),
                                       vocab_size=vocab, model_type="unigram", hard_vocab_limit=False,
                                       character_coverage=1.0, minloglevel=2)
    return model


# The converter runs Mixtral's vocabulary from tokenizer.model already; Qwen2-MoE, Qwen3-MoE and OLMoE
# default to a GPT-2 BPE tokenizer.json, so their classes are pointed at the sentencepiece path.
_CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
from conversion import base
base.TextModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


class ConversionError(RuntimeError):
    """llama.cpp's converter refused the model."""


def gguf(name: str, ftype: str) -> Path:
    path = OUT / "gguf" / f"{name}-{ftype}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if ftype in ("F32", "F16"):
        src = hf_folder(name)
        work = OUT / "gguf" / f"{name}-hf"  # a copy of the folder with the vocabulary beside the weights
        if not (work / "tokenizer.model").exists():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            for f in src.iterdir():
                if f.suffix in (".json", ".safetensors"):
                    os.symlink(f.resolve(), work / f.name)
            cfg = json.loads((src / "config.json").read_text())
            shutil.copy(vocabulary(work, cfg["vocab_size"]), work / "tokenizer.model")
        tmp = path.with_suffix(".tmp")
        r = subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_SRC), str(work), "--outfile", str(tmp),
                            "--outtype", ftype.lower()], capture_output=True, text=True)
        if r.returncode != 0:
            raise ConversionError(f"convert_hf_to_gguf.py {name} {ftype} failed: "
                                  f"{r.stderr.strip().splitlines()[-1]}")
    else:
        tmp = path.with_suffix(".tmp")
        r = subprocess.run([str(LLAMA_BIN / "llama-quantize"), str(gguf(name, "F32")), str(tmp), ftype],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize {name} {ftype} failed: {r.stderr.strip()[-3000:]}")
    tmp.rename(path)
    print(f"  made {shown(path)} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    return path


def llama_files(name: str) -> dict[str, Path]:
    """The model's GGUF files, or none (the reason printed) where llama.cpp's converter refuses it: the
    King James model's dense first layer (mlp_only_layers = [0]) has no place in its Qwen3-MoE."""
    try:
        return {t: gguf(name, t) for t in LLAMA_TYPES}
    except ConversionError as e:
        print(f"  llama.cpp: {name} not run: {e}", flush=True)
        return {}


def pure_gguf(name: str, ftype: str) -> Path:
    """The F32 file quantised with llama-quantize --pure (every matrix in `ftype`, the embedding and head
    too; the routers, ffn_gate_inp, stay F32, which llama-quantize never quantises): a file Colibri's GGUF
    import reads whole (the default Q4_0 head is Q6_K, which it refuses)."""
    if ftype in ("F32", "F16"):
        return gguf(name, ftype)
    path = OUT / "gguf" / f"{name}-{ftype}-pure.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        r = subprocess.run([str(LLAMA_BIN / "llama-quantize"), "--pure", str(gguf(name, "F32")), str(tmp), ftype],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize --pure {name} {ftype} failed: {r.stderr.strip()[-3000:]}")
        tmp.rename(path)
        print(f"  made {shown(path)} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    return path


def gguf_image(model: Path, dtype: str | None) -> Path:
    """`colibri export model.gguf` at `dtype` (None: the file's own), cached beside the file."""
    path = OUT / "colibri" / f"{model.stem}-{dtype or 'own'}.clb"
    if not path.exists() or path.stat().st_mtime < model.stat().st_mtime:
        path.parent.mkdir(parents=True, exist_ok=True)
        # f32 activations: the comparison is of the weights the import carries or requantises
        colibri.export(model, path, max_seq_len=MAX_SEQ_LEN, max_batch=FULL.prefill, dtype=dtype, check=False,
                       int8_blocks=[])
    return path


def route_flips(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> np.ndarray:
    """bool [tokens, layers]: where two runs' chosen expert sets differ, over b's MoE layers (Colibri also
    reports a dense layer, which it runs as one expert behind a zero router)."""
    layers = sorted(b)
    if not set(layers) <= set(a):
        raise SystemExit(f"routing of layers {sorted(a)} beside {layers}")
    return np.stack([(a[i] != b[i]).any(axis=1) for i in layers], axis=1)


def route_margin(probs: dict[int, np.ndarray], k: int) -> np.ndarray:
    """float [tokens, layers]: the exact router's gap between its k-th and (k+1)-th expert's probability,
    how near the choice was to a tie."""
    out = []
    for i in sorted(probs):
        p = -np.sort(-probs[i], axis=1)
        out.append(p[:, k - 1] - p[:, k])
    return np.stack(out, axis=1)


def against_exact(got: np.ndarray, exact: np.ndarray) -> dict:
    err = float(np.abs(got - exact).max())
    return {"max_abs": err, "rel": rel(err, exact), "argmax_agree": float((got.argmax(1) == exact.argmax(1)).mean())}


def gguf_import(names, driver: Path, ldriver: Path, exact: bool = True) -> list[dict]:
    """Colibri's import of each llama.cpp file against llama.cpp on that same file (flash attention off,
    f32 KV cache): max |Δlogit| on CHECK_TOKENS random ids, and that over max |llama.cpp logit|. Colibri at
    f32 holds the file's dequantised weights exactly (llama.cpp still rounds its activations to 8-bit
    blocks for the Q8_0/Q4_0 products); at the file's own dtype Q8_0 is requantised to q8 and Q4_0 carried
    into q4 block for block.

    With `exact`, each engine is also set beside the exact answer (bench/gguf_exact.py: a float64 forward
    over the file's dequantised weights) and beside that forward with llama.cpp's activation rounding
    emulated, and the experts each one's routing chose (per token and MoE layer) are compared."""
    rows = []
    print(f"\n== GGUF import: Colibri on llama.cpp's own files against llama.cpp, {CHECK_TOKENS} random ids "
          "(max |Δlogit|, and over max |llama.cpp logit|)", flush=True)
    for name in names:
        vocab = json.loads((hf_folder(name) / "config.json").read_text())["vocab_size"]
        ids = np.random.default_rng(7).integers(0, vocab, CHECK_TOKENS).astype(np.int32)
        try:
            files = {t: pure_gguf(name, t) for t in LLAMA_TYPES}
        except ConversionError as e:
            print(f"  {name}: not run: {e}", flush=True)
            continue
        for ftype, model in files.items():
            want, llama_routes = llama_logits(ldriver, model, ids, CHECK_TOKENS, vocab, routes=True)
            if exact:
                ref = gguf_exact.exact_forward(model, ids)
                emulated = gguf_exact.exact_forward(model, ids, act_rounding="ggml")
                on_its_routes = gguf_exact.exact_forward(model, ids, routes=llama_routes)
                emulated_on_its_routes = gguf_exact.exact_forward(model, ids, act_rounding="ggml",
                                                                  routes=llama_routes)
                k = next(iter(ref.chosen.values())).shape[1]
                margin = route_margin(ref.probs, k)
                ll_flips = route_flips(llama_routes, ref.chosen)
                em_flips = route_flips(emulated.chosen, ref.chosen)
                gates = np.concatenate([g.ravel() for g in ref.gates.values()])
                llama_vs = {"exact": against_exact(want, ref.logits),
                            # The exact forward made to route as llama.cpp did: what is left is its arithmetic,
                            # and the exact forward's own move is what llama.cpp's routing flips cost.
                            "exact_on_its_routes": against_exact(want, on_its_routes.logits),
                            "routing_cost": against_exact(on_its_routes.logits, ref.logits),
                            "emulated_on_its_routes": against_exact(want, emulated_on_its_routes.logits),
                            "route_flips_vs_exact": float(ll_flips.mean()),
                            "tokens_flipped_vs_exact": float(ll_flips.any(axis=1).mean()),
                            "emulated_vs_exact": {**against_exact(emulated.logits, ref.logits),
                                                  "route_flips": float(em_flips.mean())},
                            "gate_weight_median": float(np.median(gates)),
                            "exact_margin_median": float(np.median(margin))}
                if ll_flips.any():
                    llama_vs["exact_margin_where_flipped"] = float(np.median(margin[ll_flips]))
                print(f"  {name:9} {ftype:5}    llama.cpp vs exact: rel {llama_vs['exact']['rel']:.3g}, argmax "
                      f"{100 * llama_vs['exact']['argmax_agree']:.0f}%, routes differ on "
                      f"{100 * llama_vs['route_flips_vs_exact']:.1f}% of token-layers "
                      f"({100 * llama_vs['tokens_flipped_vs_exact']:.0f}% of tokens); on its own routes rel "
                      f"{llama_vs['exact_on_its_routes']['rel']:.3g} (its rounding emulated: "
                      f"{llama_vs['emulated_on_its_routes']['rel']:.3g}); its flips alone move the exact "
                      f"logits by rel {llama_vs['routing_cost']['rel']:.3g}", flush=True)
                print(f"  {'':9} {'':5}    exact with llama.cpp's activation rounding emulated: rel "
                      f"{llama_vs['emulated_vs_exact']['rel']:.3g}, routes differ on "
                      f"{100 * llama_vs['emulated_vs_exact']['route_flips']:.1f}%; chosen experts' gate weight "
                      f"median {llama_vs['gate_weight_median']:.2g}; router margin (k-th minus next probability) "
                      f"median {llama_vs['exact_margin_median']:.2g}"
                      + (f", where llama.cpp flipped {llama_vs['exact_margin_where_flipped']:.2g}"
                         if ll_flips.any() else ""), flush=True)
            for dtype in ("f32", None):
                image = gguf_image(model, dtype)
                got, routes = colibri_logits(driver, image, ids, CHECK_TOKENS, vocab, routes=True)
                err = float(np.abs(got - want).max())
                flips = route_flips(routes, llama_routes)
                row = {"model": name, "file": ftype, "colibri_dtype": dtype or "own", "max_abs": err,
                       "rel": rel(err, want), "argmax_agree": float((got.argmax(1) == want.argmax(1)).mean()),
                       "route_flips_vs_llama": float(flips.mean()),
                       "tokens_flipped_vs_llama": float(flips.any(axis=1).mean())}
                # The logit gap on the tokens where every layer routed alike, and on the others.
                same = ~flips.any(axis=1)
                row["max_abs_same_routes"] = float(np.abs(got - want)[same].max()) if same.any() else None
                print(f"  {name:9} {ftype:5} -> colibri {row['colibri_dtype']:4} max|Δlogit| {err:.3g}  rel "
                      f"{row['rel']:.3g}  argmax agrees {100 * row['argmax_agree']:.0f}%; routes differ from "
                      f"llama.cpp's on {100 * row['route_flips_vs_llama']:.1f}% of token-layers "
                      f"({100 * row['tokens_flipped_vs_llama']:.0f}% of tokens)", flush=True)
                if exact:
                    c_flips = route_flips(routes, ref.chosen)
                    row["colibri_vs_exact"] = {**against_exact(got, ref.logits),
                                               "route_flips_vs_exact": float(c_flips.mean()),
                                               "tokens_flipped_vs_exact": float(c_flips.any(axis=1).mean())}
                    row["llama_vs_exact"] = llama_vs
                    cx = row["colibri_vs_exact"]
                    print(f"  {'':9} {'':5}    colibri {row['colibri_dtype']:4} vs exact: rel {cx['rel']:.3g}, argmax "
                          f"{100 * cx['argmax_agree']:.0f}%, routes differ on {100 * cx['route_flips_vs_exact']:.1f}%",
                          flush=True)
                rows.append(row)
    return rows


def llama_logits(driver: Path, model: Path, ids: np.ndarray, window: int, vocab: int, defaults: bool = False,
                 routes: bool = False):
    cmd = [str(driver), str(model), "1", "{IDS}", str(window), "{OUT}"] + (["--defaults"] if defaults else []) + \
        (["--routes", "{ROUTES}"] if routes else [])
    return run_logits(cmd, ids, window, vocab, "llama", _llama_routes if routes else None)


def llama_speed(model: Path, threads: int, shape: Shape) -> dict:
    """llama-bench at its defaults: pp PREFILL from an empty cache, tg DECODE at depth PROMPT."""
    bench = str(LLAMA_BIN / "llama-bench")
    common = ["-m", str(model), "-t", str(threads), "-r", str(shape.driver_rounds), "-o", "json"]
    out_p, rss_p = timed([bench, *common, "-p", str(shape.prefill), "-n", "0"], cpus=pin(threads))
    out_d, rss_d = timed([bench, *common, "-p", "0", "-n", str(shape.decode), "-d", str(shape.prompt)],
                         cpus=pin(threads))
    pre, dec = json.loads(out_p)[0], json.loads(out_d)[0]
    return {"decode_tps": dec["avg_ts"], "prefill_tps": pre["avg_ts"], "max_rss_bytes": max(rss_p, rss_d)}


# ---- the bench ------------------------------------------------------------------------------------

def rel(err: float, ref: np.ndarray) -> float:
    return err / float(np.abs(ref).max())


def rms_rel(got: np.ndarray, ref: np.ndarray) -> float:
    """RMS of the logit error over the RMS logit: every position and token counts, where the max is
    one near-tied routing decision (docs/benchmarks.md)."""
    return float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref**2)))


def check(names, colibri_dtypes, with_llama: bool, driver: Path, ldriver: Path | None) -> list[dict]:
    rows = []
    print(f"\n== logits on {CHECK_TOKENS} random token ids against Hugging Face f32 "
          "(max |error|, and over max |HF logit|)", flush=True)
    for name in names:
        cfg = json.loads((hf_folder(name) / "config.json").read_text())
        vocab = cfg["vocab_size"]
        ids = np.random.default_rng(7).integers(0, vocab, CHECK_TOKENS).astype(np.int32)
        want = hf_logits(name, ids)
        for dtype in colibri_dtypes:
            got = colibri_logits(driver, colibri_image(name, dtype), ids, CHECK_TOKENS, vocab)
            err = float(np.abs(got - want).max())
            rows.append({"model": name, "engine": "colibri", "dtype": dtype, "max_abs": err, "rel": rel(err, want),
                         "rms_rel": rms_rel(got, want),
                         "argmax_agree": float((got.argmax(1) == want.argmax(1)).mean())})
        if with_llama:
            for ftype, model in llama_files(name).items():
                for defaults in (False, True):
                    got = llama_logits(ldriver, model, ids, CHECK_TOKENS, vocab, defaults)
                    err = float(np.abs(got - want).max())
                    rows.append({"model": name, "engine": "llama.cpp" + (" (fa auto, f16 KV)" if defaults else ""),
                                 "dtype": ftype, "max_abs": err, "rel": rel(err, want), "rms_rel": rms_rel(got, want),
                                 "argmax_agree": float((got.argmax(1) == want.argmax(1)).mean())})
        for r in rows:
            if r["model"] == name:
                print(f"  {name:9} {r['engine']:26} {r['dtype']:5} max|err| {r['max_abs']:.3g}  rel {r['rel']:.3g}  "
                      f"rms {r['rms_rel']:.3g}  argmax agrees {100 * r['argmax_agree']:.0f}%", flush=True)
    return rows


def speed(names, colibri_dtypes, with_llama: bool, driver: Path, threads: list[int], rounds: int,
          shape: Shape) -> dict:
    """(model, engine, dtype, threads) -> medians over rounds; the processes alternate engine by engine."""
    samples: dict[tuple, list[dict]] = {}
    print(f"\n== speed: decode {shape.decode} after a {shape.prompt}-token prompt, prefill {shape.prefill}; "
          f"{rounds} round(s), engines alternating, pinned", flush=True)
    for name in names:
        jobs = [("colibri", d, colibri_image(name, d)) for d in colibri_dtypes]
        if with_llama:
            jobs += [("llama.cpp", t, path) for t, path in llama_files(name).items()]
        # Interleave the engines, so that a change in the machine's load hits both alike.
        order = sorted(jobs, key=lambda j: (LLAMA_TYPES.index(COLIBRI_DTYPES[j[1]][1] if j[0] == "colibri" else j[1]),
                                            j[0] != "colibri"))
        for r in range(rounds):
            for t in (threads if r % 2 == 0 else threads[::-1]):
                for engine, dtype, path in (order if r % 2 == 0 else order[::-1]):
                    res = (colibri_speed(driver, path, t, shape) if engine == "colibri"
                           else llama_speed(path, t, shape))
                    res["file_bytes"] = path.stat().st_size
                    samples.setdefault((name, engine, dtype, t), []).append(res)
        for (n, engine, dtype, t), got in samples.items():
            if n == name:
                print(f"  {name:9} {engine:9} {dtype:5} {t} thread(s): decode {med(got, 'decode_tps'):8.1f} tok/s, "
                      f"prefill {med(got, 'prefill_tps'):8.1f} tok/s, peak RSS "
                      f"{max(g['max_rss_bytes'] for g in got) / 1e6:7.1f} MB, "
                      f"file {got[0]['file_bytes'] / 1e6:7.1f} MB",
                      flush=True)
    return {k: {"decode_tps": med(v, "decode_tps"), "prefill_tps": med(v, "prefill_tps"),
                "max_rss_bytes": max(g["max_rss_bytes"] for g in v), "file_bytes": v[0]["file_bytes"],
                "rounds": len(v), "kernels": v[0].get("kernels")} for k, v in samples.items()}


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def perplexity(with_llama: bool, driver: Path, ldriver: Path | None, windows: int) -> list[dict]:
    """Held-out perplexity per byte of the tiny King James model, evaluate-tiny-lm's windows and images."""
    sys.path.insert(0, str(ROOT / "examples" / "tiny_lm"))
    import corpus  # noqa: PLC0415
    import evaluate  # noqa: PLC0415
    from train import CONTEXT  # noqa: PLC0415

    text = corpus.load().held_out
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    n = min(windows, len(ids) // CONTEXT)
    ids = ids[: n * CONTEXT]
    rows = []
    recorded = json.loads((TINY_KJ / "metrics.json").read_text())["test_slice"]
    torch_says = (f"; PyTorch f32 on these windows: {recorded['held_out_perplexity_per_byte']}"
                  if recorded["held_out_bytes_scored"] == n * (CONTEXT - 1) else "")
    print(f"\n== tiny King James model: held-out perplexity per byte, {n} windows of {CONTEXT} bytes{torch_says}",
          flush=True)
    runs = [("colibri", d, lambda d=d: colibri_logits(driver, evaluate.image_path(d), ids, CONTEXT, 256))
            for d in evaluate.DTYPES]
    if with_llama:
        files = llama_files("tiny_kj")
        runs += [("llama.cpp", t, lambda t=t: llama_logits(ldriver, files[t], ids, CONTEXT, 256)) for t in files]
    for engine, dtype, logits_of in runs:
        logits = logits_of().astype(np.float64).reshape(n, CONTEXT, -1)[:, :-1]
        target = ids.reshape(n, CONTEXT)[:, 1:]
        top = logits.max(axis=2, keepdims=True)
        log_z = top[..., 0] + np.log(np.exp(logits - top).sum(axis=2))
        nll = float((log_z - np.take_along_axis(logits, target[..., None], axis=2)[..., 0]).mean())
        rows.append({"engine": engine, "dtype": dtype, "perplexity": math.exp(nll)})
        print(f"  {engine:9} {dtype:5} perplexity {math.exp(nll):.4f}", flush=True)
    return rows


def table(results: dict, names, colibri_dtypes, threads: list[int], with_llama: bool) -> str:
    lines = []
    if with_llama:
        head = ["model", "Colibri", "llama.cpp"] + [f"decode {t}t" for t in threads] + \
               [f"prefill {t}t" for t in threads] + ["peak RSS MB (C / L)", "file MB (C / L)"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in names:
            for dtype in colibri_dtypes:
                peer = COLIBRI_DTYPES[dtype][1]
                c = {t: results.get((name, "colibri", dtype, t)) for t in threads}
                ll = {t: results.get((name, "llama.cpp", peer, t)) for t in threads}
                if any(v is None for v in (*c.values(), *ll.values())):
                    continue
                cells = [name, dtype, peer]
                cells += [f"{c[t]['decode_tps'] / ll[t]['decode_tps']:.2f}x "
                          f"({c[t]['decode_tps']:.0f}/{ll[t]['decode_tps']:.0f})" for t in threads]
                cells += [f"{c[t]['prefill_tps'] / ll[t]['prefill_tps']:.2f}x "
                          f"({c[t]['prefill_tps']:.0f}/{ll[t]['prefill_tps']:.0f})" for t in threads]
                t0 = threads[0]
                cells.append(f"{c[t0]['max_rss_bytes'] / 1e6:.1f} / {ll[t0]['max_rss_bytes'] / 1e6:.1f}")
                cells.append(f"{c[t0]['file_bytes'] / 1e6:.1f} / {ll[t0]['file_bytes'] / 1e6:.1f}")
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("(ratio Colibri / llama.cpp, then tok/s Colibri/llama.cpp; RSS and files at "
                     f"{threads[0]} thread)")
    else:
        head = ["model", "dtype"] + [f"decode {t}t tok/s" for t in threads] + \
               [f"prefill {t}t tok/s" for t in threads] + ["peak RSS MB", "file MB"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in names:
            for dtype in colibri_dtypes:
                c = {t: results[(name, "colibri", dtype, t)] for t in threads}
                lines.append("| " + " | ".join([name, dtype] + [f"{c[t]['decode_tps']:.1f}" for t in threads] +
                                                [f"{c[t]['prefill_tps']:.1f}" for t in threads] +
                                                [f"{c[threads[0]]['max_rss_bytes'] / 1e6:.1f}",
                                                 f"{c[threads[0]]['file_bytes'] / 1e6:.1f}"]) + " |")
    return "\n".join(lines)


def chart(results: dict, names, colibri_dtypes, threads: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) * len(colibri_dtypes)), 4.5), sharey=True)
    labels = [f"{n}\n{d}" for n in names for d in colibri_dtypes]
    x = np.arange(len(labels))
    width = 0.8 / len(threads)
    for ax, key, title in zip(axes, ("decode_tps", "prefill_tps"), ("decode", "prefill")):
        for i, t in enumerate(threads):
            ratios = []
            for n in names:
                for d in colibri_dtypes:
                    c = results.get((n, "colibri", d, t))
                    ll = results.get((n, "llama.cpp", COLIBRI_DTYPES[d][1], t))
                    ratios.append(c[key] / ll[key] if c and ll else np.nan)
            ax.bar(x + (i - (len(threads) - 1) / 2) * width, ratios, width, label=f"{t} thread(s)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(f"{title}: Colibri tok/s / llama.cpp tok/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"make bench-lm on {cpu_name()} (shared machine)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default=",".join(COLIBRI_DTYPES), help="Colibri dtypes (llama.cpp: their peers)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of processes")
    ap.add_argument("--ppl-windows", type=int, default=64,
                    help="King James held-out windows scored (64: the slice metrics.json records PyTorch's figure for)")
    ap.add_argument("--quick", action="store_true", help="CI-sized: the tiny model, few tokens, one round")
    ap.add_argument("--colibri-only", action="store_true", help="Colibri's half alone (no llama.cpp)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--gguf-import", action="store_true",
                    help="only Colibri's import of llama.cpp's F32/F16/Q8_0/Q4_0 files against llama.cpp on them")
    ap.add_argument("--no-exact", action="store_true",
                    help="with --gguf-import: skip the float64 forward (bench/gguf_exact.py) each engine is set beside")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "bench-lm",
                    help="where results.json and bench_lm.png go")
    ap.add_argument("--cache", type=Path, default=ROOT / "build" / "bench-lm",
                    help="where models, images, GGUF files and drivers are kept")
    args = ap.parse_args(argv)
    OUT = args.cache
    shape = QUICK if args.quick else FULL
    names = ["tiny"] if args.quick else [n for n in args.models.split(",") if n]
    for n in names:
        if n not in MODELS:
            raise SystemExit(f"unknown model {n!r}: one of {', '.join(MODELS)}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in COLIBRI_DTYPES:
            raise SystemExit(f"unknown dtype {d!r}: one of {', '.join(COLIBRI_DTYPES)}")
    threads = [int(t) for t in args.threads.split(",")]
    rounds = 1 if args.quick else args.rounds
    with_llama = not args.colibri_only
    if with_llama and not llama_built():
        raise SystemExit(SETUP_HINT)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores (shared machine: timings are noisy); "
          f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    driver = colibri_driver()
    ldriver = llama_driver() if with_llama else None
    out: dict = {"cpu": cpu_name(), "shape": shape.__dict__, "threads": threads}
    if args.gguf_import:
        if not with_llama:
            raise SystemExit("--gguf-import compares with llama.cpp: drop --colibri-only")
        out["gguf_import"] = gguf_import(names, driver, ldriver, exact=not args.no_exact)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gguf_import.json").write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.out / 'gguf_import.json'}")
        return out
    if not args.no_check:
        out["check"] = check(names, dtypes, with_llama, driver, ldriver)
    results = speed(names, dtypes, with_llama, driver, threads, rounds, shape)
    out["speed"] = [{"model": k[0], "engine": k[1], "dtype": k[2], "threads": k[3], **v} for k, v in results.items()]
    if not args.no_ppl and ("tiny_kj" in names or args.quick):
        out["perplexity"] = perplexity(with_llama, driver, ldriver, args.ppl_windows)
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    text = table(results, names, dtypes, threads, with_llama)
    print("\n" + text)
    out["table"] = text
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1))
    if with_llama:
        chart(results, names, dtypes, threads, args.out / "bench_lm.png")
        print(f"\nwrote {args.out / 'results.json'} and the chart {args.out / 'bench_lm.png'}")
    return out


if __name__ == "__main__":
    main()
