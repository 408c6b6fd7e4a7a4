"""`colibri export`: a PyTorch module (a torch.save'd file or package.module:factory) to a model image.
The only command that imports torch."""
from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import click

from ..model import format as F
from ..model.errors import ColibriError, UserCodeError
from .app import DEBUG_ENV, int8_blocks_choice, load_inputs, main, one_line, quant_options


def _on_path_like_python_m() -> None:
    """The current folder first on sys.path, as `python -m` has it, so `pkg.mod:build` and the
    classes a torch.save'd module refers to resolve from where the command runs."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def _load_saved(path: Path):
    """A module saved with torch.save(model, path), or ColibriError saying what the file is instead."""
    import pickle
    import zipfile

    import torch

    if path.is_dir():
        raise ColibriError(f"{path} is a folder, not a torch.save'd module")
    with open(path, "rb") as fh:
        head = fh.read(8)
    if not head:
        raise ColibriError(f"{path} is empty, not a torch.save'd module")
    if head[:4] == F.MAGIC.to_bytes(4, "little"):
        raise ColibriError(f"{path} is a Colibri model image already (`colibri info` shows it); export takes a "
                           "PyTorch module: a torch.save'd file or package.module:factory")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
        if any(n.endswith(("/archive_format", "/serialized_exported_program.json")) for n in names):
            raise ColibriError(f"{path} is a torch.export program (.pt2), which Colibri does not read: save the "
                               "nn.Module itself (torch.save(model, 'model.pt')) or give package.module:factory")
        if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            raise ColibriError(f"{path} is a zip archive, but not one torch.save writes")
    elif head[0] != 0x80:  # a pickle of protocol 2 or later starts so, as torch.save's legacy format does
        raise ColibriError(f"{path} is not a file torch.save writes (neither its zip archive nor a pickle)")
    try:
        return torch.load(path, weights_only=False, map_location="cpu")
    except AttributeError as exc:
        text = str(exc)
        found = re.search(r"attribute '([^']+)' on <module '__main__'", text)
        if found:
            cls = found.group(1)
            raise ColibriError(f"{path} holds a {cls} defined in the __main__ script that saved it, which cannot "
                               f"be imported here: move class {cls} into a module (a .py file next to the script) "
                               "and save again, or give module:factory") from exc
        raise ColibriError(f"{path}: a class it refers to is no longer where it was saved from: {text}") from exc
    except ModuleNotFoundError as exc:
        raise ColibriError(f"{path} needs the module {exc.name!r}, which is not importable here (the current "
                           "folder and PYTHONPATH are searched)") from exc
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        raise ColibriError(f"{path}: torch.load cannot read it: {one_line(exc)}") from exc


def _load_factory(spec: str):
    """`package.module:factory`: the module imported (the current folder first on the path) and the
    factory called with no arguments; or a torch.nn.Module object named there."""
    import inspect

    import torch

    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ColibriError(f"{spec}: expected package.module:factory")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise ColibriError(f"{spec}: no module named {mod_name!r} in the current folder "
                               "or on PYTHONPATH") from exc
        raise UserCodeError(f"{spec}: importing {mod_name} failed: {one_line(exc)}") from exc
    except Exception as exc:
        raise UserCodeError(f"{spec}: importing {mod_name} failed: {type(exc).__name__}: {one_line(exc)} "
                            f"({DEBUG_ENV}=1 shows the traceback)") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ColibriError(f"{spec}: module {mod_name} ({module.__file__}) has no {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, torch.nn.Module):
        return obj
    if not callable(obj):
        raise ColibriError(f"{spec} is a {type(obj).__name__}, neither a torch.nn.Module nor a factory")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        signature = None  # a builtin without one: just call it
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            raise ColibriError(f"{spec} needs arguments {signature}: name a factory that takes none, e.g. "
                               f"def build(): return {attr}(...)") from None
    try:
        return obj()
    except Exception as exc:
        raise UserCodeError(f"{spec}() raised {type(exc).__name__}: {one_line(exc)} "
                            f"({DEBUG_ENV}=1 shows the traceback)") from exc


def _load_module(spec: str):
    """A torch.save'd module file, or `package.module:factory` (called with no arguments)."""
    import torch

    _on_path_like_python_m()
    path = Path(spec)
    if path.exists():
        model = _load_saved(path)
    elif ":" in spec:
        model = _load_factory(spec)
    else:
        raise ColibriError(f"{spec}: no such file, and not a package.module:factory path")
    if not isinstance(model, torch.nn.Module):
        what = " (a state_dict? save the module itself: torch.save(model, path))" if isinstance(model, dict) else ""
        raise ColibriError(f"{spec} holds a {type(model).__module__}.{type(model).__qualname__} object, "
                           f"not a torch.nn.Module{what}")
    return model


