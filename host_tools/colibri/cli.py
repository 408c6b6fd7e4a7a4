"""The `colibri` command."""
from __future__ import annotations

import importlib
import json
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import click
import numpy as np

from . import format as F
from .errors import ColibriError, UserCodeError, error_for

DEBUG_ENV = "COLIBRI_DEBUG"  # set (to anything but 0): errors re-raised with their traceback
# Failures a user causes and can fix from the message alone; anything else is reported as unexpected.
EXPECTED = (ColibriError, OSError, ValueError, ImportError, subprocess.SubprocessError)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _one_line(text: object) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _fail(message: str, status: int = 1) -> NoReturn:
    click.echo(f"colibri: {message}", err=True)
    sys.exit(status)


class _HelpGroup(click.Group):
    """Lists each command with its whole first sentence (click cuts them at ~45 characters)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class _Main(_HelpGroup):
    """Every failure is one line on stderr and exit status 1: usage errors, expected failures
    (ColibriError, OSError, ...) and unexpected ones (pointing at COLIBRI_DEBUG=1, which re-raises
    for the traceback). Ctrl-C ends with one line and status 130."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:  # Ctrl-C or end of input inside click's own parsing
            _fail("interrupted", 130)
        except click.exceptions.NoArgsIsHelpError as exc:  # `colibri` or `colibri natmod` alone: show the help
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if isinstance(exc, click.UsageError) and ctx else ""
            _fail(f"error: {' '.join(exc.format_message().split())}{hint}")  # click's lists span lines
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except BrokenPipeError:
            raise  # output piped into e.g. `head`: click ends quietly
        except Exception as exc:
            if _debug():
                raise
            if isinstance(exc, EXPECTED):
                _fail(f"error: {_one_line(exc) or type(exc).__name__}")
            _fail(f"error: unexpected {type(exc).__name__}: {_one_line(exc)} "
                  f"(run with {DEBUG_ENV}=1 for the traceback)")


