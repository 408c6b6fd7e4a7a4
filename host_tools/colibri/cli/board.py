"""`colibri hil`, `colibri footprint` and `colibri pack`: a model on a board or in QEMU, its memory, and
the C array and flash images that carry it."""
from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from ..model.errors import ColibriError
from .app import main, refuse_unused


def target_device(port: str | None, baud: int, firmware: Path | None):
    """A context manager giving a Device: the board on `port`, or the runner booted in QEMU."""
    import contextlib

    from ..target.device import Device
    from ..target.firmware import build_runner, check_emulator_elf
    from ..target.qemu import Qemu

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


def host_engine(data: bytes):
    """The host engine over `data` with the reference kernels: colibri.LM for a token model, else
    colibri.Model."""
    from .. import image
    from ..runtime import engine

    token = len(data) >= 6 and image.is_token_model(int.from_bytes(data[4:6], "little"), data)
    return (engine.LM if token else engine.Model)(data, reference_kernels=True)


def refuse_what_it_cannot_hold(dev, name: str, data: bytes, host) -> None:
    """Before any byte is uploaded: an image larger than the runner's model buffer, or a token model
    whose KV cache alone (the same bytes on every target) is larger than its arena. The rest of the
    arena is the target's to measure: the host's (64-bit pointers in the plan) is an upper bound."""
    hello = dev.hello()
    if len(data) > hello.model_capacity:
        raise ColibriError(f"{name}: the image is {len(data):,} B and {hello.board}'s runner holds "
                           f"{hello.model_capacity:,} B of model: choose a smaller dtype (colibri quantize --target "
                           "BOARD plans one); nothing uploaded")
    kv = host.info.get("kv_cache_bytes", 0)
    if kv > hello.arena_capacity:
        raise ColibriError(f"{name}: the KV cache alone is {kv:,} B and {hello.board}'s arena holds "
                           f"{hello.arena_capacity:,} B: export with a smaller --max-seq-len or --kv-dtype f16; "
                           "nothing uploaded")


def run_once(dev, host, info, rng: np.random.Generator) -> list[tuple[str, np.ndarray, np.ndarray, object]]:
    """(what, device answer, host answer, device work) of a feature model's batches of 1 and
    max_batch, or of a token model's prefill of up to max_batch tokens and one decode step after it."""
    if not info.vocab_size:
        out = []
        for batch in sorted({1, info.max_batch}):
            x = rng.standard_normal((batch, host.input_size)).astype(np.float32)
            y, work = dev.forward(x)
            out.append((f"batch {batch}", y, host.forward(x), work))
        return out
    prompt = rng.integers(0, info.vocab_size, max(1, min(info.max_batch, info.max_seq_len - 1)))
    dev.lm_reset()
    host.reset()
    y, work = dev.forward_tokens(prompt)
    want = host.forward_tokens(prompt)
    out = [(f"prefill {len(prompt)} tokens", y, want, work)]
    if len(prompt) < info.max_seq_len:
        step = [int(np.argmax(want[-1]))]
        y, work = dev.forward_tokens(step)
        out.append(("decode 1 token", y, host.forward_tokens(step), work))
    return out


def port_options(fn):
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
@port_options
@click.option("--seed", default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--reference-kernels", is_flag=True,
              help="Run the target's reference kernels (KERNELS request) and require its answers to equal the "
                   "host's bit for bit; by default the target runs its optimised kernels, within 1e-5.")
def hil(model_path: Path, port: str | None, baud: int, firmware: Path | None, seed: int,
        reference_kernels: bool) -> None:
    """Run MODEL on the target and compare its answers with the host engine's reference kernels
    (a token model: logits of a prefill and of one decode step)."""
    from ..target.footprint import elf_footprint

    data = model_path.read_bytes()
    host = host_engine(data)
    rng = np.random.default_rng(seed)
    refuse_unused(click.get_current_context(), ["firmware"] if port else ["baud"],
                   "with --port (the board runs what it was flashed with)" if port else "without --port")
    with target_device(port, baud, firmware) as (dev, elf):
        hello = dev.hello()
        click.echo(f"target: {hello.board}, engine {hello.engine_version}, {hello.build_flags}")
        refuse_what_it_cannot_hold(dev, model_path.name, data, host)
        if reference_kernels:
            dev.kernels(reference=True)
        info = dev.load(data, progress=True)
        click.echo(f"target kernels: {dev.kernels()[1]}")
        worst = 0.0
        for what, y, want, work in run_once(dev, host, info, rng):
            err = float(np.abs(y - want).max())
            worst = max(worst, err / (1 + float(np.abs(want).max())))
            click.echo(f"{what}: max |device - host| {err:.3g}; work {work} ({work.count / len(y):,.0f} per token)")
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
@port_options
def footprint(model_path: Path | None, port: str | None, baud: int, firmware: Path | None) -> None:
    """Flash and RAM of the engine alone, of the runner, and for MODEL (with the stack measured on target)."""
    from ..target.footprint import elf_footprint, engine_footprint

    refuse_unused(click.get_current_context(), ["firmware"] if port else ["baud"],
                   "with --port (the board runs what it was flashed with)" if port else "without --port")
    if firmware is not None:
        from ..target.firmware import check_emulator_elf

        check_emulator_elf(firmware)  # before the first line of output, not after it
    eng = engine_footprint()
    click.echo(f"engine (Cortex-M7 libcolibri.a): code {eng.flash:,} B flash, {eng.ram:,} B static RAM")
    if model_path is None and firmware is None and port is None:
        return
    with target_device(port, baud, firmware) as (dev, elf):
        if elf is not None:
            fp = elf_footprint(elf)
            hello = dev.hello()
            click.echo(f"runner ({elf.name}): flash {fp.flash:,} B, static RAM {fp.ram:,} B "
                       f"(of which model buffer {hello.model_capacity:,} B, arena {hello.arena_capacity:,} B)")
        if model_path is not None:
            data = model_path.read_bytes()
            host = host_engine(data)
            refuse_what_it_cannot_hold(dev, model_path.name, data, host)
            info = dev.load(data, progress=True)
            run_once(dev, host, info, np.random.default_rng(0))  # the deepest stack: every layer, max_batch
            stats = dev.stats()
            kv = f" (KV cache {info.kv_cache_bytes:,} B)" if info.vocab_size else ""
            click.echo(f"model {model_path.name}: {len(data):,} B image, {info.arena_size:,} B arena{kv}, "
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
    from ..target import pack as packing

    if c_array_dir is None and flash_stem is None:
        raise click.UsageError("say what to write: --c-array DIR and/or --flash-image STEM")
    slot = slot.upper()
    if flash_stem is None:
        refuse_unused(click.get_current_context(), ["board", "slot", "sequence"], "without --flash-image")
    data = model_path.read_bytes()
    if c_array_dir is not None:
        packed = packing.c_array(data, c_array_dir, name=name)
        click.echo(f"wrote {packed.source} and {packed.header}")
    if flash_stem is not None:
        fi = packing.flash_image(data, flash_stem, board=board, slot=slot, sequence=sequence, firmware=firmware)
        click.echo(f"wrote {fi.bin} and {fi.hex}: slot {slot.upper()} of {board} at 0x{fi.address:08x}, {fi.size:,} B")
