"""The `colibri` command group: one-line errors, and the options and input loading its commands share.
The commands are in the modules beside this one (colibri/cli/__init__.py loads them all)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import click
import numpy as np

from ..model.errors import ColibriError


DEBUG_ENV = "COLIBRI_DEBUG"  # set (to anything but 0): errors re-raised with their traceback


# Failures a user causes and can fix from the message alone; anything else is reported as unexpected.
EXPECTED = (ColibriError, OSError, ValueError, ImportError, subprocess.SubprocessError)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(text: object) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def fail(message: str, status: int = 1) -> NoReturn:
    click.echo(f"colibri: {message}", err=True)
    sys.exit(status)


class HelpGroup(click.Group):
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


class _Main(HelpGroup):
    """Every failure is one line on stderr and exit status 1: usage errors, expected failures
    (ColibriError, OSError, ...) and unexpected ones (pointing at COLIBRI_DEBUG=1, which re-raises
    for the traceback). Ctrl-C ends with one line and status 130."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:  # Ctrl-C or end of input inside click's own parsing
            fail("interrupted", 130)
        except click.exceptions.NoArgsIsHelpError as exc:  # `colibri` or `colibri natmod` alone: show the help
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if isinstance(exc, click.UsageError) and ctx else ""
            fail(f"error: {' '.join(exc.format_message().split())}{hint}")  # click's lists span lines
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except BrokenPipeError:
            raise  # output piped into e.g. `head`: click ends quietly
        except Exception as exc:
            if _debug():
                raise
            if isinstance(exc, EXPECTED):
                fail(f"error: {one_line(exc) or type(exc).__name__}")
            fail(f"error: unexpected {type(exc).__name__}: {one_line(exc)} "
                  f"(run with {DEBUG_ENV}=1 for the traceback)")


@click.group(cls=_Main)
@click.version_option(package_name="colibri-moe")
def main() -> None:
    """Colibri: Mixture-of-Experts models on microcontrollers.

    Every error is one line on stderr and exit status 1 (COLIBRI_DEBUG=1 shows its traceback).
    """


def load_inputs(path: Path, width: int | None = None, *, calibration: bool = False) -> np.ndarray:
    """Inputs [tokens, features] from .npy or .csv; `width`: the features the model takes. Calibration
    inputs may also be [batch, sequence, features], as a Hugging Face block takes them."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            x = np.load(path)
        except (ValueError, EOFError) as exc:  # not an .npy file, or one holding Python objects
            raise ColibriError(f"{path}: not a numpy .npy array file ({one_line(exc)})") from None
    elif suffix in (".csv", ".txt"):
        try:
            x = np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2)
        except ValueError as exc:
            raise ColibriError(f"{path}: not rows of comma-separated numbers ({one_line(exc)})") from None
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


def quant_options(fn=None, *, dtype_required: bool = False):
    """--dtype (export: f32 by default; quantize: no default, as f32 would only copy the image) and the
    options that tune it."""
    if fn is None:
        return lambda f: quant_options(f, dtype_required=dtype_required)
    from ..quant.quantize import DEFAULT_COMPENSATION, DTYPES, Q4_DEFAULT_GROUP

    kinds = ("f16, q8 (int8 per output channel + sparse f16 compensation), or q4 (int4 in groups of --group "
             "columns with f16 scales + the same compensation; routers stay f32; embedding tables and "
             "attention k/v q8)")
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
                     help="Run matching layers/experts/attention blocks with int8 activations in blocks of 32 "
                          "columns, each with its own scale (INT8_BLOCKS; not with --int8-act on the same layer), "
                          "e.g. 'layers.*' or 'layers.*.experts.*'. Default for a q8/q4 token model whose image "
                          "is 16 MiB or more (a Linux one): every int8/int4 layer; 'none' turns that off."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def int8_blocks_choice(patterns: tuple[str, ...]) -> tuple[str, ...] | None:
    """--int8-blocks as the exporters take it: None when not given (their default: activation blocks on a
    Linux-sized token model, `quantize.linux_int8_blocks`), () for 'none', else the patterns."""
    if not patterns:
        return None
    if "none" in patterns:
        if len(patterns) > 1:
            raise click.UsageError("--int8-blocks none means no activation blocks: give no other pattern with it")
        return ()
    return patterns


def option_given(ctx: click.Context, name: str) -> bool:
    """Whether the user gave option `name` (rather than click filling in its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source not in (click.core.ParameterSource.DEFAULT,
                                                  click.core.ParameterSource.DEFAULT_MAP)


def refuse_unused(ctx: click.Context, names: list[str], why: str) -> None:
    """An option that would be silently ignored in this combination is an error, not a no-op."""
    given = [f"--{n.replace('_', '-')}" for n in names if option_given(ctx, n)]
    if given:
        raise click.UsageError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect {why}", ctx)
