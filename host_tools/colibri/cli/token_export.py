"""`colibri export` for token models: a Hugging Face folder or a GGUF file, streamed (issue 26), or a token module."""
from __future__ import annotations

import resource
import time
from pathlib import Path

import click

from ..model.errors import ColibriError


def _need_seq_len(max_seq_len: int | None, what: str) -> int:
    if max_seq_len is None:
        raise ColibriError(f"{what} is a token model: give --max-seq-len N (the KV cache's positions)")
    return max_seq_len


def refuse_feature_options(model: str, given: dict[str, object]) -> None:
    """Options of the feature-model export that a token model has no use for: refused, not ignored."""
    used = [name for name, value in given.items() if value]
    if used:
        raise ColibriError(f"{model} is a token model: {', '.join(used)} {'is' if len(used) == 1 else 'are'} for "
                           "feature models (token models take --max-seq-len, --kv-dtype, --max-batch and the "
                           "--dtype options)")


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _streamed(source: Path, export, output: Path, **options):
    """Run a streamed export with a progress bar per tensor; the result and the seconds it took."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tensors"),
                  TextColumn("{task.fields[written]}"), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task(f"exporting {source.name}", total=None, written="")
        written = 0

        def on_tensor(i: int, count: int, nbytes: int) -> None:
            nonlocal written
            written = nbytes if i == 0 else written + nbytes  # from 0 again if the image is rewritten as v7
            bar.update(task, total=count, completed=i + 1, written=f"{written / 2**20:.1f} MiB")

        result = export(source, output, on_tensor=on_tensor, **options)
    return result, time.perf_counter() - start


def _wrote(output: Path, result, seconds: float) -> None:
    from ..image import writer

    click.echo(f"wrote {output}: {result.bytes_written} bytes (format v{result.version}, {result.tensors} tensors) "
               f"in {seconds:.1f} s; peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
    if result.bytes_written > writer.NARROW_LIMIT:
        click.echo(f"format v{result.version}: the image passes 4 GiB, so it runs on 64-bit hosts only; an engine "
                   "built "
                   "for a 32-bit target refuses it (IMAGE_TOO_LARGE)")


def _echo_tokenizer(graph) -> None:
    from ..image.tokenizer_section import parse

    if graph.tokenizer is not None:
        click.echo(f"tokenizer: {parse(graph.tokenizer, graph.vocab_size).summary()}")


def export_folder_command(folder: Path, output: Path, *, max_seq_len: int | None, check: bool, **options) -> None:
    from ..checkpoints.hf_folder import export_folder

    _need_seq_len(max_seq_len, str(folder))
    result, seconds = _streamed(folder, export_folder, output, max_seq_len=max_seq_len, check=check, **options)
    _echo_tokenizer(result.graph)
    _wrote(output, result, seconds)


def export_gguf_command(file: Path, output: Path, *, max_seq_len: int | None, check: bool, dtype: str | None,
                        **options) -> None:
    """A GGUF file, streamed: `dtype=None` keeps the file's own; then what went in exactly and what
    was requantised (with its error), the bytes written and the peak RSS."""
    from ..checkpoints.gguf_file import export_gguf, missing_max_seq_len

    if max_seq_len is None:
        raise missing_max_seq_len(file)
    result, seconds = _streamed(file, export_gguf, output, max_seq_len=max_seq_len, check=check, dtype=dtype,
                                **options)
    if dtype is None:
        click.echo(f"dtype {result.dtype}: the file's own (--dtype chooses another)")
    for line in result.lines():
        click.echo(line)
    _echo_tokenizer(result.graph)
    _wrote(output, result, seconds)


def is_token_module(module: object) -> bool:
    from ..frontends.hf_lm import is_token_module as token

    return token(module)


def export_module_command(module, output: Path, *, max_seq_len: int | None, check: bool, **options) -> None:
    from ..frontends.hf_lm import export_lm
    from ..image import write_atomically

    _need_seq_len(max_seq_len, type(module).__name__)
    result = export_lm(module, None, max_seq_len=max_seq_len, check=check, **options)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(output, result.image)
    click.echo(f"numpy reference vs PyTorch on {min(max_seq_len, 32)} tokens: max |diff| {result.max_abs_error:.3g}")
    _echo_tokenizer(result.graph)
    click.echo(f"wrote {output}: {len(result.image)} bytes; peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
