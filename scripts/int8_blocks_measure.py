"""What INT8_BLOCKS (int8 activations, one scale per 32 columns) costs in accuracy and gains in speed on
token models (issue 23), each q8 / q4 image with f32 activations (the default), with per-row int8
activations (INT8_ACT), with INT8_BLOCKS on every expert and the LM head (int8-blocks-ffn) and with
INT8_BLOCKS on the attention projections too (int8-blocks: `layers.*`):

1. the trained tiny King James model (examples/tiny_lm): held-out perplexity per byte, the C engine;
2. a random-weight Hugging Face Mixtral of the 100 M class (hidden 512, 8 layers, 8 experts x 1408
   top-2, GQA 8/2, vocab 4096; weights N(0, 0.02)): logits of a 16-token prompt and 48 decode
   steps against the f32 image's (max |Δ| / max |f32 logit|, and greedy agreement), and decode
   tok/s (128 tokens after a 16-token prompt, one thread, the best of --repeats, the images
   alternating) at f32 / f16 / q8 / q4.

    .venv/bin/python scripts/int8_blocks_measure.py [--part tiny|mixtral|mixtral-speed|both] [--repeats 3]

Images are cached in build/int8_blocks/. Prints the CPU and the kernels in use.
"""
from __future__ import annotations

import math
import platform
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host_tools"))
sys.path.insert(0, str(ROOT / "examples" / "tiny_lm"))

import colibri  # noqa: E402

CACHE = ROOT / "build" / "int8_blocks"
FORMS = {"f32-act": {"int8_blocks": ()}, "int8-rows": {"int8_act": ["layers.*"]}, "int8-blocks-ffn": "ffn",
         "int8-blocks": {"int8_blocks": ["layers.*"]}}


def form_options(form: str, model) -> dict:
    """colibri.export's options for a form: int8-blocks-ffn names the experts and the head, not attention."""
    if FORMS[form] == "ffn":
        sys.path.insert(0, str(ROOT / "bench"))
        from lm_prefill import ffn_blocks

        return {"int8_blocks": ffn_blocks(model)}
    return FORMS[form]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def tiny(windows: int | None) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    import corpus
    from evaluate import held_out_nll
    from train import CONTEXT, MODEL_DIR

    torch.set_num_threads(1)
    model = Qwen3MoeForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    text = corpus.load().held_out
    CACHE.mkdir(parents=True, exist_ok=True)
    base = None
    print("tiny King James model, held-out perplexity per byte (C engine, max_batch 1):")
    for dtype in ("f32", "q8", "q4"):
        for form in FORMS:
            if dtype == "f32" and form != "f32-act":
                continue
            data = colibri.export(model, max_seq_len=CONTEXT, max_batch=1, dtype=dtype, check=False,
                                  **form_options(form, model)).image
            lm = colibri.LM(data)
            nll, scored = held_out_nll(lm, text, windows)
            ppl = math.exp(nll)
            base = ppl if base is None else base
            print(f"  {dtype:4} {form:15} perplexity {ppl:.4f}  ({100 * (ppl / base - 1):+.3f}% vs f32, "
                  f"{scored} bytes, {lm.kernels})", flush=True)


def mixtral_model():
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        sliding_window=None, attn_implementation="eager",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = MixtralForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model.eval()


def mixtral_images() -> dict[str, Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    wanted = [("f32", "f32-act"), ("f16", "f32-act")] + [(d, f) for d in ("q8", "q4") for f in FORMS]
    # "-att": int8-blocks images of before attention blocks had the attention projections in f32 activations
    paths = {f"{d} {f}": CACHE / f"mixtral100m-{d}-{f}{'-att' if f == 'int8-blocks' else ''}.clb" for d, f in wanted}
    if all(p.exists() for p in paths.values()):
        return paths
    model = mixtral_model()
    n = sum(p.numel() for p in model.parameters())
    print(f"random Mixtral: {n / 1e6:.1f} M parameters", flush=True)
    for (dtype, form), (key, path) in zip(wanted, paths.items()):
        if not path.exists():
            t0 = time.perf_counter()
            colibri.export(model, path, max_seq_len=160, max_batch=16, dtype=dtype, check=False,
                           **form_options(form, model))
            print(f"  exported {key}: {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t0:.0f} s",
                  flush=True)
    return paths


def logits_of(path: Path, ids: list[int]) -> np.ndarray:
    lm = colibri.LM(path)
    out = [lm.forward_tokens(ids[:16])]
    out += [lm.forward_tokens([t]) for t in ids[16:]]
    return np.concatenate(out)


def mixtral(repeats: int, accuracy: bool = True, speed: bool = True) -> None:
    paths = mixtral_images()
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(0, 4096, 64)]
    if accuracy:
        mixtral_accuracy(paths, ids)
    if speed:
        mixtral_speed(paths, ids, repeats)


def mixtral_accuracy(paths: dict[str, Path], ids: list[int]) -> None:
    want = logits_of(paths["f32 f32-act"], ids)
    scale = float(np.abs(want).max())
    print(f"random Mixtral, logits against the f32 image over {len(ids)} positions (max |f32 logit| {scale:.3g}):")
    greedy = want.argmax(axis=1)
    for key, path in paths.items():
        if key.startswith("f32"):
            continue
        got = logits_of(path, ids)
        err = np.abs(got - want)
        print(f"  {key:16} max|Δ|/max|l| {err.max() / scale:.2e}  mean|Δ|/max|l| {err.mean() / scale:.2e}  "
              f"argmax agreement {int((got.argmax(axis=1) == greedy).sum())}/{len(ids)}", flush=True)



def mixtral_speed(paths: dict[str, Path], ids: list[int], repeats: int) -> None:
    prompt, new = ids[:16], 128
    best = {k: math.inf for k in paths}
    lms = {k: colibri.LM(p) for k, p in paths.items()}
    for _ in range(repeats):
        for key, lm in lms.items():  # alternating, so load drifts hit every image alike
            lm.reset()
            t0 = time.perf_counter()
            lm.generate(prompt, new)
            best[key] = min(best[key], time.perf_counter() - t0)
    kernels = next(iter(lms.values())).kernels
    print(f"random Mixtral decode, 128 tokens after a 16-token prompt (prefill included), one thread, best of "
          f"{repeats} ({kernels}):")
    for key, path in paths.items():
        mb = path.stat().st_size / 1e6
        print(f"  {key:16} {new / best[key]:7.1f} tok/s  image {mb:6.1f} MB", flush=True)


@click.command()
@click.option("--part", type=click.Choice(["tiny", "mixtral", "mixtral-speed", "both"]), default="both")
@click.option("--windows", type=int, default=None, help="tiny model: score only the first N windows")
@click.option("--repeats", type=int, default=3)
def main(part: str, windows: int | None, repeats: int) -> None:
    print(f"CPU: {cpu_name()}")
    if part in ("tiny", "both"):
        tiny(windows)
    if part in ("mixtral", "both"):
        mixtral(repeats)
    if part == "mixtral-speed":
        mixtral(repeats, accuracy=False)


if __name__ == "__main__":
    main()
