"""Export a Hugging Face folder streamed vs in memory (issue 26): peak RSS and wall time, printed.

    .venv/bin/python bench/hf_export.py [--hidden 512 --layers 8 --experts 8 --intermediate 1408 --vocab 4096]
                                        [--dtype q8 ...] [--repeat 1] [--no-in-memory] [--dir DIR] [--keep]
    make bench-hf-export        (~600 MB f32 folder: hidden 512, 8 layers, 8 experts x 1408, GQA 8/2)
    make bench-hf-export-full   (the issue's 2.3 GB folder: hidden 1024, 8 experts x 2816, 500 MB shards)

The folder is a random Mixtral (seeded normal weights, N(0, 1/fan_in); norms near 1) written as a
Hugging Face checkpoint shard by shard (config.json, model-0000i-of-0000n.safetensors, the index),
without torch and never more than one shard in memory. Each export runs in its own process under
/usr/bin/time -v, whose "Maximum resident set size" is the figure printed (the whole process,
interpreter and libraries included):

- streamed: `colibri export DIR out.clb --max-seq-len N --dtype D` (colibri.checkpoints.hf_folder);
- in memory: `AutoModelForCausalLM.from_pretrained(DIR)` then `hf_lm.export_lm` and the file write,
  as `colibri.export(model, ...)` does it (check=False, so the two do the same work but the check).

The two images are compared byte for byte. Times are wall clock on a shared machine; with
--repeat the median is printed.

--llama-cpp (needs make bench-lm-setup) times llama.cpp's way to the same weights beside them, each
step in its own process under /usr/bin/time -v: convert_hf_to_gguf.py DIR --outtype f32 (a
SentencePiece vocabulary trained here is put in the folder first, after Colibri's runs, as the
converter needs one), then llama-quantize to Q8_0 and to Q4_0 from that F32 file.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def mixtral_tensors(a: argparse.Namespace):
    """(name, shape) of a Hugging Face Mixtral checkpoint, in model order."""
    d, hd = a.hidden, a.hidden // a.heads
    yield "model.embed_tokens.weight", (a.vocab, d)
    for i in range(a.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (d,)
        yield f"{p}.self_attn.q_proj.weight", (a.heads * hd, d)
        yield f"{p}.self_attn.k_proj.weight", (a.kv_heads * hd, d)
        yield f"{p}.self_attn.v_proj.weight", (a.kv_heads * hd, d)
        yield f"{p}.self_attn.o_proj.weight", (d, a.heads * hd)
        yield f"{p}.post_attention_layernorm.weight", (d,)
        yield f"{p}.block_sparse_moe.gate.weight", (a.experts, d)
        for e in range(a.experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            yield f"{q}.w1.weight", (a.intermediate, d)
            yield f"{q}.w2.weight", (d, a.intermediate)
            yield f"{q}.w3.weight", (a.intermediate, d)
    yield "model.norm.weight", (d,)
    yield "lm_head.weight", (a.vocab, d)


def make_folder(folder: Path, a: argparse.Namespace) -> int:
    """Write the random checkpoint shard by shard; its f32 bytes."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    plan = list(mixtral_tensors(a))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in plan:
        nbytes = 4 * int(np.prod(shape))
        if shards[-1] and size + nbytes > a.shard_mb * 10**6:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if len(shape) == 1:
                tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                tensors[name] = (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1])))
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": a.hidden, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "num_local_experts": a.experts,
        "num_experts_per_tok": 2, "vocab_size": a.vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "sliding_window": None,
        "tie_word_embeddings": False, "dtype": "float32",
    }, indent=1))
    return total


IN_MEMORY = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM
from colibri.frontends import hf_lm
from colibri.image import write_atomically
folder, out, seq, dtype = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(folder)
write_atomically(out, hf_lm.export_lm(model, max_seq_len=seq, dtype=dtype, check=False).image)
"""


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a child process, from /usr/bin/time -v."""
    run = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=ROOT)
    if run.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", run.stderr).group(1)
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    return seconds, rss


