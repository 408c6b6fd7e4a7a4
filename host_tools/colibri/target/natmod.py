"""Colibri's MicroPython native module: compile, link into a .mpy, read a .mpy back.

    from colibri.target import natmod
    natmod.build("x64", Path("colibri.mpy"))          # compile + link the module
    natmod.link([Path("a.o"), Path("b.o")], "x64", Path("m.mpy"))   # any objects
    mpy = natmod.read_mpy(Path("colibri.mpy"))        # header, qstrs, sizes, relocations

The .mpy format and the rules enforced here are in docs/natmod-abi.md.
How the link works:

1. Every object is checked first (`LinkError` names the symbol and the object
   file): no writable initialised data (.data), no thread-local storage, no
   static or hidden .bss variable and no .bss reached other than through the
   GOT, only relocation types that survive the steps below, and no undefined
   symbol but the runtime's own (`mp_fun_table`, `mp_qstr_<name>`) and, on
   ARM, the compiler's support routines (libgcc's `__aeabi_*`, e.g. double
   arithmetic on the single-precision Cortex-M4F), which ld pulls from libgcc.a.
2. GNU ld links them as a position-independent executable with a script that
   lays out one contiguous image, text then read-only data then the GOT (so
   every PC-relative reference inside it is final), puts .bss at BSS_BASE and
   the runtime's symbols at addresses of their own (FUN_TABLE_BASE,
   QSTR_TABLE_BASE). What is left to fix at load time is then exactly the
   dynamic R_*_RELATIVE relocations: words holding an absolute address.
3. Each RELATIVE relocation becomes a relocation-stream entry, its
   destination (text, bss, mp_fun_table, qstr table) told by the address
   range the target falls in; the word keeps the offset from that base.
"""
from __future__ import annotations

import re
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elftools.elf.constants import SH_FLAGS
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection
from elftools.elf.sections import SymbolTableSection

from ..runtime import sources
from ..model.errors import ColibriError

ROOT = sources.root()  # the checkout, or the sources packaged with colibri
MODULE_DIR = ROOT / "micropython_module"
MODULE_SOURCE = MODULE_DIR / "colibri_mp.c"
NATMOD_DIR = MODULE_DIR / "natmod"
CORE_DIR = ROOT / "firmware" / "colibri_core"

MPY_VERSION = 6
MPY_SUB_VERSION = 3
SMALL_INT_BITS = 31  # the loader accepts anything up to its own (31 on 32-bit ports)
RAW_CODE_NATIVE_VIPER = 2  # kind field of a raw code: MP_CODE_NATIVE_VIPER - MP_CODE_BYTECODE

SCOPE_RELOCATIONS = 0x10
SCOPE_RODATA = 0x20
SCOPE_BSS = 0x40

# Link-time addresses: the image starts at 0; everything the loader provides
# gets a region of its own, so a RELATIVE relocation's target says what it is.
BSS_BASE = 0x1000_0000
FUN_TABLE_BASE = 0x2000_0000
QSTR_TABLE_BASE = 0x3000_0000
DYNAMIC_BASE = 0x4000_0000
FUN_TABLE_SLOTS = 87
# The loader puts the text in a heap block or executable pages: 16-byte aligned at least.
TEXT_ALIGN = 16

RUNTIME_SYMBOL = "mp_fun_table"
QSTR_SYMBOL_PREFIX = "mp_qstr_"
ENTRY_SYMBOL = "mpy_init"

ARCH_CODES = {
    "x86": 1, "x64": 2, "armv6": 3, "armv6m": 4, "armv7m": 5, "armv7em": 6,
    "armv7emsp": 7, "armv7emdp": 8, "xtensa": 9, "xtensawin": 10, "rv32imc": 11, "rv64imc": 12,
}
ARCH_NAMES = {code: name for name, code in ARCH_CODES.items()}