def _parse_prune(text: str | None) -> dict[int, list[int]] | None:
    """'1,3' (the only MoE layer) or '0:1,3;2:0' (per MoE layer)."""
    if not text:
        return None
    out: dict[int, list[int]] = {}
    for part in text.split(";"):
        layer, _, experts = part.rpartition(":")
        out[int(layer or 0)] = [int(e) for e in experts.split(",") if e.strip()]
    return out


@main.command()
@click.argument("model")
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokens per forward the arena is sized for.")
@click.option("--input-size", type=click.IntRange(min=1), help="Features in, when the first layer does not say.")
@click.option("--prune", help="Experts to drop: '1,3' or per MoE layer '0:1,3;1:2'.")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Inputs (.npy/.csv): experts no calibration token selects are dropped.")
@click.option("--page-aligned/--compact", default=None,
              help="--page-aligned puts each expert's tensors on 4 KiB pages of their own (one madvise/mlock range), "
                   "with one CRC per tensor (format v3+): a model file mapped on Linux then opens without reading "
                   "its weights. --compact packs them (a microcontroller slot). Default: page-aligned when the model "
                   "has experts and its compact image would be at least 16 MiB, else compact.")
@click.option("--no-check", is_flag=True,
              help="With --input-size: write the image even if it does not match PyTorch on a random batch; "
                   "for a token model, even if its logits do not; for a folder, skip validating the written file.")
@click.option("--max-seq-len", type=click.IntRange(min=1),
              help="Token models (a Hugging Face folder, an HF MoE causal LM, colibri.nn.MoETransformer): "
                   "the KV cache's positions. Required for them.")
@click.option("--kv-dtype", type=click.Choice(("f32", "f16")), default="f32", show_default=True,
              help="Token models: the KV cache's storage.")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="Token models: carry this tokenizer (a folder, tokenizer.json or tokenizer.model) in the image "
                   "(format v6). A Hugging Face folder's own tokenizer, or a GGUF file's tokenizer metadata "
                   "(llama: SentencePiece, gpt2: byte-level BPE), is carried without it.")
@click.option("--no-tokenizer", is_flag=True,
              help="Token models: leave the folder's or GGUF file's tokenizer out of the image.")
