"""`colibri quantize`: an f32 image to f16, q8 or q4, or to whatever fits a board (--target)."""
from __future__ import annotations

from pathlib import Path

import click

from ..model import format as F
from ..model.errors import ColibriError
from .app import int8_blocks_choice, load_inputs, main, quant_options


# Boards with a model slot and a runner build (colibri.target.budget reads their budgets).
_SLOT_BOARDS = ("nucleo_h743zi", "mps2_an500")


@main.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@quant_options(dtype_required=True)
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
@click.option("--max-seq-len", type=click.IntRange(min=1),
              help="A Hugging Face folder or GGUF SOURCE: the KV cache's positions (required for them).")
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="A folder or GGUF SOURCE: tokens per forward the arena is sized for.")
@click.option("--kv-dtype", type=click.Choice(("f32", "f16")), default="f32", show_default=True,
              help="A folder or GGUF SOURCE: the KV cache's storage.")
def quantize(source: Path, output: Path, dtype: str | None, compensation: float, group: int, q8: tuple[str, ...],
             keep: tuple[str, ...],
             int8_act: tuple[str, ...], int8_blocks: tuple[str, ...], calibration: Path | None, show_report: bool, plot: Path | None,
             page_aligned: bool, target: str | None, quantize_routers: bool, router_inputs: str | None,
             clip: bool, max_seq_len: int | None, max_batch: int, kv_dtype: str) -> None:
    """Quantise an f32 model image SOURCE to OUTPUT (image to image), or plan a Hugging Face folder or
    GGUF file SOURCE for a board (--target, streamed: one tensor in memory at a time).

    Everything (the calibration inputs, the report) is checked before OUTPUT is written: on an
    error nothing is written. With --calibration, q8 scales and E are weighted by the inputs' activation
    statistics (feature models).
    """
    from .. import image
    from ..checkpoints.gguf_file import is_gguf
    from ..quant import quantize as q
    from ..quant.report import image_bytes, quantisation_report

    if source.is_dir() or is_gguf(source):
        _plan_checkpoint(source, output, target=target, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                         kv_dtype=kv_dtype, compensation=compensation, group=group, keep=keep,
                         quantize_routers=quantize_routers, router_inputs=router_inputs,
                         refused={"--calibration": calibration, "--q8": q8, "--int8-act": int8_act,
                                  "--int8-blocks": int8_blocks, "--clip": clip, "--plot": plot,
                                  "--page-aligned": page_aligned, "--report": show_report})
        return
    if max_seq_len is not None:
        raise click.UsageError("--max-seq-len is for a Hugging Face folder or GGUF SOURCE; an image has its own")

    if plot and calibration is None:
        raise ColibriError("--plot needs --calibration inputs")
    data = source.read_bytes()
    graph = image.read(data)
    calib = load_inputs(calibration, graph.input_size, calibration=True) if calibration is not None else None
    from ..image import write_atomically

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
        from ..target.budget import plan

        chosen = plan(graph, target, calibration=weighting, compensation=compensation,
                      quantize_routers=quantize_routers, clip=clip, keep=keep, router_inputs=router_inputs,
                      group=group)
        for line in chosen.lines():
            click.echo(line)
        quantised = chosen.graph
    else:
        blocks = int8_blocks_choice(int8_blocks)
        quantised = q.quantize(graph, dtype, compensation=compensation, keep=keep, int8_act=int8_act,
                               int8_blocks=blocks or (), progress=True,
                               quantize_routers=quantize_routers, clip=clip, calibration=weighting,
                               router_inputs=router_inputs, group=group, q8=q8)
        if blocks is None and not int8_act:  # a Linux-sized token model: as `colibri export` writes it
            q.set_act_forms(quantised, (), q.linux_int8_blocks(quantised, q.stored_int8), q.stored_int8)
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


def _plan_checkpoint(source: Path, output: Path, *, target: str | None, dtype: str | None, max_seq_len: int | None,
                     refused: dict, **options) -> None:
    """`--target BOARD` for a folder or GGUF file: the streamed planner (colibri.target.budget.plan_checkpoint)."""
    from ..target.budget import plan_checkpoint
    from .token_export import peak_rss_bytes

    if target is None:
        raise click.UsageError(f"{source} is a model folder or GGUF file: `colibri quantize` plans it for a board "
                               f"(--target BOARD); for one dtype throughout, `colibri export {source.name} OUT --dtype "
                               f"{dtype or 'q8'}` streams it")
    if dtype is not None:
        raise click.UsageError("give either --dtype or --target (which chooses a dtype per weight)")
    for name, value in refused.items():
        if value:
            raise click.UsageError(f"{name} has no effect when planning a folder or GGUF file for a board")
    if max_seq_len is None:
        raise click.UsageError(f"{source}: a token model needs --max-seq-len (the KV cache's positions)")
    with click.progressbar(length=1, label=f"measuring {source.name}'s weights") as bar:
        def on_weight(index: int, count: int) -> None:
            bar.length = count
            bar.update(1)

        chosen = plan_checkpoint(source, target, output, max_seq_len=max_seq_len, on_weight=on_weight, **options)
    for line in chosen.lines():
        click.echo(line)
    click.echo(f"wrote {output}: {chosen.image_size:,} bytes; peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
