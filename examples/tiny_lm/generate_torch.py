"""Greedy continuation of a prompt by the committed tiny model, in PyTorch (Hugging Face generate).

The reference the Colibri engine's generation is compared with: same weights, bytes in,
bytes out, argmax at every step.

    .venv/bin/python examples/tiny_lm/generate_torch.py "And God said" [--max-new-bytes 200] [--past-newline]
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
import torch
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import CONTEXT, MODEL_DIR  # noqa: E402

NEWLINE = 10  # the byte that ends a verse, and the model's eos_token_id


def load(model_dir: Path = MODEL_DIR) -> Qwen3MoeForCausalLM:
    if not (model_dir / "model.safetensors").exists():
        raise FileNotFoundError(f"no trained model in {model_dir}: run `make train-tiny-lm` to make one")
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def generate(model: Qwen3MoeForCausalLM, prompt: str, max_new_bytes: int = 200, past_newline: bool = False) -> str:
    """The prompt's greedy continuation (the new text only). Stops at the end of the verse
    (a newline) unless `past_newline`, or after `max_new_bytes`."""
    ids = list(prompt.encode("ascii"))
    if not ids:
        raise ValueError("the prompt is empty: the model needs at least one byte to continue")
    limit = model.config.max_position_embeddings
    if len(ids) + max_new_bytes > limit:
        raise ValueError(
            f"prompt ({len(ids)} bytes) + max_new_bytes ({max_new_bytes}) exceeds the model's "
            f"{limit}-byte context"
        )
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_bytes,
        do_sample=False,
        eos_token_id=None if past_newline else NEWLINE,
        pad_token_id=NEWLINE,  # one prompt, no padding: named only so generate does not warn
    )
    new = out[0, len(ids):].tolist()
    return bytes(new).decode("ascii", errors="replace")


@click.command()
@click.argument("prompt")
@click.option("--max-new-bytes", default=120, show_default=True)
@click.option("--past-newline", is_flag=True, help="keep going past the end of the verse")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path), default=MODEL_DIR, show_default=True)
def main(prompt: str, max_new_bytes: int, past_newline: bool, model_dir: Path) -> None:
    if max_new_bytes + len(prompt) > CONTEXT:
        raise click.BadParameter(f"prompt + new bytes must fit the {CONTEXT}-byte context", param_hint="--max-new-bytes")
    print(prompt + generate(load(model_dir), prompt, max_new_bytes, past_newline))


if __name__ == "__main__":
    main()