def llama_cpp(folder: Path, work: Path, a: argparse.Namespace, f32_bytes: int) -> None:
    """llama.cpp's converter and quantiser on the folder, timed as the exports are."""
    import shutil

    sys.path.insert(0, str(ROOT / "bench"))
    import lm_vs_llama_cpp as lm

    if not lm.llama_built():
        sys.exit(lm.SETUP_HINT)
    shutil.copy(lm.vocabulary(folder, a.vocab), folder / "tokenizer.model")
    f32 = work / "llama-f32.gguf"
    seconds, rss = timed([PY, str(lm.LLAMA_SRC / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(f32),
                          "--outtype", "f32"])
    print(f"llama.cpp convert_hf_to_gguf.py F32: {seconds:7.1f} s, peak RSS {rss / 2**20:7.0f} MiB = "
          f"{100 * rss / f32_bytes:5.1f}% of the f32 bytes; file {f32.stat().st_size / 2**20:.0f} MiB")
    for ftype in ("Q8_0", "Q4_0"):
        out = work / f"llama-{ftype}.gguf"
        q_seconds, q_rss = timed([str(lm.LLAMA_BIN / "llama-quantize"), str(f32), str(out), ftype])
        print(f"llama.cpp llama-quantize {ftype}:       {q_seconds:7.1f} s, peak RSS {q_rss / 2**20:7.0f} MiB; file "
              f"{out.stat().st_size / 2**20:.0f} MiB; convert + quantize {seconds + q_seconds:.1f} s")
        out.unlink()
    f32.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--shard-mb", type=int, default=500, help="shard size in MB (10^6 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", action="append", help="weight dtypes to export (repeatable; default q8)")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-in-memory", action="store_true", help="only the streamed export (big folders)")
    ap.add_argument("--dir", type=Path, help="where the folder goes (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the folder and images")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also time convert_hf_to_gguf.py (F32) and llama-quantize (Q8_0, Q4_0) on the folder")
    a = ap.parse_args()
    work = a.dir or Path(tempfile.mkdtemp(prefix="colibri-hf-"))
    folder = work / "hf"
    f32_bytes = make_folder(folder, a)
    params = f32_bytes // 4
    shards = len(list(folder.glob("*.safetensors")))
    print(f"folder {folder}: random Mixtral, hidden {a.hidden}, {a.layers} layers, {a.experts} experts x "
          f"{a.intermediate} top-2, GQA {a.heads}/{a.kv_heads}, vocab {a.vocab}: {params / 1e6:.1f} M parameters, "
          f"{f32_bytes / 2**20:.0f} MiB f32 in {shards} shards")
    colibri = [PY, "-c", "from colibri.cli import main; main()"]
    for dtype in a.dtype or ["q8"]:
        runs: dict[str, list[tuple[float, int]]] = {"streamed": [], "in memory": []}
        for _ in range(a.repeat):
            runs["streamed"].append(timed([*colibri, "export", str(folder), str(work / f"s-{dtype}.clb"),
                                           "--max-seq-len", str(a.max_seq_len), "--dtype", dtype, "--no-check"]))
            if not a.no_in_memory:
                runs["in memory"].append(timed([PY, "-c", IN_MEMORY, str(folder), str(work / f"m-{dtype}.clb"),
                                                str(a.max_seq_len), dtype]))
        for how, got in runs.items():
            if not got:
                continue
            wall = statistics.median(s for s, _ in got)
            rss = statistics.median(r for _, r in got)
            image = work / (f"s-{dtype}.clb" if how == "streamed" else f"m-{dtype}.clb")
            print(f"{dtype:>3} {how:>9}: {wall:7.1f} s, peak RSS {rss / 2**20:7.0f} MiB = "
                  f"{100 * rss / f32_bytes:5.1f}% of the f32 bytes; image {image.stat().st_size / 2**20:.0f} MiB "
                  f"(median of {len(got)})")
        if not a.no_in_memory:
            same = (work / f"s-{dtype}.clb").read_bytes() == (work / f"m-{dtype}.clb").read_bytes()
            print(f"{dtype:>3} images byte-identical: {same}")
    if a.llama_cpp:
        llama_cpp(folder, work, a, f32_bytes)
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
