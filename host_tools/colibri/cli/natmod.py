"""`colibri natmod build`: the MicroPython native module (.mpy)."""
from __future__ import annotations

from pathlib import Path

import click

from .app import HelpGroup, main


@main.group(cls=HelpGroup)
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
    from ..target import natmod as nm

    archs = tuple(dict.fromkeys(archs))
    for arch in archs:
        if len(archs) == 1:
            out = output or Path("colibri.mpy")
        else:
            out = (output or Path(".")) / arch / "colibri.mpy"
        result = nm.build(arch, out)
        click.echo(f"wrote {out}: {result.size:,} bytes ({arch}: text {result.text_size:,} B, "
                   f"bss {result.bss_size:,} B, {len(result.relocations)} relocations)")
