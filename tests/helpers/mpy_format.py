"""A reader of MicroPython .mpy files that carry one native (viper) function, for the natmod tests.

It follows the order in which MicroPython's own loader consumes a file (py/persistentcode.c,
mpy version 6, sub-version 3) rather than colibri.target.natmod's reader, so that test_natmod compares two
readings of the format instead of one reading twice:

    header         'M', version, features = arch << 2 | sub-version (bit 0x40 of arch: a flags
                   uint follows), small-int bits
    tables         uint n_qstr, uint n_obj; each qstr as uint (len << 1), the bytes, a NUL
                   (len << 1 | 1 would name a static qstr instead)
    raw code       uint (length << 3 | has_children << 2 | kind - 2), the machine code, then for
                   viper a uint of scope flags; then the rodata size (flag 0x20) and the bss size
                   (flag 0x40), and only after both sizes the rodata bytes; children, if any
    relocations    (flag 0x10) op bytes until 0xFF, read as mp_native_relocate applies them

Anything the loader would refuse, or this reader cannot account for, raises MalformedMpy (an
AssertionError, so a test reading a bad file fails where it reads)."""
from __future__ import annotations

from dataclasses import dataclass, field

MPY_VERSION = 6
MPY_SUB_VERSION = 3
ARCH_HAS_FLAGS = 0x40  # in the features byte
CODE_BYTECODE, CODE_NATIVE_PY, CODE_NATIVE_VIPER, CODE_NATIVE_ASM = 2, 3, 4, 5  # MicroPython's MP_CODE_* kinds
FLAG_RELOCATIONS, FLAG_RODATA, FLAG_BSS = 0x10, 0x20, 0x40  # viper scope flags only a loaded .mpy carries
END_OF_RELOCATIONS = 0xFF
REGIONS = ("text", "rodata", "bss")  # op >> 2 of an op whose op >> 1 is at most 5
TABLES = {6: "qstr_table", 7: "obj_table", 8: "fun_table"}  # op >> 1; larger values name an mp_fun_table entry


class MalformedMpy(AssertionError):
    """The bytes are no native module MicroPython would load (or one with parts this reader skips)."""


@dataclass
class Mpy:
    arch: int
    small_int_bits: int
    qstrs: list[str]
    n_obj: int
    text: bytes
    scope_flags: int
    rodata_len: int = 0
    bss_len: int = 0
    # (destination, first word, in rodata?, words): one tuple per op of the relocation stream
    relocs: list[tuple[str, int, bool, int]] = field(default_factory=list)


class _Cursor:
    """The file as the loader's mp_reader_t sees it: one byte at a time, never past the end."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self.offset = 0

    @property
    def left(self) -> int:
        return len(self._view) - self.offset

    def read(self, count: int, what: str) -> bytes:
        if count > self.left:
            raise MalformedMpy(f"{what}: {count} bytes wanted at offset {self.offset}, {self.left} left")
        chunk = bytes(self._view[self.offset:self.offset + count])
        self.offset += count
        return chunk

    def u8(self, what: str) -> int:
        return self.read(1, what)[0]

    def uint(self, what: str) -> int:
        """MicroPython's variable-length unsigned: 7-bit groups, most significant first, every group but
        the last with the top bit set."""
        groups = []
        while True:
            b = self.u8(what)
            groups.append(b & 0x7F)
            if b < 0x80:
                break
        return sum(g << (7 * i) for i, g in enumerate(reversed(groups)))


def _relocations(cur: _Cursor) -> list[tuple[str, int, bool, int]]:
    """The stream as the loader walks it: an op with bit 0 set moves the pointer first (word index << 1,
    bit 0 choosing rodata over text), then op >> 1 picks what to add to that word (and the words after
    it, for a counted run); the pointer stays just past the last word adjusted."""
    runs = []
    pointer: tuple[int, bool] | None = None  # (word index, in rodata?)
    while True:
        op = cur.u8("relocation op")
        if op == END_OF_RELOCATIONS:
            return runs
        if op & 1:
            location = cur.uint("relocation location")
            pointer = (location >> 1, bool(location & 1))
        if pointer is None:
            raise MalformedMpy(f"relocation op {op:#04x} at offset {cur.offset - 1} before any location")
        code, words = op >> 1, 1
        if code <= 5:
            if code & 1:
                words = cur.uint("relocation count")
            destination = REGIONS[code >> 1]
        else:
            destination = TABLES.get(code, f"fun_table[{code - 9}]")
        word, in_rodata = pointer
        runs.append((destination, word, in_rodata, words))
        pointer = (word + words, in_rodata)


def parse_mpy(data: bytes) -> Mpy:
    """Reads a whole native module; every byte must be accounted for."""
    cur = _Cursor(data)
    magic, version, features, small_int_bits = cur.read(4, "header")
    if magic != ord("M"):
        raise MalformedMpy(f"magic {magic:#04x}, not 'M'")
    if version != MPY_VERSION:
        raise MalformedMpy(f"mpy version {version}, the loader reads {MPY_VERSION}")
    arch, sub_version = (features >> 2) & 0x2F, features & 3
    if features & ARCH_HAS_FLAGS:
        raise MalformedMpy("architecture flags present: no Cortex-M or x64 module carries them")
    if arch == 0:
        raise MalformedMpy("no architecture: bytecode, not a native module")
    if sub_version != MPY_SUB_VERSION:
        raise MalformedMpy(f"sub-version {sub_version}: the loader refuses native code of any but {MPY_SUB_VERSION}")

    n_qstr, n_obj = cur.uint("qstr count"), cur.uint("object count")
    qstrs = []
    for i in range(n_qstr):
        head = cur.uint(f"qstr {i} length")
        if head & 1:
            raise MalformedMpy(f"qstr {i} names static qstr {head >> 1}: a native module lists its own names")
        qstrs.append(cur.read(head >> 1, f"qstr {i}").decode("utf-8"))
        if cur.u8(f"qstr {i} terminator") != 0:
            raise MalformedMpy(f"qstr {i} ({qstrs[-1]!r}) is not NUL-terminated")
    if n_obj:
        raise MalformedMpy(f"{n_obj} constant objects: this reader does not decode the object table")

    head = cur.uint("raw code kind and length")
    kind, has_children, text_len = (head & 3) + CODE_BYTECODE, bool(head & 4), head >> 3
    if kind != CODE_NATIVE_VIPER:
        raise MalformedMpy(f"raw code of kind {kind}, not native viper ({CODE_NATIVE_VIPER})")
    text = cur.read(text_len, "machine code")
    scope_flags = cur.uint("scope flags")
    if scope_flags & ~(FLAG_RELOCATIONS | FLAG_RODATA | FLAG_BSS):
        raise MalformedMpy(f"unknown scope flags {scope_flags:#x}")
    rodata_len = cur.uint("rodata size") if scope_flags & FLAG_RODATA else 0
    bss_len = cur.uint("bss size") if scope_flags & FLAG_BSS else 0
    if scope_flags & FLAG_RODATA:
        cur.read(rodata_len, "rodata")
    if has_children:
        raise MalformedMpy("the raw code has children: a native module is one function")
    relocs = _relocations(cur) if scope_flags & FLAG_RELOCATIONS else []
    if cur.left:
        raise MalformedMpy(f"{cur.left} bytes after the end of the module")
    return Mpy(arch, small_int_bits, qstrs, n_obj, text, scope_flags, rodata_len, bss_len, relocs)
