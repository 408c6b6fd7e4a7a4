"""Flash and RAM of the Cortex-M7 engine library and of linked firmware, from their ELF files."""
from __future__ import annotations

import io
import subprocess
from dataclasses import dataclass
from pathlib import Path

from elftools.elf.constants import SH_FLAGS
from elftools.elf.elffile import ELFFile

from ..runtime import sources


@dataclass
class Footprint:
    flash: int  # bytes stored in flash: code, read-only data, .data initialisers
    ram: int  # bytes of static RAM: .data + .bss (+ any NOLOAD buffers)


def _sections(elf: ELFFile) -> Footprint:
    flash = ram = 0
    for sec in elf.iter_sections():
        flags = sec["sh_flags"]
        if not flags & SH_FLAGS.SHF_ALLOC or sec["sh_size"] == 0:
            continue
        if flags & SH_FLAGS.SHF_WRITE:
            ram += sec["sh_size"]
            if sec["sh_type"] != "SHT_NOBITS":
                flash += sec["sh_size"]  # .data initialisers live in flash too
        else:
            flash += sec["sh_size"]
    return Footprint(flash, ram)


def elf_footprint(path: str | Path) -> Footprint:
    with open(path, "rb") as fh:
        return _sections(ELFFile(fh))


def engine_footprint() -> Footprint:
    """The engine alone: every object of build/cm7/libcolibri.a (built if needed)."""
    core = sources.build_root() / "firmware" / "colibri_core"  # writable, unlike an installed package
    subprocess.run(["make", "-s", "-C", str(core), "cm7"], check=True, capture_output=True)
    total = Footprint(0, 0)
    for obj in sorted((core / "build" / "cm7" / "obj").glob("*.o")):
        fp = _sections(ELFFile(io.BytesIO(obj.read_bytes())))
        total = Footprint(total.flash + fp.flash, total.ram + fp.ram)
    return total
