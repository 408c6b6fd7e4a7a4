"""The engine builds warning-free (host and Cortex-M7) with no heap calls and no writable globals."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from conftest import CORE, make

HEAP = {"malloc", "calloc", "realloc", "free", "aligned_alloc", "posix_memalign", "_sbrk", "sbrk"}
WRITABLE = (".data", ".bss", ".sdata", ".sbss", ".tbss", ".tdata")


def _build(variant: str) -> list[Path]:
    """Builds the engine library for a variant and returns its object files.

    The Cortex-M7 objects are rebuilt from scratch so the compiler's output can be
    checked for warnings (the Makefile also passes -Werror); nothing else uses them.
    """
    if variant == "cm7":
        make("-C", str(CORE), "clean-cm7")
    r = make("-C", str(CORE), variant)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    objs = sorted((CORE / "build" / variant / "obj").glob("*.o"))
    assert objs and (CORE / "build" / variant / "libcolibri.a").exists()
    return objs


@pytest.mark.parametrize("variant", ["host", "cm7"])
def test_warning_free_build_without_heap_or_writable_data(variant: str) -> None:
    if variant == "cm7" and not shutil.which("arm-none-eabi-gcc"):
        pytest.fail("arm-none-eabi-gcc missing: run scripts/setup.sh")
    for obj in _build(variant):
        with open(obj, "rb") as fh:
            elf = ELFFile(fh)
            symtab = elf.get_section_by_name(".symtab")
            assert isinstance(symtab, SymbolTableSection)
            for sym in symtab.iter_symbols():
                undefined = sym["st_shndx"] == "SHN_UNDEF"
                assert not (undefined and sym.name in HEAP), f"{obj.name} calls {sym.name}"
                if sym["st_info"]["type"] == "STT_OBJECT" or sym["st_shndx"] == "SHN_COMMON":
                    section = elf.get_section(sym["st_shndx"]).name if isinstance(sym["st_shndx"], int) else sym["st_shndx"]
                    assert not section.startswith(WRITABLE) and section != "SHN_COMMON", (
                        f"{obj.name}: writable symbol {sym.name} in {section}"
                    )
            for section in elf.iter_sections():
                if section.name.startswith(WRITABLE):
                    assert section["sh_size"] == 0, f"{obj.name}: {section.name} holds {section['sh_size']} bytes"
