"""Differential fuzzer: the C validator against the Python reader, under atheris.

    .venv/bin/python fuzz/differential.py [libFuzzer options] [corpus dirs]

Each input is an image (seeded from fuzz/corpus/differential: real exports of
every dtype and option, and format version 7 twins of some). The header CRC is rewritten over the mutated bytes
when image_size lies within the input, so mutations reach the table and
record checks instead of stopping at BAD_CRC (format v3 and later: the payload CRCs too). Then the engine
(`colibri.runtime._engine.validate`, the C code) and `colibri.image.read` (the
executable specification) must return the same status, at the full level and at the structure level
(`colibri.runtime._engine.validate_structure`, `image.status(check="structure")`); any disagreement, or
any exception from the reader other than a ColibriError, stops the run with
the input saved as a crash-* file. Coverage guidance is over the Python reader
(atheris instruments the colibri package).
"""
from __future__ import annotations

import sys
import zlib

import atheris
import numpy as np

with atheris.instrument_imports(include=["colibri"]):
    import colibri  # noqa: F401  (first import: the package gets instrumented)
    from colibri.runtime import _engine
    from colibri import image
    from colibri.model import format as F


def _fix_tensor_crcs(buf: bytearray, meta: int) -> None:
    """Format v3: each tensor's CRC table entry made right where the record, the entry and the
    payload lie inside the input (as fuzz/engine_fuzz.c), so mutations get past the payload CRCs."""
    n_t, t_off = int.from_bytes(buf[32:36], "little"), int.from_bytes(buf[36:40], "little")
    crc_off = int.from_bytes(buf[68:72], "little")
    record = F.tensor_record(int.from_bytes(buf[4:6], "little"))  # v7: 32 bytes, u64 offset and nbytes
    for i in range(min(n_t, 4096)):
        rec, slot = t_off + i * record.size, crc_off + 4 * i
        if rec + record.size > len(buf) or slot + 4 > meta or slot < F.HEADER_SIZE:
            return
        off, nbytes = record.unpack_from(buf, rec)[:2]
        if off + nbytes > len(buf) or off < meta:
            continue
        buf[slot : slot + 4] = (zlib.crc32(buf[off : off + nbytes]) & 0xFFFFFFFF).to_bytes(4, "little")


def fixed_crc(data: bytes) -> bytes:
    """The input with its CRCs made right, if its image_size (v3: meta_size) allows."""
    if len(data) < F.HEADER_SIZE:
        return data
    buf = bytearray(data)
    end = int.from_bytes(data[12:16], "little")
    if F.TENSOR_CRC_VERSION <= int.from_bytes(data[4:6], "little") <= F.MAX_READ_VERSION:  # v3 and later
        end = int.from_bytes(data[64:68], "little")
        if F.CRC_START <= end <= len(data):
            _fix_tensor_crcs(buf, end)
    if not F.CRC_START <= end <= len(data):
        return data
    buf[F.HEADER_CRC_OFFSET : F.HEADER_CRC_OFFSET + 4] = (
        zlib.crc32(buf[F.CRC_START : end]) & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(buf)


def changed_under_a_live_model(data: bytes) -> None:
    """A valid image whose buffer is overwritten under a live engine context, which reads it in
    place (docs/threading.md): bytes flipped where a generator seeded by the input says, then a
    forward pass, which may answer anything or fail with a status but must not crash."""
    buf = bytearray(data)
    try:
        ctx = _engine.Context(buf)
    except _engine.EngineError:
        return  # a payload CRC (format v3: the structure is sound, the full check is not)
    info = ctx.info()
    if info["arena_size"] > 16 << 20 or info["input_size"] > 4096 or info["output_size"] > 4096:
        return
    rows = min(info["max_batch"], 4)
    x = np.linspace(-2.0, 2.0, rows * info["input_size"], dtype=np.float32)
    out = np.empty(rows * info["output_size"], dtype=np.float32)
    ctx.forward(x, out, rows)
    rng = np.random.default_rng(zlib.crc32(data))
    at = rng.integers(0, len(buf), int(rng.integers(1, 64)))
    for i, v in zip(at, rng.integers(1, 256, len(at))):
        buf[int(i)] ^= int(v)
    try:
        ctx.forward(x, out, rows)
    except _engine.EngineError:
        pass


def test_one_input(data: bytes) -> None:
    data = fixed_crc(data)
    c = _engine.validate(data)
    py = image.status(data)
    if c != py:
        raise AssertionError(f"C validator {c}, Python reader {py}, image of {len(data)} bytes")
    if c == 0 and len(data) <= 1 << 20 and not image.read(data, check="structure").is_token_model:
        changed_under_a_live_model(data)
    # The structure level (a mapped file's open; format v3 leaves out the payload CRCs).
    c = _engine.validate_structure(data)
    py = image.status(data, check="structure")
    if c != py:
        raise AssertionError(f"structure level: C validator {c}, Python reader {py}, image of {len(data)} bytes")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
