"""Differential fuzzer: the C validator against the Python reader, under atheris.

    .venv/bin/python fuzz/differential.py [libFuzzer options] [corpus dirs]

Each input is an image (seeded from fuzz/corpus/differential: real exports of
every dtype and option). The header CRC is rewritten over the mutated bytes
when image_size lies within the input, so mutations reach the table and
record checks instead of stopping at BAD_CRC. Then the engine
(`colibri._engine.validate`, the C code) and `colibri.image.read` (the
executable specification) must return the same status; any disagreement, or
any exception from the reader other than a ColibriError, stops the run with
the input saved as a crash-* file. Coverage guidance is over the Python reader
(atheris instruments the colibri package).
"""
from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["colibri"]):
    import colibri  # noqa: F401  (first import: the package gets instrumented)
    from colibri import _engine, image
    from colibri import format as F


def fixed_crc(data: bytes) -> bytes:
    """The input with its header CRC made right, if its image_size allows one."""
    if len(data) < F.HEADER_SIZE:
        return data
    size = int.from_bytes(data[12:16], "little")
    if not F.CRC_START <= size <= len(data):
        return data
    buf = bytearray(data)
    image.set_crc(buf)
    return bytes(buf)


def test_one_input(data: bytes) -> None:
    data = fixed_crc(data)
    c = _engine.validate(data)
    py = image.status(data)
    if c != py:
        raise AssertionError(f"C validator {c}, Python reader {py}, image of {len(data)} bytes")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