@quant_options
def export(model: str, output: Path, max_batch: int, input_size: int | None, prune: str | None,
           calibration: Path | None, page_aligned: bool | None, no_check: bool, max_seq_len: int | None, kv_dtype: str,
           tokenizer_path: Path | None, no_tokenizer: bool,
           dtype: str, compensation: float, group: int, q8: tuple[str, ...], keep: tuple[str, ...],
           int8_act: tuple[str, ...], int8_blocks: tuple[str, ...]) -> None:
    """Export MODEL (a Hugging Face folder, a GGUF file, a torch.save'd module or package.module:factory) to a
    model image.

    A Hugging Face folder (config.json and safetensors shards; Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE) is streamed without torch: one tensor read, quantised and written at a time, with a
    progress bar, then the peak RSS and the bytes written. It needs --max-seq-len.

    A GGUF file (llama.cpp's llama with experts, qwen2moe, qwen3moe, olmoe; F32, F16, BF16, Q8_0,
    Q4_0 tensors) is streamed the same way. Without --dtype it keeps the file's own (Q4_0: q4,
    Q8_0: q8, F16: f16, else f32); Q4_0 goes into q4 (--group 32 or less) bit for bit, and what
    is requantised is reported with its error.

    MODEL is a file written by torch.save(model, path), or package.module:factory, a function
    called with no arguments that returns the module. As with `python -m`, the current folder
    comes first on the module search path (then PYTHONPATH): `colibri export mymodel:build m.clb`
    finds ./mymodel.py. The output folder is made if missing; nothing is written on failure.
    """
    from . import token_export

    blocks = int8_blocks_choice(int8_blocks)
    token_options = dict(max_seq_len=max_seq_len, max_batch=max_batch, kv_dtype=kv_dtype, dtype=dtype,
                         compensation=compensation, group=group, q8=q8, keep=keep, int8_act=int8_act,
                         int8_blocks=blocks, page_aligned=page_aligned,
                         check=not no_check)
    feature_only = {"--input-size": input_size, "--prune": prune, "--calibration": calibration}
    if tokenizer_path is not None and no_tokenizer:
        raise ColibriError("--tokenizer and --no-tokenizer contradict each other: give one")
    if Path(model).is_dir():  # a Hugging Face folder: streamed, no torch
        token_export.refuse_feature_options(model, feature_only)
        token_export.export_folder_command(Path(model), output, **token_options,
                                           tokenizer=False if no_tokenizer else tokenizer_path or True)
        return
    from ..checkpoints.gguf_file import is_gguf

    if is_gguf(model):  # a GGUF file: streamed, no torch; without --dtype the file's own
        token_export.refuse_feature_options(model, feature_only)
        source = click.get_current_context().get_parameter_source("dtype")
        if source is click.core.ParameterSource.DEFAULT:
            token_options["dtype"] = None
        token_export.export_gguf_command(Path(model), output, **token_options,
                                         tokenizer=False if no_tokenizer else tokenizer_path or True)
        return
    # The front ends first: without torch they raise the error that names the extra to install.
    from ..frontends import hf  # noqa: F401  registers the Hugging Face converters
    from ..frontends.exporter import build_graph

    import torch
    from ..frontends.exporter import export as do_export
    from ..image import write_atomically

    module = _load_module(model)
    if token_export.is_token_module(module):
        token_export.refuse_feature_options(model, feature_only)
        token_export.export_module_command(module, output, **token_options, tokenizer=tokenizer_path)
        return
    if tokenizer_path is not None:
        raise ColibriError(f"{model} is a feature model: --tokenizer is for token models")
    example = torch.randn(max_batch, input_size) if input_size else None
    calib = None
    if calibration is not None:
        width = build_graph(module, max_batch=max_batch, example_input=example)[0].input_size
        calib = load_inputs(calibration, width, calibration=True)
    result = do_export(module, None, max_batch=max_batch, example_input=example, prune=_parse_prune(prune),
                       calibration=calib, page_aligned=page_aligned, dtype=dtype, compensation=compensation,
                       keep=keep, int8_act=int8_act, int8_blocks=blocks or (), check=not no_check, group=group,
                       q8=q8)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(output, result.image)
    for line in result.pruned.lines():
        click.echo(f"pruned: {line}")
    if result.max_abs_error is not None:
        click.echo(f"numpy reference vs PyTorch on a random batch: max |diff| {result.max_abs_error:.3g}")
    g = result.graph
    click.echo(f"wrote {output}: {len(result.image)} bytes, {len(g.layers)} layers, "
               f"{sum(len(m.experts) for m in g.moe_layers())} routed experts")