@click.group(cls=_Main)
@click.version_option(package_name="colibri-moe")
def main() -> None:
    """Colibri: Mixture-of-Experts models on microcontrollers.

    Every error is one line on stderr and exit status 1 (COLIBRI_DEBUG=1 shows its traceback).
    """


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
        raise ColibriError(f"{path}: torch.load cannot read it: {_one_line(exc)}") from exc


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
        raise UserCodeError(f"{spec}: importing {mod_name} failed: {_one_line(exc)}") from exc
    except Exception as exc:
        raise UserCodeError(f"{spec}: importing {mod_name} failed: {type(exc).__name__}: {_one_line(exc)} "
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
        raise UserCodeError(f"{spec}() raised {type(exc).__name__}: {_one_line(exc)} "
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


def _load_inputs(path: Path, width: int | None = None, *, calibration: bool = False) -> np.ndarray:
    """Inputs [tokens, features] from .npy or .csv; `width`: the features the model takes. Calibration
    inputs may also be [batch, sequence, features], as a Hugging Face block takes them."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            x = np.load(path)
        except (ValueError, EOFError) as exc:  # not an .npy file, or one holding Python objects
            raise ColibriError(f"{path}: not a numpy .npy array file ({_one_line(exc)})") from None
    elif suffix in (".csv", ".txt"):
        try:
            x = np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2)
        except ValueError as exc:
            raise ColibriError(f"{path}: not rows of comma-separated numbers ({_one_line(exc)})") from None
    else:
        raise ColibriError(f"{path}: inputs must be .npy or .csv")
    if calibration and x.ndim > 2:
        x = x.reshape(-1, x.shape[-1])
    if x.ndim != 2:
        raise ColibriError(f"{path}: inputs must be [tokens, features], not an array of shape {x.shape}")
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise ColibriError(f"{path}: inputs must be real numbers, not {x.dtype}")
    if width is not None and x.shape[1] != width:
        raise ColibriError(f"{path}: {x.shape[1]} features per token, the model takes {width}")
    if x.shape[0] == 0:
        raise ColibriError(f"{path}: no tokens")
    return np.asarray(x, dtype=np.float32)


def _quant_options(fn=None, *, dtype_required: bool = False):
    """--dtype (export: f32 by default; quantize: no default, as f32 would only copy the image) and the
    options that tune it."""
    if fn is None:
        return lambda f: _quant_options(f, dtype_required=dtype_required)
    from .quantize import DEFAULT_COMPENSATION, DTYPES, Q4_DEFAULT_GROUP

    kinds = ("f16, q8 (int8 per output channel + sparse f16 compensation), or q4 (int4 in groups of --group "
             "columns with f16 scales + the same compensation; routers stay f32, embedding tables q8)")
    dtype = (click.option("--dtype", type=click.Choice(DTYPES),
                          help=f"Weight storage: {kinds}; required unless --target chooses per weight.")
             if dtype_required else
             click.option("--dtype", type=click.Choice(DTYPES), default="f32", show_default=True,
                          help=f"Weight storage: f32, {kinds}."))
    options = [
        dtype,
        click.option("--compensation", type=float, default=DEFAULT_COMPENSATION, show_default=True,
                     help="q8, q4: share of each tensor's weights kept exactly in the f16 term E (0 turns E off)."),
        click.option("--group", type=int, default=Q4_DEFAULT_GROUP, show_default=True,
                     help="q4: columns per f16 scale, a power of two from 8 to 256."),
        click.option("--q8", "q8", multiple=True, metavar="PATTERN",
                     help="q4: store matching weights as q8 instead, e.g. 'layers.0' (repeatable)."),
        click.option("--keep", multiple=True, metavar="PATTERN",
                     help="Leave matching weights in f32, e.g. '*.router' or 'layers.0' (repeatable)."),
        click.option("--int8-act", multiple=True, metavar="PATTERN",
                     help="Run matching layers/experts with int8 activations, e.g. 'layers.*' (repeatable)."),
        click.option("--int8-blocks", multiple=True, metavar="PATTERN",
                     help="Run matching layers/experts with int8 activations in blocks of 32 columns, each with its "
                          "own scale (INT8_BLOCKS; not with --int8-act on the same layer), e.g. 'layers.*.experts.*'."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command()
@click.argument("model")
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokens per forward the arena is sized for.")
@click.option("--input-size", type=click.IntRange(min=1), help="Features in, when the first layer does not say.")
@click.option("--prune", help="Experts to drop: '1,3' or per MoE layer '0:1,3;1:2'.")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Inputs (.npy/.csv): experts no calibration token selects are dropped.")
@click.option("--page-aligned", is_flag=True,
              help="Put each expert's tensors on 4 KiB pages of their own (one madvise/mlock range), with one CRC per "
                   "tensor (format v3): for model files mapped on Linux.")
@click.option("--no-check", is_flag=True,
              help="With --input-size: write the image even if it does not match PyTorch on a random batch.")
@_quant_options
def export(model: str, output: Path, max_batch: int, input_size: int | None, prune: str | None,
           calibration: Path | None, page_aligned: bool, no_check: bool, dtype: str, compensation: float,
           group: int, q8: tuple[str, ...], keep: tuple[str, ...], int8_act: tuple[str, ...],
           int8_blocks: tuple[str, ...]) -> None:
    """Export MODEL (a torch.save'd module or package.module:factory) to a model image.

    MODEL is a file written by torch.save(model, path), or package.module:factory, a function
    called with no arguments that returns the module. As with `python -m`, the current folder
    comes first on the module search path (then PYTHONPATH): `colibri export mymodel:build m.clb`
    finds ./mymodel.py. The output folder is made if missing; nothing is written on failure.
    """
    import torch

    from . import hf  # noqa: F401  registers the Hugging Face converters
    from .exporter import build_graph
    from .exporter import export as do_export, write_atomically

    module = _load_module(model)
    example = torch.randn(max_batch, input_size) if input_size else None
    calib = None
    if calibration is not None:
        width = build_graph(module, max_batch=max_batch, example_input=example)[0].input_size
        calib = _load_inputs(calibration, width, calibration=True)
    result = do_export(module, None, max_batch=max_batch, example_input=example, prune=_parse_prune(prune),
                       calibration=calib, page_aligned=page_aligned, dtype=dtype, compensation=compensation,
                       keep=keep, int8_act=int8_act, int8_blocks=int8_blocks, check=not no_check, group=group,
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


def _storage(weights: list) -> str:
    """Weight storage of a layer: f32, f16, q8 (+E), q4/g<group> (+E), or a mix."""
    from .ir import F16Weight, Q4Weight, Q8Weight

    kinds = set()
    for w in weights:
        if isinstance(w, Q4Weight):
            kinds.add(f"q4/g{w.group}" + ("+E" if w.nnz else ""))
        elif isinstance(w, Q8Weight):
            kinds.add("q8+E" if w.nnz else "q8")
        elif isinstance(w, F16Weight):
            kinds.add("f16")
        else:
            kinds.add("f32")
    return "/".join(sorted(kinds))


def describe(data: bytes | memoryview | mmap.mmap) -> dict:
    """Everything `colibri info` shows, as plain data. Checks the image's structure only (as
    COLIBRI_CHECK_STRUCTURE: header, metadata CRC, tables, offsets, int8 companions), not the
    payload CRCs of a version-3 image: it reads no weight (`colibri verify` reads them all)."""
    from . import engine, image
    from .format import DType
    from .ir import Activation, Attention, Embedding, LayerNorm, Linear, MoE, RMSNorm

    def numel(*tensors) -> int:
        return sum(int(np.prod(t.shape)) for t in tensors if t is not None)

    graph = image.read(data, check="structure")
    table = graph.layers[0].table if graph.is_token_model else None
    layers = []
    params = 0
    kv_cache = 0
    for layer in graph.layers:
        row: dict = {"op": type(layer).__name__, "dtype": ""}
        if isinstance(layer, Embedding):
            row.update(shape=f"{layer.vocab_size} tokens->{layer.d_model}", params=numel(layer.table),
                       dtype=_storage([layer.table]))
        elif isinstance(layer, Attention):
            kv_elem = 2 if layer.kv_dtype == DType.F16 else 4
            cache = 2 * layer.max_seq_len * layer.kv_width * kv_elem
            kv_cache += cache
            norm = "" if layer.q_norm is None else (
                " q/k norm per head" if layer.q_norm.shape[0] == layer.head_dim else " q/k norm")
            row.update(shape=f"{layer.d_model}->{layer.d_model}",
                       params=numel(layer.q_w, layer.k_w, layer.v_w, layer.o_w, layer.q_b, layer.k_b, layer.v_b,
                                    layer.o_b, layer.q_norm, layer.k_norm),
                       dtype=_storage([layer.q_w, layer.k_w, layer.v_w, layer.o_w]),
                       heads=layer.n_heads, kv_heads=layer.n_kv_heads, head_dim=layer.head_dim,
                       rope_theta=layer.rope_theta, max_seq_len=layer.max_seq_len,
                       kv_dtype=layer.kv_dtype.name.lower(), kv_cache_bytes=cache,
                       attention=f"{layer.n_heads} heads / {layer.n_kv_heads} kv, head_dim {layer.head_dim}, "
                                 f"rope theta {layer.rope_theta:g}{norm}, KV cache {layer.max_seq_len} x "
                                 f"{layer.kv_dtype.name.lower()} ({cache:,} B)")
        elif isinstance(layer, Linear):
            tied = table is not None and layer.weight is table
            row.update(shape=f"{layer.in_features}->{layer.out_features}",
                       params=numel(layer.bias) if tied else numel(layer.weight, layer.bias),
                       dtype=_storage([layer.weight]) + (" int8-act" if layer.int8_act else "")
                       + (" int8-blocks" if layer.int8_blocks else ""), tied=tied)
        elif isinstance(layer, Activation):
            row.update(shape=layer.act.name.lower(), params=0)
        elif isinstance(layer, (LayerNorm, RMSNorm)):
            row.update(shape=f"{layer.size}, eps={layer.eps:g}",
                       params=numel(layer.weight, getattr(layer, "bias", None)))
        elif isinstance(layer, MoE):
            experts = layer.experts + layer.shared
            n = sum(numel(e.w1, e.b1, e.w2, e.b2, e.w3, e.b3) for e in experts)
            n += numel(layer.router_weight, layer.router_bias, layer.shared_gate)
            pruned = [int(r) for r in np.flatnonzero(layer.expert_map < 0)]
            e0 = layer.experts[0]
            weights = [layer.router_weight] + [w for e in experts for w in (e.w1, e.w2, e.w3) if w is not None]
            row.update(
                shape=f"{layer.d_model}->{layer.d_model}", params=n, dtype=_storage(weights)
                + (" int8-act" if any(e.int8_act for e in experts) else "")
                + (" int8-blocks" if any(e.int8_blocks for e in experts) else ""),
                routing=layer.routing.name.lower(), top_k=layer.top_k, renormalize=layer.renormalize,
                experts=len(layer.experts), router_outputs=layer.route_count, pruned=pruned,
                expert=f"{e0.kind.name.lower()} {e0.act.name.lower()} hidden {e0.hidden}",
                shared=len(layer.shared), shared_gate=layer.shared_gate is not None,
            )
        else:
            row.update(shape="", params=0)
        params += row["params"]
        layers.append(row)
    moes = graph.moe_layers()
    return {
        "image_bytes": len(data),
        "arena_bytes": engine.arena_size(data),
        "input_size": graph.input_size, "output_size": graph.output_size, "max_batch": graph.max_batch,
        "parameters": params,
        "routed_experts": sum(len(m.experts) for m in moes),
        "shared_experts": sum(len(m.shared) for m in moes),
        "vocab_size": graph.vocab_size,
        "kv_cache_bytes": kv_cache,
        "layers": layers,
    }


def _map_model(path: Path) -> mmap.mmap:
    """The file mapped read-only, with no readahead around the pages that are touched (MADV_RANDOM),
    so reading the tables pages in the tables and not the weights beside them. Left to the garbage
    collector to unmap: the graph read from it holds views into it (and an error's traceback may)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise error_for(F.Status.TRUNCATED, f"{path} is empty")
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):  # Linux, macOS
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


@main.command()
@click.argument("image_path", metavar="IMAGE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(image_path: Path, as_json: bool) -> None:
    """Show the layers, experts, routing, parameters and memory of a model image.

    Reads its tables, not its weights: the file is mapped and its structure checked; `colibri verify`
    checks the payloads."""
    from rich.console import Console
    from rich.table import Table

    d = describe(_map_model(image_path))
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    table = Table(title=f"{image_path.name}")
    for col in ("#", "layer", "shape", "weights", "params", "details"):
        table.add_column(col)
    for i, row in enumerate(d["layers"]):
        details = ""
        if row["op"] == "MoE":
            details = (f"{row['routing']} k={row['top_k']}{' renorm' if row['renormalize'] else ''}, "
                       f"{row['experts']}/{row['router_outputs']} experts ({row['expert']})"
                       f"{', pruned ' + str(row['pruned']) if row['pruned'] else ''}"
                       f"{', shared ' + str(row['shared']) if row['shared'] else ''}"
                       f"{' gated' if row['shared_gate'] else ''}")
        elif row["op"] == "Attention":
            details = row["attention"]
        elif row.get("tied"):
            details = "tied to the embedding (its weights counted there)"
        table.add_row(str(i), row["op"], row["shape"], row["dtype"], f"{row['params']:,}", details)
    console = Console()
    if not console.is_terminal:  # piped: do not wrap the table at 80 columns
        console = Console(width=160)
    console.print(table)
    console.print(
        f"input {d['input_size']}  output {d['output_size']}  max batch {d['max_batch']}  "
        f"parameters {d['parameters']:,}  routed experts {d['routed_experts']}  shared {d['shared_experts']}\n"
        f"image {d['image_bytes']:,} bytes  arena {d['arena_bytes']:,} bytes"
        + (f" (KV cache {d['kv_cache_bytes']:,} of them)  vocabulary {d['vocab_size']:,} tokens"
           if d["vocab_size"] else "")
    )


@main.command()
@click.argument("image_path", metavar="IMAGE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--input", "-i", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Inputs [batch, input_size] as .npy or .csv.")
@click.option("--output", "-o", "output_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write outputs to this .npy or .csv file (default: print CSV to stdout).")
@click.option("--reference", is_flag=True, help="Use the numpy reference instead of the C engine.")
def run(image_path: Path, input_path: Path, output_path: Path | None, reference: bool) -> None:
    """Run a model image on inputs."""
    from . import engine
    from . import reference as ref

    kind = output_path.suffix.lower() if output_path is not None else None
    if kind not in (None, ".npy", ".csv"):
        raise ColibriError(f"{output_path}: outputs are written as .npy or .csv, "
                           f"not {output_path.suffix or 'a name without extension'}")
    x = _load_inputs(input_path)
    # The C engine maps the file (the POSIX layer, as libcolibri): no copy of the weights.
    y = np.atleast_2d(ref.run(image_path.read_bytes(), x) if reference else engine.Model(image_path).forward(x))
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
@click.option("--tokenizer", "tokenizer_spec", default="byte", show_default=True, metavar="byte|PATH.json",
              help="'byte' (a UTF-8 byte per token, ids 0..255) or a Hugging Face tokenizers JSON file.")
@click.option("--stop-id", type=click.IntRange(min=0), default=None,
              help="End once this token id is generated (e.g. 10, newline, for a byte-level model).")
@click.option("--echo/--no-echo", default=True, show_default=True, help="Print the prompt before the continuation.")
def generate(image_path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int, tokenizer_spec: str, stop_id: int | None, echo: bool) -> None:
    """Continue a text prompt with a token model, streaming tokens as the C engine makes them.

    The prompt is tokenized, run through the model (its KV cache holds max_seq_len positions), and
    each new token is printed as soon as it is drawn; a character that spans several tokens is
    printed once whole. The tokens are those colibri.LM(MODEL).generate returns.
    """
    from . import engine
    from . import tokenizer as tok

    tokenizer = tok.load(tokenizer_spec)
    lm = engine.LM(image_path)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty once tokenized: give some text")
    if max(ids) >= lm.vocab_size:
        raise ValueError(f"the prompt holds token id {max(ids)} but the model's vocabulary is 0..{lm.vocab_size - 1}: "
                         f"is --tokenizer {tokenizer_spec} the one the model was trained with?")
    if stop_id is not None and stop_id >= lm.vocab_size:
        raise ValueError(f"--stop-id {stop_id} is outside the model's vocabulary 0..{lm.vocab_size - 1}")
    # Every check (sampler settings, room in the cache) is made before anything is printed.
    tokens = lm.stream(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       stop=stop_id)
    # click.echo flushes after every write: each piece reaches a pipe or terminal as it is made.
    if echo:
        click.echo(prompt, nl=False)
    decoder = tok.StreamDecoder(tokenizer)
    for token in tokens:
        piece = decoder.push(token)
        if piece:
            click.echo(piece, nl=False)
    click.echo(decoder.flush())


# Boards with a model slot and a runner build (colibri.budget reads their budgets).
_SLOT_BOARDS = ("nucleo_h743zi", "mps2_an500")


@main.command()
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@_quant_options(dtype_required=True)
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Inputs (.npy/.csv) for the report and routing checks.")
@click.option("--report", "show_report", is_flag=True,
              help="Print where OUTPUT's bytes go (weights, scales, E, biases, tables) and, with --calibration, "
                   "per-layer and end-to-end error and routing agreement.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Draw the error distribution per layer (PNG).")
@click.option("--page-aligned", is_flag=True,
              help="Put each expert's tensors on 4 KiB pages of their own, with one CRC per tensor (format v3); "
                   "implied when SOURCE is page-aligned.")
@click.option("--target", type=click.Choice(sorted(_SLOT_BOARDS)),
              help="Choose each weight's dtype (f32/f16/q8/q4, routers f32) to fit this board's model slot and runner "
                   "arena with the least error (weighted by --calibration inputs), and print the plan.")
@click.option("--quantize-routers", is_flag=True,
              help="Quantise routers and shared-expert gates too (by default they stay f32: a quantised router "
                   "logit that crosses a near-tie sends the token to other experts).")
@click.option("--router-inputs", type=click.Choice(["f16", "f32"]),
              help="Store the matrices that feed each router (the layer before it, or the previous MoE's w2) at "
                   "this precision: their q8 error swaps near-tied expert scores (routing flips).")
@click.option("--clip", is_flag=True,
              help="q8: search each row's scale for the least squared error (clipping), weighted by the --calibration "
                   "inputs' activation statistics when given, which also rank the compensation E.")
def quantize(source: Path, output: Path, dtype: str | None, compensation: float, group: int, q8: tuple[str, ...],
             keep: tuple[str, ...],
             int8_act: tuple[str, ...], int8_blocks: tuple[str, ...], calibration: Path | None, show_report: bool,
             plot: Path | None,
             page_aligned: bool, target: str | None, quantize_routers: bool, router_inputs: str | None,
             clip: bool) -> None:
    """Quantise an f32 model image SOURCE to OUTPUT (image to image).

    Everything (the calibration inputs, the report) is checked before OUTPUT is written: on an
    error nothing is written. With --calibration, q8 scales and E are weighted by the inputs' activation
    statistics (feature models).
    """
    from . import image
    from . import quantize as q
    from .report import image_bytes, quantisation_report

    if plot and calibration is None:
        raise ColibriError("--plot needs --calibration inputs")
    data = source.read_bytes()
    graph = image.read(data)
    calib = _load_inputs(calibration, graph.input_size, calibration=True) if calibration is not None else None
    from .exporter import write_atomically

    if (dtype is None) == (target is None):
        raise click.UsageError("give either --dtype or --target (which chooses a dtype per weight)")
    if target is not None and q8:
        raise click.UsageError("--q8 has no effect with --target (the plan chooses each weight's dtype)")
    if target is not None and (int8_act or int8_blocks):
        raise click.UsageError("--int8-act and --int8-blocks have no effect with --target (the plan keeps f32 "
                               "activations)")
    # Calibration inputs weigh the weights' errors (clip search, E, the plan) only when asked to: a --report
    # alone must not change what it reports on.
    weighting = calib if calib is not None and (clip or target) and not graph.is_token_model else None
    if target is not None:
        from .budget import plan

        chosen = plan(graph, target, calibration=weighting, compensation=compensation,
                      quantize_routers=quantize_routers, clip=clip, keep=keep, router_inputs=router_inputs,
                      group=group)
        for line in chosen.lines():
            click.echo(line)
        quantised = chosen.graph
    else:
        quantised = q.quantize(graph, dtype, compensation=compensation, keep=keep, int8_act=int8_act,
                               int8_blocks=int8_blocks, progress=True,
                               quantize_routers=quantize_routers, clip=clip, calibration=weighting,
                               router_inputs=router_inputs, group=group, q8=q8)
    if target is not None:
        if page_aligned:
            raise click.UsageError("--page-aligned has no effect with --target: a board boots its slot in place, "
                                   "and the plan is sized for the packed image")
        out = chosen.image  # the image the plan was sized for (a page-aligned SOURCE is packed for the board)
    else:
        page_aligned = page_aligned or bool(int.from_bytes(data[16:20], "little") & F.Flag.PAGE_ALIGNED)
        out = image.write(quantised, page_aligned=page_aligned)
    rep = quantisation_report(graph, quantised, calib, progress=True) if calib is not None else None
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(output, out)
    click.echo(f"wrote {output}: {len(out):,} bytes ({len(out) / len(data):.3f} of {len(data):,})")
    if show_report:
        for line in image_bytes(out).lines():
            click.echo(line)
    if rep is not None:
        for line in rep.lines() if show_report else rep.lines()[-1:]:
            click.echo(line)
        if plot:
            rep.plot(plot)
            click.echo(f"wrote {plot}")


def _target(port: str | None, baud: int, firmware: Path | None):
    """A context manager giving a Device: the board on `port`, or the runner booted in QEMU."""
    import contextlib

    from .device import Device
    from .firmware import build_runner, check_emulator_elf
    from .qemu import Qemu

    @contextlib.contextmanager
    def opened():
        if port is not None:
            with Device(port, baudrate=baud) as dev:
                yield dev, None
            return
        elf = check_emulator_elf(firmware) if firmware else build_runner()
        with Qemu(elf) as q, Device(q.url) as dev:
            yield dev, elf

    return opened()


def _given(ctx: click.Context, name: str) -> bool:
    """Whether the user gave option `name` (rather than click filling in its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source not in (click.core.ParameterSource.DEFAULT,
                                                  click.core.ParameterSource.DEFAULT_MAP)


def _refuse_unused(ctx: click.Context, names: list[str], why: str) -> None:
    """An option that would be silently ignored in this combination is an error, not a no-op."""
    given = [f"--{n.replace('_', '-')}" for n in names if _given(ctx, n)]
    if given:
        raise click.UsageError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect {why}", ctx)


def _port_options(fn):
    options = [
        click.option("--port", help="Serial port of a board running the runner (default: boot it in QEMU)."),
        click.option("--baud", default=115200, show_default=True, help="Baud rate for --port."),
        click.option("--firmware", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Runner ELF for QEMU (default: build firmware/runner for mps2_an500)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_port_options
@click.option("--seed", default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--reference-kernels", is_flag=True,
              help="Run the target's reference kernels (KERNELS request) and require its answers to equal the "
                   "host's bit for bit; by default the target runs its optimised kernels, within 1e-5.")
def hil(model_path: Path, port: str | None, baud: int, firmware: Path | None, seed: int,
        reference_kernels: bool) -> None:
    """Run MODEL on the target and compare its answers with the host engine's reference kernels."""
    from . import engine
    from .footprint import elf_footprint

    data = model_path.read_bytes()
    host = engine.Model(data, reference_kernels=True)
    rng = np.random.default_rng(seed)
    _refuse_unused(click.get_current_context(), ["firmware"] if port else ["baud"],
                   "with --port (the board runs what it was flashed with)" if port else "without --port")
    with _target(port, baud, firmware) as (dev, elf):
        hello = dev.hello()
        click.echo(f"target: {hello.board}, engine {hello.engine_version}, {hello.build_flags}")
        if reference_kernels:
            dev.kernels(reference=True)
        info = dev.load(data, progress=True)
        click.echo(f"target kernels: {dev.kernels()[1]}")
        worst = 0.0
        for batch in sorted({1, info.max_batch}):
            x = rng.standard_normal((batch, host.input_size)).astype(np.float32)
            y, work = dev.forward(x)
            want = host.forward(x)
            err = float(np.abs(y - want).max())
            worst = max(worst, err / (1 + float(np.abs(want).max())))
            click.echo(f"batch {batch}: max |device - host| {err:.3g}; work {work} ({work.count / batch:,.0f} per token)")
        stats = dev.stats()
    click.echo(f"model {len(data):,} B, arena {info.arena_size:,} B, stack high-water {stats.stack_used:,} of {stats.stack_size:,} B")
    if elf is not None:
        fp = elf_footprint(elf)
        click.echo(f"runner firmware: flash {fp.flash:,} B, static RAM {fp.ram:,} B ({elf.name})")
    if reference_kernels and worst != 0.0:
        raise ColibriError(f"device and host reference kernels disagree: max error {worst:.3g} x (1 + max|y|), "
                           "expected bit for bit")
    if worst > 1e-5:
        raise ColibriError(f"device and host disagree: max error {worst:.3g} x (1 + max|y|) > 1e-5")
    click.echo("device agrees with the host engine" + (" bit for bit" if reference_kernels else ""))


@main.command()
@click.argument("model_path", metavar="MODEL", required=False,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_port_options
def footprint(model_path: Path | None, port: str | None, baud: int, firmware: Path | None) -> None:
    """Flash and RAM of the engine alone, of the runner, and for MODEL (with the stack measured on target)."""
    from .footprint import elf_footprint, engine_footprint

    _refuse_unused(click.get_current_context(), ["firmware"] if port else ["baud"],
                   "with --port (the board runs what it was flashed with)" if port else "without --port")
    if firmware is not None:
        from .firmware import check_emulator_elf

        check_emulator_elf(firmware)  # before the first line of output, not after it
    eng = engine_footprint()
    click.echo(f"engine (Cortex-M7 libcolibri.a): code {eng.flash:,} B flash, {eng.ram:,} B static RAM")
    if model_path is None and firmware is None and port is None:
        return
    with _target(port, baud, firmware) as (dev, elf):
        if elf is not None:
            fp = elf_footprint(elf)
            hello = dev.hello()
            click.echo(f"runner ({elf.name}): flash {fp.flash:,} B, static RAM {fp.ram:,} B "
                       f"(of which model buffer {hello.model_capacity:,} B, arena {hello.arena_capacity:,} B)")
        if model_path is not None:
            data = model_path.read_bytes()
            info = dev.load(data, progress=True)
            dev.forward(np.zeros((info.max_batch, info.input_size), np.float32))
            stats = dev.stats()
            click.echo(f"model {model_path.name}: {len(data):,} B image, {info.arena_size:,} B arena, "
                       f"stack high-water {stats.stack_used:,} B of {stats.stack_size:,} B")


@main.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--c-array", "c_array_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write model.c / model.h (the image as a const array) into this folder.")
@click.option("--name", default="colibri_model", show_default=True, help="C name prefix of the array and macros.")
@click.option("--flash-image", "flash_stem", type=click.Path(dir_okay=False, path_type=Path),
              help="Write STEM.bin and STEM.hex: a committed model slot at the board's slot address.")
@click.option("--board", default="nucleo_h743zi", show_default=True, help="Board profile for --flash-image.")
@click.option("--slot", type=click.Choice(["A", "B"], case_sensitive=False), default="A", show_default=True,
              help="--flash-image: the model slot (A or B, either case).")
@click.option("--sequence", default=1, show_default=True, help="Slot sequence number (the highest valid boots).")
@click.option("--firmware", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="--flash-image: the runner firmware (.elf/.bin/.hex) the slot is for; refuse an image format "
                   "version it does not read (default: the engine packaged with this colibri).")
def pack(model_path: Path, c_array_dir: Path | None, name: str, flash_stem: Path | None, board: str, slot: str,
         sequence: int, firmware: Path | None) -> None:
    """Pack MODEL for firmware: a C array to link in, and/or a flash slot image (.bin + Intel HEX)."""
    from . import pack as packing

    if c_array_dir is None and flash_stem is None:
        raise click.UsageError("say what to write: --c-array DIR and/or --flash-image STEM")
    slot = slot.upper()
    if flash_stem is None:
        _refuse_unused(click.get_current_context(), ["board", "slot", "sequence"], "without --flash-image")
    data = model_path.read_bytes()
    if c_array_dir is not None:
        packed = packing.c_array(data, c_array_dir, name=name)
        click.echo(f"wrote {packed.source} and {packed.header}")
    if flash_stem is not None:
        fi = packing.flash_image(data, flash_stem, board=board, slot=slot, sequence=sequence, firmware=firmware)
        click.echo(f"wrote {fi.bin} and {fi.hex}: slot {slot.upper()} of {board} at 0x{fi.address:08x}, {fi.size:,} B")


@main.command()
@click.argument("image_path", metavar="IMAGE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def verify(image_path: Path) -> None:
    """Verify every byte of a model image: header, tables, every tensor payload against its CRC
    (format v3: one per tensor; v1, v2: the image CRC), by the C engine and the Python reader."""
    from . import engine, image

    with open(image_path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise error_for(F.Status.TRUNCATED, f"{image_path} is empty")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            with memoryview(data) as view:
                st_c = engine._engine.validate(view)
                st_py = image.status(view)
            version = int.from_bytes(data[4:6], "little")
            tensors = int.from_bytes(data[32:36], "little")
    if st_c != st_py:
        raise ColibriError(f"{image_path}: the C engine says {st_c}, the Python reader {st_py} (please report)")
    if st_c:
        raise error_for(st_c, str(image_path))
    what = f"{tensors} tensor CRCs" if version >= F.TENSOR_CRC_VERSION else "image CRC"
    click.echo(f"{image_path}: ok (format v{version}, {size:,} bytes, {what} verified)")


@main.command("gen-header", hidden=True)  # for maintainers (make header), not in the user's list
@click.option("--check", is_flag=True, help="Exit 1 if the header is out of date instead of writing it.")
def gen_header(check: bool) -> None:
    """Regenerate firmware/colibri_core/include/colibri_format.h from colibri.format."""
    from . import sources

    path = sources.root() / "firmware/colibri_core/include/colibri_format.h"
    text = F.c_header()
    if check:
        if not path.exists() or path.read_text() != text:
            raise ColibriError(f"{path} is out of date: run `colibri gen-header`")
        return
    if sources.checkout_root() is None:
        raise ColibriError("gen-header rewrites a checkout's header: run it in a Colibri checkout (--check works anywhere)")
    path.write_text(text)
    click.echo(f"wrote {path}")


@main.group(cls=_HelpGroup)
def natmod() -> None:
    """The MicroPython native module (colibri.mpy): build it for a MicroPython port."""


@natmod.command("build")
@click.option("--arch", "archs", multiple=True, default=("x64",), show_default=True,
              type=click.Choice(["x64", "armv7emsp", "armv7emdp"]),
              help="MicroPython native architecture (repeatable): x64 (unix port), armv7emsp (Cortex-M4F/M7 "
                   "single precision), armv7emdp (Cortex-M7 double precision, e.g. STM32H7).")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="The .mpy file (default ./colibri.mpy); with several --arch, a folder that gets ARCH/colibri.mpy.")
def natmod_build(archs: tuple[str, ...], output: Path | None) -> None:
    """Compile the module and the engine, and link them into colibri.mpy."""
    from . import natmod as nm

    archs = tuple(dict.fromkeys(archs))
    for arch in archs:
        if len(archs) == 1:
            out = output or Path("colibri.mpy")
        else:
            out = (output or Path(".")) / arch / "colibri.mpy"
        result = nm.build(arch, out)
        click.echo(f"wrote {out}: {result.size:,} bytes ({arch}: text {result.text_size:,} B, "
                   f"bss {result.bss_size:,} B, {len(result.relocations)} relocations)")


# -- colibri flash: a model into a flash slot ------------------------------------------------------------------


def _slot_payload(data: bytes) -> tuple[bytes, int | None]:
    """(model image, sequence) from a model image or a slot image (32-byte header + image)."""
    from .slots import SLOT_HEADER_SIZE, parse_slot_header

    header = parse_slot_header(data)
    if header is None:
        return data, None
    if not header.image_ok(data[SLOT_HEADER_SIZE:]):
        raise ColibriError("slot image: the image after the header does not match its size and CRC-32")
    return data[SLOT_HEADER_SIZE : SLOT_HEADER_SIZE + header.image_size], header.sequence


def _flash_over_serial(model_path: Path, image: bytes, port: str | None, baud: int, firmware: Path | None,
                       qemu_flash: Path | None) -> None:
    import time
    import zlib

    from .device import Device
    from .firmware import build_runner, check_emulator_elf
    from .qemu import Qemu

    def update(dev: Device) -> str:
        hello = dev.hello()
        from . import image as cimage

        cimage.check_version(image, hello.formats, reader=f"the firmware on the {hello.board}")
        before = dev.slot_info()
        if len(image) > before.capacity:
            raise ColibriError(f"{model_path.name}: {len(image):,} bytes do not fit a {before.capacity:,}-byte slot "
                               f"of {hello.board}")
        start = time.monotonic()
        after = dev.update(image, progress=True)
        took = time.monotonic() - start
        name = after.running
        slot = after[name] if name in ("A", "B") else None
        if slot is None or not slot.valid or after.active != name or slot.image_size != len(image) \
                or slot.image_crc32 != zlib.crc32(image):
            raise ColibriError(f"the device does not report the new model as committed and running: {after}")
        return (f"flashed {model_path.name} to slot {name} (sequence {slot.sequence}, 0x{slot.address:08x}) "
                f"of {hello.board}: {len(image):,} bytes in {took:.2f} s, CRC-32 {slot.image_crc32:08x} verified, "
                f"running")

    if port is not None:
        with Device(port, baudrate=baud) as dev:
            click.echo(update(dev))
        return
    elf = check_emulator_elf(firmware) if firmware else build_runner()
    load = qemu_flash if qemu_flash is not None and qemu_flash.exists() else None
    with Qemu(elf, qmp=qemu_flash is not None, flash=load) as q, Device(q.url) as dev:
        line = update(dev)
        if qemu_flash is not None:
            q.pause()
            q.save_flash(qemu_flash)
            line += f"; emulated flash saved to {qemu_flash}"
    click.echo(line)


def _probe_check(image: bytes, firmware: Path | None) -> None:
    """The checks the runner makes before it commits a slot over serial, made before the probe writes:
    a valid image, of a format version the target firmware reads (--firmware, else this colibri's engine)."""
    from . import image as cimage
    from .pack import firmware_formats

    if firmware is not None:
        cimage.check_version(image, firmware_formats(firmware), reader=f"firmware {firmware.name}")
    cimage.read(image)


def _probe_hex_image(path: Path, layout, firmware: Path | None) -> None:
    """A slot .hex (colibri pack --flash-image) at one of the board's slots, holding an image that passes
    _probe_check."""
    from intelhex import IntelHex

    ih = IntelHex(str(path))
    start = ih.minaddr()
    if start not in (layout.address("A"), layout.address("B")):
        raise ColibriError(f"{path.name}: starts at 0x{start:08x}, not at a model slot of the board")
    image, seq = _slot_payload(ih.tobinstr(start=start, end=ih.maxaddr()))
    if seq is None:
        raise ColibriError(f"{path.name}: no slot header at 0x{start:08x} (write it with colibri pack --flash-image)")
    _probe_check(image, firmware)


def _flash_with_probe(model_path: Path, data: bytes, firmware: Path | None, target: str, board: str, slot: str,
                      sequence: int) -> None:
    """Factory programming through an SWD probe: a thin wrapper around the `pyocd` command."""
    import shutil
    import tempfile
    import time

    from .slots import LAYOUTS, slot_image

    layout = LAYOUTS[board]
    address = layout.address(slot)
    other = layout.address("B" if slot == "A" else "A")
    steps: list[tuple[str, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="colibri-probe-") as tmp:
        if model_path.suffix.lower() == ".hex":
            _probe_hex_image(model_path, layout, firmware)
            slot_file, what = model_path, f"{model_path.name} (Intel HEX, at its own addresses)"
        else:
            image, seq = _slot_payload(data)
            _probe_check(image, firmware)
            if len(image) > layout.capacity:
                raise ColibriError(f"{model_path.name}: {len(image):,} bytes do not fit a {layout.capacity:,}-byte slot")
            slot_file = Path(tmp) / "slot.bin"
            slot_file.write_bytes(slot_image(image, seq if seq is not None else sequence))
            what = f"slot {slot} at 0x{address:08x} ({len(image):,}-byte model, sequence {seq or sequence})"
        pyocd = shutil.which("pyocd")
        if pyocd is None:
            raise ColibriError("--probe needs pyOCD, which is not installed (pip install pyocd; "
                               f"then pyocd pack install {target})")
        base = [pyocd]
        connect = ["-t", target, "-W"]  # -W: fail at once when no probe is connected instead of waiting
        # The other slot's header sector first: a valid older slot there with a higher sequence would win.
        steps.append(("erase the other slot's header sector", base + ["erase", *connect, "--sector", f"0x{other:x}"]))
        if firmware is not None:
            fw = ["--base-address", "0x08000000"] if firmware.suffix.lower() == ".bin" else []
            steps.append((f"program {firmware.name}", base + ["flash", *connect, *fw, str(firmware)]))
        slot_args = [] if slot_file.suffix.lower() == ".hex" else ["--base-address", f"0x{address:x}"]
        steps.append(("program the model slot", base + ["flash", *connect, *slot_args, str(slot_file)]))
        start = time.monotonic()
        for step, cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                out = (r.stderr + r.stdout).strip()
                if "No connected debug probes" in out or "No available debug probes" in out or "No target device" in out:
                    raise ColibriError("no debug probe found: connect the board's ST-LINK (pyocd list shows probes)")
                last = out.splitlines()[-1] if out else f"exit status {r.returncode}"
                raise ColibriError(f"pyocd failed to {step}: {last}")
    fw_note = f" and {firmware.name}" if firmware is not None else ""
    click.echo(f"programmed {what}{fw_note} with pyOCD ({target}) in {time.monotonic() - start:.1f} s")


@main.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_port_options
@click.option("--qemu-flash", type=click.Path(dir_okay=False, path_type=Path),
              help="QEMU: load the emulated flash from this file if it exists, save it back afterwards.")
@click.option("--probe", is_flag=True,
              help="Factory-program through an SWD probe with pyOCD (not installed with colibri) instead.")
@click.option("--probe-target", default="stm32h743zitx", show_default=True, help="--probe: pyOCD target type.")
@click.option("--board", type=click.Choice(["nucleo_h743zi"]), default="nucleo_h743zi", show_default=True,
              help="--probe: the board whose flash map to use.")
@click.option("--slot", type=click.Choice(["A", "B"], case_sensitive=False), default="A", show_default=True,
              help="--probe: slot to write (A or B, either case). Over serial the runner picks the slot it "
                   "does not run.")
@click.option("--sequence", default=1, show_default=True, help="--probe: the slot's sequence number.")
def flash(model_path: Path, port: str | None, baud: int, firmware: Path | None, qemu_flash: Path | None, probe: bool,
          probe_target: str, board: str, slot: str, sequence: int) -> None:
    """Write MODEL into the inactive flash slot of a running board and switch to it.

    Over the runner's serial line (--port; default: the runner booted in QEMU): the model goes
    to the slot that does not run, is verified in flash and committed with one header word, so a
    power loss half way leaves the old model. MODEL is a model image or a slot image (.bin with
    the 32-byte slot header).

    With --probe, factory programming through an SWD probe with pyOCD: the model as slot image at
    the slot's address (MODEL may also be a slot .hex), the other slot's header sector erased, and
    --firmware (the runner .elf/.hex/.bin for the board) if given.
    """
    ctx = click.get_current_context()
    if probe:
        _refuse_unused(ctx, ["port", "baud", "qemu_flash"], "with --probe (it programs through the SWD probe)")
    else:
        # Over the serial line the runner writes the slot it is not running from and numbers it itself:
        # a --slot asked for here could not be honoured, so it is refused rather than ignored.
        _refuse_unused(ctx, ["slot", "sequence", "probe_target", "board"],
                       "without --probe (over serial the runner writes its inactive slot)")
        if port is not None:
            _refuse_unused(ctx, ["firmware", "qemu_flash"], "with --port (they are for the runner in QEMU)")
    data = model_path.read_bytes()
    if probe:
        _flash_with_probe(model_path, data, firmware, probe_target, board, slot.upper(), sequence)
        return
    image, _ = _slot_payload(data)
    from . import image as cimage

    cimage.read(image)  # refuse a file that is no model image before uploading it
    _flash_over_serial(model_path, image, port, baud, firmware, qemu_flash)
