"""Trains the tiny byte-level MoE language model on the King James Bible.

A Hugging Face `Qwen3MoeForCausalLM` (the architecture Colibri's HF exporter converts) small
enough for a microcontroller: 256 byte tokens, 3 layers of grouped-query attention with
Qwen3's q/k RMSNorm, the first layer a dense SwiGLU MLP and the other two 8-expert top-2
MoE blocks, embeddings tied to the output head. It trains on the Bible minus its last two
books and is measured on those (corpus.py).

    .venv/bin/python examples/tiny_lm/train.py [--steps 1500] [--seed 0] [--out examples/tiny_lm/model]

writes the model with save_pretrained plus metrics.json: held-out perplexity per byte, bits
per byte, parameter count, training time and the command that made it.
"""
from __future__ import annotations

import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import click
import torch
from tqdm import tqdm
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"
METRICS = "metrics.json"
# The part of the held-out text tests/lm/test_lm_tiny.py re-scores (a few seconds, not the whole):
# its first 64 windows.
TEST_SLICE_BYTES = 64 * 256

CONTEXT = 256  # bytes a training window holds, and the longest context the model is used with
BATCH = 16
PEAK_LR = 3e-3
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.05


def config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=256,  # one token per byte: no tokenizer to ship to the device
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        # The dense layer: the first, where a byte model spends its effort spelling words.
        mlp_only_layers=[0],
        intermediate_size=192,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        # Load balancing keeps every expert trained, so none is dead weight in flash.
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_cache=True,
        # Byte 10 (newline) ends a verse; generation stops there unless asked for more.
        bos_token_id=None,
        eos_token_id=10,
        pad_token_id=None,
    )


def n_parameters(model: torch.nn.Module) -> int:
    # Tied embeddings are one tensor: parameters() yields it once.
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def held_out_nll(model: Qwen3MoeForCausalLM, text: bytes, context: int = CONTEXT) -> tuple[float, int]:
    """Mean negative log-likelihood (nats per byte) of `text` and the count of bytes scored.

    The text is cut into consecutive windows of `context` bytes, each scored on its own
    from an empty context: every byte but a window's first is predicted once, so the figure
    is a fixed function of the weights and the text, with no sampling in it.
    """
    model.eval()
    ids = torch.tensor(list(text), dtype=torch.long)
    n_windows = len(ids) // context
    windows = ids[: n_windows * context].view(n_windows, context)
    total, count = 0.0, 0
    for start in range(0, n_windows, 16):
        batch = windows[start : start + 16]
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return total / count, count


def metrics_of(nll: float, count: int) -> dict:
    return {
        "held_out_bytes_scored": count,
        "held_out_nll_nats_per_byte": round(nll, 6),
        "held_out_perplexity_per_byte": round(math.exp(nll), 4),
        "held_out_bits_per_byte": round(nll / math.log(2), 4),
    }


def lr_at(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(steps: int, seed: int, threads: int, progress: bool = True) -> tuple[Qwen3MoeForCausalLM, float]:
    """The trained model and the seconds training took."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    data = corpus.load()
    train_ids = torch.tensor(list(data.train), dtype=torch.long)
    model = Qwen3MoeForCausalLM(config())
    model.train()
    # Matrices decay; norm gains do not (decaying them would pull them towards zero, not one).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR, betas=(0.9, 0.95),
    )
    # Windows drawn from their own generator, so the data order depends on the seed alone.
    sampler = torch.Generator().manual_seed(seed)
    offsets = torch.arange(CONTEXT)
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="training", unit="step", disable=not progress)
    for step in bar:
        starts = torch.randint(0, len(train_ids) - CONTEXT, (BATCH,), generator=sampler)
        batch = train_ids[starts[:, None] + offsets]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        out = model(input_ids=batch, labels=batch)  # shifts labels itself; adds the router's aux loss
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            lm_loss = out.loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item()
            bar.set_postfix(loss=f"{out.loss.item():.3f}", bpb=f"{lm_loss / math.log(2):.2f}")
    return model, time.perf_counter() - t0


def held_out_metrics(model: Qwen3MoeForCausalLM) -> dict:
    """The figures metrics.json records: the whole held-out text, and the slice the test re-scores."""
    held_out = corpus.load().held_out
    return {
        **metrics_of(*held_out_nll(model, held_out)),
        "held_out_books": list(corpus.HELD_OUT_BOOKS),
        "test_slice": metrics_of(*held_out_nll(model, held_out[:TEST_SLICE_BYTES])),
        "parameters": n_parameters(model),
    }


@click.command()
@click.option("--steps", default=1500, show_default=True, help=f"optimiser steps of {BATCH} windows of {CONTEXT} bytes")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch CPU threads")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=MODEL_DIR, show_default=True)
@click.option("--rescore", is_flag=True,
              help="do not train: re-measure the held-out figures of the model in --out, keeping its training record")
def main(steps: int, seed: int, threads: int, out: Path, rescore: bool) -> None:
    torch.set_num_threads(threads)
    if rescore:
        from transformers import AutoModelForCausalLM

        record = json.loads((out / METRICS).read_text())
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        metrics = {**record, **held_out_metrics(model)}
    else:
        model, seconds = train(steps, seed, threads)
        metrics = {
            **held_out_metrics(model),
            "steps": steps,
            "seed": seed,
            "threads": threads,
            "training_seconds": round(seconds, 1),
            "trained_on": f"{platform.machine()}, torch {torch.__version__}",
            "command": "python examples/tiny_lm/train.py " + shlex.join(sys.argv[1:]),
        }
        out.mkdir(parents=True, exist_ok=True)
        # The router logits are a training-time output (for the balancing loss); inference and
        # the exporters need only the logits.
        model.config.output_router_logits = False
        model.save_pretrained(out)
    (out / METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
