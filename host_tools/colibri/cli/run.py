"""`colibri run` (a feature model on inputs) and `colibri generate` (a token model on a prompt)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import click
import numpy as np

from ..model.errors import ColibriError
from .app import load_inputs, main


@main.command()
@click.argument("image_path", metavar="IMAGE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--input", "-i", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Inputs [batch, input_size] as .npy or .csv.")
@click.option("--output", "-o", "output_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write outputs to this .npy or .csv file (default: print CSV to stdout).")
@click.option("--reference", is_flag=True, help="Use the numpy reference instead of the C engine.")
def run(image_path: Path, input_path: Path, output_path: Path | None, reference: bool) -> None:
    """Run a model image on inputs."""
    from ..image import read as read_image
    from ..reference import executor as ref
    from ..runtime import engine

    kind = output_path.suffix.lower() if output_path is not None else None
    if kind not in (None, ".npy", ".csv"):
        raise ColibriError(f"{output_path}: outputs are written as .npy or .csv, "
                           f"not {output_path.suffix or 'a name without extension'}")
    x = load_inputs(input_path)
    # The C engine maps the file (the POSIX layer, as libcolibri): no copy of the weights.
    y = np.atleast_2d(ref.run(read_image(image_path.read_bytes()), x) if reference else engine.Model(image_path).forward(x))
    if output_path is None:
        np.savetxt(sys.stdout, y, delimiter=",", fmt="%.8g")
        return
    output_path.parent.mkdir(parents=True, exist_ok=True)
    if kind == ".npy":
        with open(output_path, "wb") as fh:  # np.save(path) would append .npy to any other name
            np.save(fh, y)
    else:
        np.savetxt(output_path, y, delimiter=",", fmt="%.8g")
    click.echo(f"wrote {output_path}: {y.shape[0]} x {y.shape[1]}", err=True)


@main.command()
@click.argument("image_path", metavar="MODEL", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--prompt", "-p", required=True, help="The text the continuation follows.")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate (prompt + new tokens - 1 must fit the model's max_seq_len).")
@click.option("--temperature", "-t", default=0.0, show_default=True, type=float,
              help="0 is greedy (the most likely token); above 0 samples from softmax(logits / T).")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
              help="Sample among the k most likely tokens only (0: all).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="Sample among the most likely tokens whose probabilities sum to p (1: all).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seeds the sampler's SplitMix64: one seed, one continuation.")
@click.option("--tokenizer", "tokenizer_spec", default=None, metavar="byte|PATH.json|PATH.model",
              help="Default: the image's own tokenizer (format v6), else 'byte'. 'byte' (a UTF-8 byte per token, "
                   "ids 0..255), a Hugging Face tokenizers JSON file or a SentencePiece .model file.")
@click.option("--stop-id", type=click.IntRange(min=0), default=None,
              help="End once this token id is generated (e.g. 10, newline, for a byte-level model). With the "
                   "image's tokenizer, generation also ends at its end-of-sequence token.")
@click.option("--echo/--no-echo", default=True, show_default=True, help="Print the prompt before the continuation.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1, max=256),
              help="Threads each forward pass runs on (colibri.LM(workers=N)): the same tokens as one.")
@click.option("--verify", type=click.Choice(("on_use", "full", "none")), default="on_use", show_default=True,
              help="When payloads are checked against their CRCs: on_use (the tables and the tensors every token "
                   "reads at open, each expert when routing first picks it), full (every byte at open), none.")
@click.option("--chat", is_flag=True,
              help="Treat the prompt as a user's message: render the model's chat template around it (with the "
                   "generation prompt) and encode its special tokens as theirs. The image holds no template: "
                   "--chat-template names where it is.")
@click.option("--chat-template", "chat_template", type=click.Path(exists=True, path_type=Path), default=None,
              metavar="DIR|FILE.gguf|FILE",
              help="Where --chat reads the chat template (implies --chat): the Hugging Face folder the image was "
                   "exported from (chat_template.jinja or tokenizer_config.json), the GGUF file "
                   "(tokenizer.chat_template), a tokenizer_config.json or a Jinja template file.")
@click.option("--lock", "lock_all", is_flag=True,
              help="mlock the whole file (pinned pages never fault); if RLIMIT_MEMLOCK refuses, say so and go on "
                   "unpinned.")
def generate(image_path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int, tokenizer_spec: str, stop_id: int | None, echo: bool, threads: int, verify: str,
             chat: bool, chat_template: Path | None, lock_all: bool) -> None:
    """Continue a text prompt with a token model, streaming tokens as the C engine makes them.

    The prompt is tokenized, run through the model (its KV cache holds max_seq_len positions), and
    each new token is printed as soon as it is drawn; a character that spans several tokens is
    printed once whole. The tokens are those colibri.LM(MODEL).generate returns.
    """
    from ..runtime import engine
    from ..runtime import tokenizer as tok

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the refusal is printed below, once
        lm = engine.LM(image_path, workers=threads, verify=verify, lock="all" if lock_all else None,
                       lock_required=False)
    if lm.lock_error is not None:
        click.echo(f"colibri generate: {lm.lock_error}; going on unpinned", err=True)
    own = tokenizer_spec is None and lm.has_tokenizer
    chat = chat or chat_template is not None
    if chat:
        from ..checkpoints import chat_template as chats

        if not own:
            raise ColibriError("--chat needs the image's own tokenizer (a section; export with it, and give no "
                               "--tokenizer): the template's special tokens are that tokenizer's")
        if chat_template is None:
            raise ColibriError(f"{image_path}: --chat needs --chat-template DIR|FILE.gguf|FILE: an image holds no "
                               "chat template (its tokenizer section has no field for one), so it is read from "
                               "the folder or GGUF file the image was exported from")
        prompt = chats.render(chats.load_template(chat_template), prompt, lm.tokenizer.section)
        ids = chats.encode(prompt, lm.tokenizer)
    elif own:  # the image's tokenizer: encoded on the host by its library, decoded by the C engine
        ids = lm.encode(prompt)
    else:
        tokenizer_spec = tokenizer_spec or "byte"
        tokenizer = tok.load(tokenizer_spec)
        # A file's tokenizer must fit the model; the byte tokenizer is a convention of ids 0..255, whose
        # prompt ids are checked one by one below (small byte-level test models use a part of it).
        if tokenizer_spec != "byte" and tokenizer.vocab_size > lm.vocab_size:
            raise ValueError(f"--tokenizer {tokenizer_spec} has {tokenizer.vocab_size} tokens but the model's vocabulary "
                             f"is {lm.vocab_size}: it cannot be this model's tokenizer")
        ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty once tokenized: give some text")
    if max(ids) >= lm.vocab_size:
        raise ValueError(f"the prompt holds token id {max(ids)} but the model's vocabulary is 0..{lm.vocab_size - 1}: "
                         f"is --tokenizer {tokenizer_spec} the one the model was trained with?")
    if stop_id is not None and stop_id >= lm.vocab_size:
        raise ValueError(f"--stop-id {stop_id} is outside the model's vocabulary 0..{lm.vocab_size - 1}")
    stops = {s for s in (stop_id, lm.eos if own else None) if s is not None}
    # Every check (sampler settings, room in the cache) is made before anything is printed.
    tokens = lm.stream(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       stop=None)
    # click.echo flushes after every write: each piece reaches a pipe or terminal as it is made.
    if echo:
        click.echo(prompt, nl=False)
    decoder = lm.text_stream() if own else tok.StreamDecoder(tokenizer)
    for token in tokens:
        piece = decoder.push(token)
        if piece:
            click.echo(piece, nl=False)
        if token in stops:
            break
    click.echo(decoder.flush())