class LinkError(ColibriError):
    """The objects cannot make a working native module (each problem names symbol and object)."""

    def __init__(self, problems: Sequence[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class BuildError(ColibriError):
    """A compiler or the linker failed, or is not installed."""


# --------------------------------------------------------------------------- architectures

# Object relocations that stay correct in the contiguous image: PC-relative
# ones (fixed by ld), GOT ones (the GOT slot becomes a RELATIVE relocation)
# and word-sized absolute ones (which become RELATIVE relocations themselves).
_X64_RELOCS = {
    0: "R_X86_64_NONE", 1: "R_X86_64_64", 2: "R_X86_64_PC32", 4: "R_X86_64_PLT32",
    9: "R_X86_64_GOTPCREL", 24: "R_X86_64_PC64", 41: "R_X86_64_GOTPCRELX", 42: "R_X86_64_REX_GOTPCRELX",
}
_ARM_RELOCS = {
    0: "R_ARM_NONE", 2: "R_ARM_ABS32", 3: "R_ARM_REL32", 10: "R_ARM_THM_CALL", 11: "R_ARM_THM_PC8",
    24: "R_ARM_GOTOFF32", 25: "R_ARM_BASE_PREL", 26: "R_ARM_GOT_BREL", 30: "R_ARM_THM_JUMP24",
    40: "R_ARM_V4BX", 49: "R_ARM_THM_MOVW_PREL_NC", 50: "R_ARM_THM_MOVT_PREL", 51: "R_ARM_THM_JUMP19",
    53: "R_ARM_THM_ALU_PREL_11_0", 54: "R_ARM_THM_PC12", 96: "R_ARM_GOT_PREL",
    102: "R_ARM_THM_JUMP11", 103: "R_ARM_THM_JUMP8",
}


@dataclass(frozen=True)
class Arch:
    name: str
    machine: str                     # ELF e_machine
    word: int                        # bytes in a relocated word (the loader aligns .bss to this)
    cc: str
    ld: tuple[str, ...]
    cflags: tuple[str, ...]
    relative: int                    # the dynamic RELATIVE relocation type
    handled: dict[int, str]          # object relocation types accepted
    via_got: frozenset[int]          # of those, the ones reaching a symbol through the GOT
    absolute: frozenset[int]         # and the word-sized absolute ones
    # Links the compiler's support library (libgcc): what the C compiler calls on its own,
    # such as double arithmetic on a single-precision FPU. Only its members that the
    # objects reach are linked, and the image they make is checked like the rest.
    compiler_runtime: bool = False

    @property
    def code(self) -> int:
        return ARCH_CODES[self.name]


_COMMON_CFLAGS = (
    "-std=c11", "-O2", "-Wall", "-Wextra", "-Wdouble-promotion", "-Werror",
    # position independent; every global reached through the GOT
    "-fpic", "-fno-common",
    # the module runs inside the interpreter: no libc, no unwinder, no canaries
    "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
    # so the linker can drop what mpy_init does not reach
    "-ffunction-sections", "-fdata-sections",
    # math functions never set errno (sqrtf is the FPU instruction), and no
    # fused multiply-add: every architecture rounds like the x64 build
    "-fno-math-errno", "-ffp-contract=off",
)
_ARM_COMMON = ("-mthumb", "-mfloat-abi=hard", "-mabi=aapcs")

ARCHS: dict[str, Arch] = {
    "x64": Arch(
        "x64", "EM_X86_64", 8, "gcc", ("ld", "-m", "elf_x86_64"),
        _COMMON_CFLAGS + ("-mcmodel=small", "-fcf-protection=none", "-U_FORTIFY_SOURCE",
                          # structs in .bss aligned as the ABI says (8), not to 32 for vector loads
                          "-malign-data=abi",
                          # plain GOTPCREL: ld must not turn GOT loads of .bss into PC-relative leas
                          "-Wa,-mrelax-relocations=no",
                          # the reference kernels: the x86-64 backend's AVX constants want 32- and
                          # 64-byte aligned read-only data, and the loader aligns to 16
                          "-DCOLIBRI_KERNELS_REF",
                          # a MicroPython module stays as small as on the boards: the nibble CRC
                          "-DCOLIBRI_CRC_SLICING=0"),
        8, _X64_RELOCS, frozenset({9, 41, 42}), frozenset({1}),
    ),
    "armv7emsp": Arch(
        "armv7emsp", "EM_ARM", 4, "arm-none-eabi-gcc", ("arm-none-eabi-ld",),
        _COMMON_CFLAGS + _ARM_COMMON + ("-mcpu=cortex-m4", "-mfpu=fpv4-sp-d16"),
        23, _ARM_RELOCS, frozenset({26, 96}), frozenset({2}), compiler_runtime=True,
    ),
    "armv7emdp": Arch(
        "armv7emdp", "EM_ARM", 4, "arm-none-eabi-gcc", ("arm-none-eabi-ld",),
        _COMMON_CFLAGS + _ARM_COMMON + ("-mcpu=cortex-m7", "-mfpu=fpv5-d16"),
        23, _ARM_RELOCS, frozenset({26, 96}), frozenset({2}), compiler_runtime=True,
    ),
}


def get_arch(arch: str | Arch) -> Arch:
    if isinstance(arch, Arch):
        return arch
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"unknown native module architecture {arch!r}: one of {', '.join(ARCHS)}") from None


# --------------------------------------------------------------------------- .mpy encoding


def _vuint(value: int) -> bytes:
    """Big-endian base-128, high bit set on every byte but the last."""
    out = [value & 0x7F]
    value >>= 7
    while value:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    return bytes(reversed(out))


# Relocation destinations: (name, d). d 0/1/2 (text, rodata, bss) can carry a count.
DEST_TEXT, DEST_RODATA, DEST_BSS = "text", "rodata", "bss"
DEST_QSTR_TABLE, DEST_OBJ_TABLE, DEST_FUN_TABLE = "qstr_table", "obj_table", "fun_table"
_DEST_CODE = {DEST_TEXT: 0, DEST_RODATA: 1, DEST_BSS: 2, DEST_QSTR_TABLE: 6, DEST_OBJ_TABLE: 7, DEST_FUN_TABLE: 8}


@dataclass(frozen=True)
class Relocation:
    """One machine word the loader adjusts: word `word` of `section` += the address of `dest`.

    dest is "text", "rodata", "bss", "qstr_table", "obj_table", "fun_table" or
    "fun_table[i]" (the value of slot i)."""

    section: str  # "text" or "rodata"
    word: int
    dest: str


def encode_relocations(relocations: Iterable[Relocation]) -> bytes:
    """The relocation stream (without the final 0xFF), runs of consecutive words merged."""
    out = bytearray()
    items = sorted(relocations, key=lambda r: (r.section != "text", r.word))
    expected: tuple[str, int] | None = None  # the word the loader adjusts next without a location
    i = 0
    while i < len(items):
        r = items[i]
        run = 1
        countable = r.dest in (DEST_TEXT, DEST_RODATA, DEST_BSS)
        while (countable and i + run < len(items) and items[i + run].section == r.section
               and items[i + run].word == r.word + run and items[i + run].dest == r.dest):
            run += 1
        if r.dest.startswith("fun_table["):
            d = 9 + int(r.dest[len("fun_table["):-1])
        else:
            d = _DEST_CODE[r.dest]
        if countable:
            d = d << 1 | (run > 1)
        if d >= 127:  # op = d << 1 | location must stay below the 0xFF end marker
            raise ValueError(f"relocation destination {r.dest} does not fit the stream")
        has_location = expected != (r.section, r.word)
        out.append(d << 1 | has_location)
        if has_location:
            out += _vuint(r.word << 1 | (r.section == "rodata"))
        if countable and run > 1:
            out += _vuint(run)
        expected = (r.section, r.word + run)
        i += run
    return bytes(out)


def write_mpy(path: Path, arch: str | Arch, qstrs: Sequence[str], text: bytes, *, rodata: bytes = b"",
              bss_size: int = 0, relocations: Sequence[Relocation] = ()) -> int:
    """Writes a native .mpy; qstrs[0] is the source name. Returns the file size."""
    a = get_arch(arch)
    out = bytearray(b"M" + bytes([MPY_VERSION, a.code << 2 | MPY_SUB_VERSION, SMALL_INT_BITS]))
    out += _vuint(len(qstrs)) + _vuint(0)
    for q in qstrs:
        data = q.encode()
        out += _vuint(len(data) << 1) + data + b"\0"
    out += _vuint(len(text) << 3 | RAW_CODE_NATIVE_VIPER) + text
    flags = (SCOPE_RELOCATIONS if relocations else 0) | (SCOPE_RODATA if rodata else 0) | (SCOPE_BSS if bss_size else 0)
    out += _vuint(flags)
    # MicroPython's loader reads both sizes first (rodata's, then bss's), then the rodata bytes.
    if rodata:
        out += _vuint(len(rodata))
    if bss_size:
        out += _vuint(bss_size)
    out += rodata
    if relocations:
        out += encode_relocations(relocations) + b"\xff"
    path.write_bytes(out)
    return len(out)


@dataclass
class MpyFile:
    """A native .mpy, parsed."""

    version: int
    sub_version: int
    arch_code: int
    small_int_bits: int
    qstrs: list[str]
    kind: int                   # raw-code kind field (2: native viper)
    text: bytes
    scope_flags: int
    rodata: bytes
    bss_size: int
    relocations: list[Relocation] = field(default_factory=list)
    size: int = 0               # bytes in the file

    @property
    def arch(self) -> str:
        return ARCH_NAMES.get(self.arch_code, f"unknown({self.arch_code})")

    @property
    def text_size(self) -> int:
        return len(self.text)

    @property
    def rodata_size(self) -> int:
        return len(self.rodata)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ValueError("truncated .mpy file")
        self.pos += 1
        return self.data[self.pos - 1]

    def bytes(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated .mpy file")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def vuint(self) -> int:
        value = 0
        while True:
            b = self.byte()
            value = value << 7 | (b & 0x7F)
            if not b & 0x80:
                return value


def read_mpy(path: Path | str | bytes) -> MpyFile:
    """Parses a native .mpy as write_mpy lays it out (one native raw code, no objects)."""
    data = path if isinstance(path, bytes) else Path(path).read_bytes()
    r = _Reader(data)
    if r.bytes(1) != b"M":
        raise ValueError("not a .mpy file (no 'M' magic)")
    version, features, small_int_bits = r.byte(), r.byte(), r.byte()
    n_qstr, n_obj = r.vuint(), r.vuint()
    if n_obj:
        raise ValueError(f"{n_obj} constant objects: not a native module of this kind")
    qstrs = []
    for _ in range(n_qstr):
        head = r.vuint()
        if head & 1:
            raise ValueError("static qstr reference: not a native module of this kind")
        qstrs.append(r.bytes(head >> 1).decode())
        if r.byte() != 0:
            raise ValueError("qstr not NUL-terminated")
    head = r.vuint()
    kind, text_len = head & 0b11, head >> 3
    if head & 0b100:
        raise ValueError("raw code with children: not a native module of this kind")
    text = r.bytes(text_len)
    flags = r.vuint()
    rodata_size = r.vuint() if flags & SCOPE_RODATA else 0
    bss_size = r.vuint() if flags & SCOPE_BSS else 0
    rodata = r.bytes(rodata_size)
    relocations = _decode_relocations(r) if flags & SCOPE_RELOCATIONS else []
    if r.pos != len(data):
        raise ValueError(f"{len(data) - r.pos} bytes after the end of the module")
    return MpyFile(version, features & 3, features >> 2, small_int_bits, qstrs, kind, text, flags, rodata,
                   bss_size, relocations, len(data))


def _decode_relocations(r: _Reader) -> list[Relocation]:
    names = {v: k for k, v in _DEST_CODE.items()}
    out: list[Relocation] = []
    where: tuple[str, int] | None = None
    while (op := r.byte()) != 0xFF:
        if op & 1:
            loc = r.vuint()
            where = ("rodata" if loc & 1 else "text", loc >> 1)
        if where is None:
            raise ValueError("relocation stream adjusts a word before giving a location")
        d = op >> 1
        n = 1
        if d <= 5:
            if d & 1:
                n = r.vuint()
            dest = names[d >> 1]
        else:
            dest = names[d] if d <= 8 else f"fun_table[{d - 9}]"
        for _ in range(n):
            out.append(Relocation(where[0], where[1], dest))
            where = (where[0], where[1] + 1)
    return out


# --------------------------------------------------------------------------- object checks


def _reloc_name(arch: Arch, rtype: int) -> str:
    if rtype in arch.handled:
        return arch.handled[rtype]
    from elftools.elf.enums import ENUM_RELOC_TYPE_ARM, ENUM_RELOC_TYPE_x64

    table = ENUM_RELOC_TYPE_x64 if arch.machine == "EM_X86_64" else ENUM_RELOC_TYPE_ARM
    for name, value in table.items():
        if value == rtype and not name.startswith("_"):
            return name
    return f"relocation type {rtype}"


# Sections the linker script discards: their relocations do not matter.
_DISCARDED = (".eh_frame", ".ARM.exidx", ".ARM.extab", ".comment", ".note", ".debug", ".group")


def _discarded(name: str) -> bool:
    return name.startswith(_DISCARDED)


def _is_bss(section) -> bool:
    return section["sh_type"] == "SHT_NOBITS" and section["sh_flags"] & SH_FLAGS.SHF_ALLOC


@dataclass
class _ObjectInfo:
    defined: set[str]
    undefined: dict[str, None]  # ordered
    qstrs: list[str]


def _check_object(path: Path, arch: Arch, problems: list[str]) -> _ObjectInfo:
    name = path.name
    with path.open("rb") as f:
        try:
            elf = ELFFile(f)
        except Exception as exc:  # pyelftools raises several kinds
            problems.append(f"{name}: not an ELF object file ({exc})")
            return _ObjectInfo(set(), {}, [])
        if elf["e_type"] != "ET_REL":
            problems.append(f"{name}: not a relocatable object file (e_type {elf['e_type']})")
        if elf["e_machine"] != arch.machine or elf.elfclass != arch.word * 8:
            problems.append(f"{name}: built for {elf['e_machine']} ({elf.elfclass}-bit), not {arch.name}")
            return _ObjectInfo(set(), {}, [])

        sections = list(elf.iter_sections())
        symtab = next((s for s in sections if isinstance(s, SymbolTableSection)), None)
        symbols = list(symtab.iter_symbols()) if symtab else []

        def named(s) -> bool:
            """A C-level symbol: not a section, file or ARM mapping symbol ($a, $t, $d...)."""
            return bool(s.name) and not s.name.startswith("$") and s["st_info"]["type"] not in ("STT_SECTION", "STT_FILE")

        def symbols_in(index: int) -> list[str]:
            return [s.name for s in symbols if s["st_shndx"] == index and named(s)]

        def target_name(sym) -> str:
            """A relocation's target; a section symbol (how local variables are referenced) as its variable."""
            if named(sym):
                return sym.name
            shndx = sym["st_shndx"]
            if isinstance(shndx, int) and shndx:
                inside = symbols_in(shndx)
                return inside[0] if len(inside) == 1 else sections[shndx].name
            return sym.name or "?"

        # Sections: no initialised writable data, no thread-local storage.
        for index, sec in enumerate(sections):
            flags = sec["sh_flags"]
            if not flags & SH_FLAGS.SHF_ALLOC or _discarded(sec.name):
                continue
            what = ", ".join(repr(s) for s in symbols_in(index)) or f"section {sec.name}"
            if flags & SH_FLAGS.SHF_TLS:
                problems.append(f"{name}: thread-local variable {what} ({sec.name}): a native module has no "
                                "thread-local storage")
            elif flags & SH_FLAGS.SHF_WRITE and sec["sh_type"] != "SHT_NOBITS" and sec["sh_size"]:
                problems.append(f"{name}: writable initialised data {what} ({sec.name}, {sec['sh_size']} bytes): "
                                "a native module cannot carry .data; make it const, or zero-initialised and set "
                                "at run time")

        # .bss variables: global and default visibility only (those are reached through the GOT).
        reported: set[str] = set()
        for s in symbols:
            shndx = s["st_shndx"]
            if not isinstance(shndx, int) or not named(s):
                continue
            sec = sections[shndx]
            if not _is_bss(sec) or sec["sh_flags"] & SH_FLAGS.SHF_TLS:
                continue
            reported.add(s.name)
            if s["st_info"]["bind"] == "STB_LOCAL":
                problems.append(f"{name}: static .bss variable {s.name!r}: reached PC-relative, it would crash "
                                "once loaded (the loader places .bss apart from the code); make it a global")
            elif s["st_other"]["visibility"] != "STV_DEFAULT":
                problems.append(f"{name}: {s['st_other']['visibility'][4:].lower()} .bss variable {s.name!r}: "
                                "reached PC-relative, it would crash once loaded; give it default visibility")

        # Relocations: known types only, and .bss only through the GOT.
        for sec in sections:
            if not isinstance(sec, RelocationSection):
                continue
            target = sections[sec["sh_info"]]
            if not target["sh_flags"] & SH_FLAGS.SHF_ALLOC or _discarded(target.name):
                continue
            reloc_symtab = elf.get_section(sec["sh_link"])
            for rel in sec.iter_relocations():
                rtype = rel["r_info_type"]
                sym = reloc_symtab.get_symbol(rel["r_info_sym"])
                sym_name = target_name(sym)
                if rtype not in arch.handled:
                    problems.append(f"{name}: relocation {_reloc_name(arch, rtype)} against {sym_name!r} in "
                                    f"{target.name} is not supported in a native module (compile with -fpic)")
                    continue
                runtime = sym.name == RUNTIME_SYMBOL or sym.name.startswith(QSTR_SYMBOL_PREFIX)
                if runtime and rtype not in arch.via_got and rtype not in arch.absolute:
                    problems.append(f"{name}: {sym_name!r} is reached by {_reloc_name(arch, rtype)} from "
                                    f"{target.name}: the loader provides it, so only through the GOT (compile with -fpic)")
                shndx = sym["st_shndx"]
                if (isinstance(shndx, int) and shndx and _is_bss(sections[shndx]) and sym_name not in reported
                        and rtype not in arch.via_got and rtype not in arch.absolute):
                    reported.add(sym_name)
                    problems.append(f"{name}: .bss variable {sym_name!r} is reached by {_reloc_name(arch, rtype)} "
                                    f"from {target.name}, not through the GOT; it would crash once loaded")

        defined, undefined, qstrs = set(), {}, []
        for s in symbols:
            if not s.name or s["st_info"]["bind"] == "STB_LOCAL":
                continue
            if s["st_shndx"] == "SHN_UNDEF":
                undefined[s.name] = None
                if s.name.startswith(QSTR_SYMBOL_PREFIX):
                    qstrs.append(s.name[len(QSTR_SYMBOL_PREFIX):])
            else:
                defined.add(s.name)
        return _ObjectInfo(defined, undefined, qstrs)


# --------------------------------------------------------------------------- linking


def _linker_script(qstrs: Sequence[str], word: int) -> str:
    """qstrs are the module's names after the source name (qstr table index 1...)."""
    qstr_symbols = "\n".join(f"        {QSTR_SYMBOL_PREFIX}{q} = . + {2 * (i + 1)};" for i, q in enumerate(qstrs))
    return f"""\
/* Generated by colibri.target.natmod: one contiguous image (text, read-only data,
   GOT) at 0, so PC-relative references within it are final; .bss and the
   runtime's tables at addresses of their own, so each RELATIVE relocation's
   target tells the loader's base to add. */
ENTRY({ENTRY_SYMBOL})
SECTIONS
{{
    .text 0 : {{
        KEEP(*(.text.{ENTRY_SYMBOL}))
        *(.text .text.*)
    }}
    .rodata ALIGN({word}) : {{ *(.rodata .rodata.*) }}
    .got ALIGN({word}) : {{ *(.got.plt) *(.igot.plt) *(.got) *(.igot) }}

    .bss {BSS_BASE:#x} (NOLOAD) : {{ *(.bss .bss.*) *(COMMON) }}
    .mp_fun_table {FUN_TABLE_BASE:#x} (NOLOAD) : {{
        {RUNTIME_SYMBOL} = .;
        . += {FUN_TABLE_SLOTS * word};
    }}
    .mp_qstr_table {QSTR_TABLE_BASE:#x} (NOLOAD) : {{
{qstr_symbols}
        . += {2 * (len(qstrs) + 1)};
    }}

    .dynamic {DYNAMIC_BASE:#x} : {{ *(.dynamic) }}
    .dynsym : {{ *(.dynsym) }}
    .dynstr : {{ *(.dynstr) }}
    .hash : {{ *(.hash) }}
    .gnu.hash : {{ *(.gnu.hash) }}
    .rela.dyn : {{ *(.rela.*) }}
    .rel.dyn : {{ *(.rel.*) }}

    /DISCARD/ : {{
        *(.interp) *(.comment) *(.note .note.*) *(.eh_frame .eh_frame_hdr)
        *(.ARM.exidx .ARM.exidx.*) *(.ARM.extab .ARM.extab.*)
    }}
}}
"""


@dataclass
class LinkResult:
    path: Path
    size: int                  # bytes of the .mpy
    arch: str
    text_size: int             # code, read-only data and GOT
    bss_size: int
    qstrs: list[str]
    relocations: list[Relocation]


def link(objects: Sequence[Path], arch: str | Arch, out: Path, *, source_name: str | None = None,
         keep_elf: Path | None = None) -> LinkResult:
    """Links object files into a native .mpy, or raises LinkError listing every problem.

    Any objects will do, as long as one defines mpy_init (in .text.mpy_init)
    and together they follow the rules in the module docstring; the qstr table
    is every mp_qstr_<name> they reference, after `source_name` (default: the
    output's file name). keep_elf keeps the linked ELF (for objdump)."""
    a = get_arch(arch)
    objects = [Path(o) for o in objects]
    out = Path(out)
    problems: list[str] = []
    infos = [_check_object(o, a, problems) for o in objects]

    defined: dict[str, str] = {}
    for o, info in zip(objects, infos):
        for s in info.defined:
            defined.setdefault(s, o.name)
    libraries = _compiler_runtime(a) if a.compiler_runtime else []
    for lib in libraries:
        for s in _library_symbols(lib, a):
            defined.setdefault(s, lib.name)
    missing: dict[str, list[str]] = {}
    for o, info in zip(objects, infos):
        for s in info.undefined:
            if s in defined or s == RUNTIME_SYMBOL or s.startswith(QSTR_SYMBOL_PREFIX) or s == "_GLOBAL_OFFSET_TABLE_":
                continue
            missing.setdefault(s, []).append(o.name)
    for s, users in missing.items():
        problems.append(f"{', '.join(users)}: undefined symbol {s!r}: a native module links no library "
                        "(not libc, not libm; only the compiler's own support routines); define it in one of "
                        "the objects")
    if ENTRY_SYMBOL not in defined and not problems:
        problems.append(f"no object defines {ENTRY_SYMBOL}, the module's entry point "
                        f"({', '.join(o.name for o in objects)})")
    if problems:
        raise LinkError(list(dict.fromkeys(problems)))  # each once, in order

    qstrs = sorted({q for info in infos for q in info.qstrs})
    with tempfile.TemporaryDirectory(prefix="colibri-natmod-") as tmp:
        script = Path(tmp) / "natmod.ld"
        script.write_text(_linker_script(qstrs, a.word))
        elf_path = keep_elf or Path(tmp) / "module.elf"
        cmd = [*a.ld, "-pie", "--no-dynamic-linker", "-z", "norelro", "--no-relax", "--gc-sections",
               "--no-warn-rwx-segments", "-z", "notext", "-T", str(script), "-o", str(elf_path),
               *map(str, objects), *map(str, libraries)]
        _run(cmd, "link")
        text, bss_size, relocations = _image_from_elf(elf_path, a)

    names = [source_name or out.name, *qstrs]
    out.parent.mkdir(parents=True, exist_ok=True)
    size = write_mpy(out, a, names, text, bss_size=bss_size, relocations=relocations)
    return LinkResult(out, size, a.name, len(text), bss_size, names, relocations)


def _compiler_runtime(a: Arch) -> list[Path]:
    """The compiler's support library for the module's flags (libgcc.a of the matching multilib)."""
    try:
        r = subprocess.run([a.cc, *a.cflags, "-print-libgcc-file-name"], capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise BuildError(f"{a.cc} is not installed ({exc})") from None
    lib = Path(r.stdout.strip())
    if r.returncode or not lib.is_file():
        raise BuildError(f"{a.cc} names no support library for {a.name}: {r.stderr.strip() or r.stdout.strip()}")
    return [lib]


def _library_symbols(lib: Path, a: Arch) -> set[str]:
    """The global symbols an archive defines (binutils' nm, beside the arch's ld)."""
    nm = a.ld[0].removesuffix("ld") + "nm"
    try:
        r = subprocess.run([nm, "--defined-only", "--extern-only", "--format=posix", str(lib)],
                           capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise BuildError(f"{nm} is not installed ({exc})") from None
    if r.returncode:
        raise BuildError(f"{nm} {lib}: {r.stderr.strip()}")
    return {line.split()[0] for line in r.stdout.splitlines() if line and not line.endswith(":") and " " in line}


def _image_from_elf(elf_path: Path, a: Arch) -> tuple[bytes, int, list[Relocation]]:
    """The image bytes (relocated words holding offsets), .bss size and relocations of a linked ELF."""
    with elf_path.open("rb") as f:
        elf = ELFFile(f)
        image_sections, bss_size, bss_align, image_align = [], 0, 1, 1
        for sec in elf.iter_sections():
            if not sec["sh_flags"] & SH_FLAGS.SHF_ALLOC or not sec["sh_size"]:
                continue
            addr = sec["sh_addr"]
            if addr < BSS_BASE:
                if sec["sh_type"] == "SHT_NOBITS":
                    raise LinkError(f"unexpected zero-filled section {sec.name} in the image")
                if sec.name not in (".text", ".rodata", ".got"):
                    raise LinkError(f"unexpected section {sec.name} in the image (only code, read-only data and GOT)")
                image_sections.append(sec)
                image_align = max(image_align, sec["sh_addralign"])
            elif sec.name == ".bss":
                bss_size, bss_align = sec["sh_size"], sec["sh_addralign"]
        if bss_align > a.word:
            raise LinkError(f".bss needs {bss_align}-byte alignment; the loader aligns it to {a.word} "
                            "(an array or vector-aligned variable in .bss)")
        if image_align > TEXT_ALIGN:
            raise LinkError(f"the code or read-only data needs {image_align}-byte alignment; the loader "
                            f"guarantees {TEXT_ALIGN}")
        end = max((s["sh_addr"] + s["sh_size"] for s in image_sections), default=0)
        image = bytearray(end + (-end) % a.word)
        for sec in image_sections:
            image[sec["sh_addr"]:sec["sh_addr"] + sec["sh_size"]] = sec.data()

        symtab = elf.get_section_by_name(".symtab")
        entry = symtab.get_symbol_by_name(ENTRY_SYMBOL) if symtab else None
        if not entry or entry[0]["st_value"] & ~1:
            raise LinkError(f"{ENTRY_SYMBOL} is not at the start of the text (define it in .text.{ENTRY_SYMBOL})")

        fmt = "<Q" if a.word == 8 else "<I"
        relocations = []
        for sec in elf.iter_sections():
            if not isinstance(sec, RelocationSection) or not sec["sh_flags"] & SH_FLAGS.SHF_ALLOC:
                continue
            dynsym = elf.get_section(sec["sh_link"])
            for rel in sec.iter_relocations():
                offset, rtype = rel["r_offset"], rel["r_info_type"]
                if rtype != a.relative:
                    sym = dynsym.get_symbol(rel["r_info_sym"]).name if rel["r_info_sym"] else "?"
                    raise LinkError(f"the linked module needs {_reloc_name(a, rtype)} against {sym!r}, which the "
                                    "loader cannot apply (only addresses relative to the module are)")
                if offset % a.word or offset + a.word > len(image):
                    raise LinkError(f"relocated word at {offset:#x} is outside the image or misaligned")
                target = rel["r_addend"] if sec.is_RELA() else struct.unpack_from(fmt, image, offset)[0]
                dest, value = _classify(target, len(image), bss_size, a.word)
                struct.pack_into(fmt, image, offset, value)
                relocations.append(Relocation("text", offset // a.word, dest))
    return bytes(image), bss_size, relocations


def _classify(target: int, image_size: int, bss_size: int, word: int) -> tuple[str, int]:
    """Which loader base a link-time address is relative to, and the offset from it."""
    if 0 <= target <= image_size:
        return DEST_TEXT, target
    if BSS_BASE <= target <= BSS_BASE + bss_size:
        return DEST_BSS, target - BSS_BASE
    if FUN_TABLE_BASE <= target < FUN_TABLE_BASE + FUN_TABLE_SLOTS * word:
        return DEST_FUN_TABLE, target - FUN_TABLE_BASE
    if QSTR_TABLE_BASE <= target < DYNAMIC_BASE:
        return DEST_QSTR_TABLE, target - QSTR_TABLE_BASE
    raise LinkError(f"a relocated word points to {target:#x}, outside the module")


# --------------------------------------------------------------------------- building the colibri module


def _run(cmd: Sequence[str], what: str) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise BuildError(f"{what}: {cmd[0]} is not installed ({exc})") from None
    if r.returncode != 0:
        raise (LinkError if what == "link" else BuildError)(f"{what} failed: {' '.join(cmd)}\n{r.stderr.strip()}")


QSTR_HEADER = "mp_natmod_qstrs.h"
_QSTR_RE = re.compile(r"\bMP_QSTR_(\w+)")


def write_qstr_header(sources: Iterable[Path], out_dir: Path) -> list[str]:
    """Declares mp_qstr_<name> for every MP_QSTR_<name> in the sources; returns the names."""
    names = sorted({m for src in sources for m in _QSTR_RE.findall(Path(src).read_text())})
    lines = ["/* Generated by colibri.target.natmod from the module's sources: do not edit. */",
             "#ifndef MP_NATMOD_QSTRS_H", "#define MP_NATMOD_QSTRS_H", "#include <stdint.h>"]
    for n in names:
        lines += [f"extern const uint16_t {QSTR_SYMBOL_PREFIX}{n};",
                  f"#define MP_QSTR_{n} ((qstr){QSTR_SYMBOL_PREFIX}{n})"]
    lines.append("#endif")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / QSTR_HEADER).write_text("\n".join(lines) + "\n")
    return names


def compile_c(source: Path, arch: str | Arch, obj: Path, extra_flags: Sequence[str] = (),
              include_dirs: Sequence[Path] = ()) -> Path:
    """Compiles one C file with the native-module flags of `arch`."""
    a = get_arch(arch)
    obj.parent.mkdir(parents=True, exist_ok=True)
    includes = [*include_dirs, NATMOD_DIR]  # mp_natmod.h, the runtime header, for any module source
    cmd = [a.cc, *a.cflags, *extra_flags, *(f"-I{d}" for d in includes), "-c", str(source), "-o", str(obj)]
    _run(cmd, f"compile {source.name}")
    return obj


def engine_sources() -> list[Path]:
    lines = (CORE_DIR / "sources.txt").read_text().splitlines()
    return [CORE_DIR / ln.strip() for ln in lines if ln.strip()]


def build(arch: str | Arch, out: Path, build_dir: Path | None = None) -> LinkResult:
    """Compiles colibri_mp.c, the runtime support and the engine for `arch`; links them into `out`."""
    a = get_arch(arch)
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix=f"colibri-natmod-{a.name}-") as tmp:
        work = Path(build_dir) if build_dir else Path(tmp)
        genhdr = work / "genhdr"
        write_qstr_header([MODULE_SOURCE, NATMOD_DIR / "mp_natmod.h", NATMOD_DIR / "natmod_runtime.c"], genhdr)
        includes = [CORE_DIR / "include", CORE_DIR / "src", NATMOD_DIR, genhdr]
        module_flags = ["-DMICROPY_ENABLE_DYNRUNTIME=1"]
        units = [
            (MODULE_SOURCE, module_flags),
            (NATMOD_DIR / "natmod_runtime.c", module_flags + ["-ffreestanding", "-fno-builtin", "-fno-tree-loop-distribute-patterns"]),
            (NATMOD_DIR / "natmod_libm.c", ["-fno-builtin"]),
            *((src, ["-pedantic", "-Wshadow", "-Wconversion"]) for src in engine_sources()),
        ]
        objects = [compile_c(src, a, work / "obj" / f"{src.stem}.o", flags, includes) for src, flags in units]
        out.parent.mkdir(parents=True, exist_ok=True)
        return link(objects, a, out, keep_elf=work / "colibri.elf" if build_dir else None)
