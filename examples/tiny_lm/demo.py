"""`make demo-lm`: the tiny King James model generating text through the Colibri C engine.

Exports model/ to an f32 token-model image (cached in build/tiny_lm), streams a greedy
continuation of a verse with `colibri generate` as a user would run it, then checks that the
engine's bytes are PyTorch's (Hugging Face generate, do_sample=False).

    .venv/bin/python examples/tiny_lm/demo.py [--prompt TEXT] [--max-new-tokens N]
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import evaluate  # noqa: E402  (puts host_tools on the path too)
import generate_torch  # noqa: E402

import colibri  # noqa: E402

PROMPT = "And the LORD spake unto Moses, saying,"


@click.command()
@click.option("--prompt", default=PROMPT, show_default=True)
@click.option("--max-new-tokens", default=160, show_default=True)
def main(prompt: str, max_new_tokens: int) -> None:
    image = evaluate.image_path("f32")
    lm = colibri.LM(image)
    click.echo(f"{image.relative_to(evaluate.ROOT)}: {image.stat().st_size:,} bytes, arena {lm.arena_size:,} bytes "
               f"(KV cache {lm.kv_cache_bytes:,} of it, {lm.max_seq_len} positions)\n")
    colibri_cli = Path(sys.executable).parent / "colibri"
    cmd = [str(colibri_cli), "generate", str(image), "--prompt", prompt, "--max-new-tokens", str(max_new_tokens)]
    click.echo("$ " + shlex.join(["colibri", *cmd[1:]]))
    subprocess.run(cmd, check=True)  # streams straight to the terminal

    engine = bytes(lm.generate(list(prompt.encode("ascii")), max_new_tokens)).decode("ascii", errors="replace")
    torch_text = generate_torch.generate(generate_torch.load(), prompt, max_new_tokens, past_newline=True)
    same = engine == torch_text
    click.echo(f"\nPyTorch's greedy continuation (generate, do_sample=False): {'identical' if same else 'DIFFERENT'}")
    if not same:
        click.echo(f"PyTorch: {torch_text!r}")
        sys.exit(1)


if __name__ == "__main__":
    main()
