"""Format version 6, the tokenizer section (docs/lm.md "Tokenizer section"): its layout, the round
trip through the writer and reader, and every fault the C validator and `image.read` refuse, status
for status, named and by structured mutation of the section's bytes."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from colibri import image
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.format import DType, Status, TokenizerFlag, TokenType
from colibri.runtime import _engine, tokenizer_build
from helpers import lmmodels
from helpers import tokenizers_trained as trained


@pytest.fixture(scope="module")
def sections(tmp_path_factory) -> dict[str, TS.TokenizerSection]:
    root = tmp_path_factory.mktemp("tok")
    trained.byte_bpe(root / "bpe")
    trained.sentencepiece_model(root / "sp")
    return {"bpe": tokenizer_build.from_folder(root / "bpe"), "sp": tokenizer_build.from_folder(root / "sp")}


def _image(section: TS.TokenizerSection, pad: int = 0, **model) -> bytes:
    g = lmmodels.token_model(0, vocab=section.vocab_size + pad, **model)
    g.tokenizer = TS.pack(section.padded(g.vocab_size))
    return image.write(g)


def _section_at(data: bytes) -> tuple[int, int]:
    """(offset, nbytes) of the TOKENIZER tensor's payload."""
    n_t, t_off = F.HEADER.unpack_from(data, 0)[9:11]
    for i in range(n_t):
        off, nbytes, _, _, dtype, *_ = F.TENSOR.unpack_from(data, t_off + i * F.TENSOR.size)
        if dtype == DType.TOKENIZER:
            return off, nbytes
    raise AssertionError("no tokenizer section")


def _statuses(data: bytes) -> tuple[int, int]:
    """(C validator, Python reader), at the full level."""
    return _engine.validate(data), image.status(data)


def _edit_section(data: bytes, at: int, fmt: str, *values) -> bytes:
    """The image with bytes of its section rewritten and every CRC made right again."""
    buf = bytearray(data)
    off, _ = _section_at(data)
    struct.pack_into(fmt, buf, off + at, *values)
    image.set_tensor_crcs(buf)
    return bytes(buf)


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_round_trip(sections, kind: str) -> None:
    section = sections[kind]
    data = _image(section, pad=3)
    assert data[4] == F.TOKENIZER_VERSION
    assert _statuses(data) == (0, 0)
    back = image.read(data)
    assert image.write(back) == data  # a read graph writes the same bytes
    got = TS.parse(back.tokenizer, back.vocab_size)
    assert got.tokens[: section.vocab_size] == section.tokens and got.tokens[section.vocab_size :] == [b""] * 3
    assert list(got.types[section.vocab_size :]) == [TokenType.UNUSED] * 3
    assert got.specials() == section.specials() and got.kind == section.kind and got.flags == section.flags
    np.testing.assert_array_equal(got.merges, section.merges)
    np.testing.assert_array_equal(got.byte_ids, section.byte_ids)
    # the section is the last payload; its record is a byte vector, no layer names it
    n_t, t_off = F.HEADER.unpack_from(data, 0)[9:11]
    off, nbytes, rows, cols, dtype, ndim, _, aux = F.TENSOR.unpack_from(data, t_off + (n_t - 1) * F.TENSOR.size)
    assert (dtype, rows, cols, ndim, aux, nbytes) == (DType.TOKENIZER, nbytes, 1, 1, F.NONE, len(back.tokenizer))


def test_layout_is_offsets_into_the_section(sections) -> None:
    """Arrays 4-aligned after the 80-byte header: a device indexes them in place."""
    packed = TS.pack(sections["bpe"])
    fields = F.TOKENIZER_HEADER.unpack_from(packed, 0)
    assert F.TOKENIZER_HEADER.size == 80 and fields[0] == F.TOKENIZER_MAGIC
    offsets_at, bytes_at = fields[13], fields[14]
    offsets = np.frombuffer(packed, "<u4", sections["bpe"].vocab_size + 1, offsets_at)
    for i in (0, 100, sections["bpe"].vocab_size - 1):
        assert packed[bytes_at + offsets[i] : bytes_at + offsets[i + 1]] == sections["bpe"].tokens[i]
    assert all(fields[f] % 4 == 0 for f in (13, 14, 16, 17, 18, 19, 20, 21))


def test_writer_rules(sections) -> None:
    g = lmmodels.token_model(0, vocab=sections["bpe"].vocab_size)
    g.tokenizer = TS.pack(sections["bpe"])
    with pytest.raises(ValueError, match="format version 6"):
        image.write(g, version=F.LM_VERSION)
    g.tokenizer = None
    with pytest.raises(ValueError, match="only with a tokenizer section"):
        image.write(g, version=F.TOKENIZER_VERSION)
    assert image.write(g)[4] == F.LM_VERSION  # without a section: what older engines read


# (what, offset in the section, struct format, value) of header faults, each BAD_TOKENIZER.
HEADER_FAULTS = [
    ("magic", 0, "<I", 0x4B544C44),
    ("section version past the newest", 4, "<H", F.TOKENIZER_SECTION_VERSION + 1),
    ("section version 0", 4, "<H", 0),
    ("kind 0", 6, "<B", 0),
    ("kind 4", 6, "<B", 4),
    ("SentencePiece flag on BPE", 7, "<B", int(TokenizerFlag.BYTE_FALLBACK)),
    ("unknown flag", 7, "<B", 0x80),
    ("vocab_count", 8, "<I", 5),
    ("merges past the table", 12, "<I", 10**6),
    ("bos out of range", 16, "<I", 10**6),
    ("eos out of range", 20, "<I", 10**6),
    ("normalizer", 32, "<B", 7),
    ("pre-tokenizer none", 33, "<B", 0),
    ("reserved u16", 34, "<H", 1),
    ("token offsets misaligned", 36, "<I", 82),
    ("token offsets inside the header", 36, "<I", 4),
    ("bytes past the section", 44, "<I", 10**7),
    ("scores on BPE", 52, "<I", 80),
    ("byte ids past the section", 64, "<I", 0xFFFFFFF0),
    ("a pattern without the split kind", 72, "<I", 4),
    ("token index misaligned", 76, "<I", 1),
]


@pytest.mark.parametrize("what,at,fmt,value", HEADER_FAULTS, ids=[f[0] for f in HEADER_FAULTS])
def test_header_faults(sections, what: str, at: int, fmt: str, value: int) -> None:
    data = _edit_section(_image(sections["bpe"]), at, fmt, value)
    assert _statuses(data) == (Status.BAD_TOKENIZER, Status.BAD_TOKENIZER), what


def _array_at(data: bytes, field: int) -> int:
    off, _ = _section_at(data)
    return F.TOKENIZER_HEADER.unpack_from(data, off)[field]


def test_array_faults(sections) -> None:
    """Token offsets, types, scores, merges, merge order and byte ids, each broken once."""
    bpe, sp = _image(sections["bpe"]), _image(sections["sp"])
    n = sections["bpe"].vocab_size
    offsets, types, merges, order, byte_ids = (_array_at(bpe, f) for f in (13, 16, 18, 19, 20))
    sp_scores, sp_types, sp_bytes = _array_at(sp, 17), _array_at(sp, 16), _array_at(sp, 20)
    faults = [
        (bpe, offsets, "<I", 1),  # offsets[0] != 0
        (bpe, offsets + 4 * 10, "<I", 0xFFFF),  # not non-decreasing
        (bpe, types + 5, "<B", 0),  # unknown type
        (bpe, types + 5, "<B", 7),
        (bpe, types + 300, "<B", int(TokenType.BYTE)),  # BYTE without SentencePiece byte fallback
        (bpe, merges, "<I", n),  # a merge naming a token past the vocabulary
        (bpe, order, "<I", 10**6),  # the order names no merge
        (bpe, order + 4, "<I", struct.unpack_from("<I", bpe, order)[0]),  # not a permutation
        (bpe, byte_ids + 4 * 65, "<I", n + 1),  # a byte id outside the vocabulary
        (bpe, byte_ids + 4 * 65, "<I", struct.unpack_from("<I", bpe, byte_ids + 4 * 66)[0]),  # the wrong byte
        (sp, sp_scores + 4 * 7, "<f", float("nan")),
        (sp, sp_scores + 4 * 7, "<f", float("inf")),
        (sp, sp_bytes + 4 * 3, "<I", 0),  # byte fallback: <0x03> is not token 0
        (sp, sp_types + 500, "<B", int(TokenType.BYTE)),  # a BYTE piece of more than one byte
    ]
    for data, at, fmt, value in faults:
        assert _statuses(_edit_section(data, at, fmt, value)) == (Status.BAD_TOKENIZER,) * 2, (at, value)


def test_pattern_must_be_utf8(tmp_path) -> None:
    trained.byte_bpe(tmp_path, regex_split=F.QWEN2_PATTERN)
    section = tokenizer_build.from_folder(tmp_path)
    assert section.pre_tokenizer == F.PreTokenizer.SPLIT_BYTE_LEVEL
    data = _image(section)
    assert _statuses(data) == (0, 0)
    pattern = _array_at(data, 21)
    for bad in (b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"):  # overlong, surrogate, > U+10FFFF
        edited = _edit_section(data, pattern, f"{len(bad)}s", bad)
        assert _statuses(edited) == (Status.BAD_TOKENIZER,) * 2, bad


def test_tensor_record_rules(sections) -> None:
    data = _image(sections["bpe"])
    n_t, t_off = F.HEADER.unpack_from(data, 0)[9:11]
    last = t_off + (n_t - 1) * F.TENSOR.size

    def record(at: int, fmt: str, value: int, version: int | None = None) -> bytes:
        buf = bytearray(data)
        struct.pack_into(fmt, buf, last + at, value)
        if version is not None:
            struct.pack_into("<H", buf, 4, version)
        image.set_tensor_crcs(buf)
        return bytes(buf)

    assert _statuses(record(8, "<I", 7)) == (Status.BAD_TENSOR,) * 2  # rows != nbytes
    assert _statuses(record(17, "<B", 2)) == (Status.BAD_TENSOR,) * 2  # ndim 2 with cols 1
    assert _statuses(record(20, "<I", 0)) == (Status.BAD_TENSOR,) * 2  # an aux companion
    # a version-5 image knows no TOKENIZER dtype
    assert _statuses(record(16, "<B", int(DType.TOKENIZER), F.Q4_VERSION)) == (Status.BAD_TENSOR,) * 2
    # a second section: the table's last-but-one tensor (a vector) relabelled
    buf = bytearray(data)
    prev = last - F.TENSOR.size
    nbytes = struct.unpack_from("<I", buf, prev + 4)[0]
    struct.pack_into("<IIBB", buf, prev + 8, nbytes, 1, int(DType.TOKENIZER), 1)
    image.set_tensor_crcs(buf)
    assert _statuses(bytes(buf)) == (Status.BAD_TENSOR,) * 2
    # a layer naming the section: BAD_REF (no layer reads it)
    n_l, l_off = F.HEADER.unpack_from(data, 0)[11:13]
    buf = bytearray(data)
    struct.pack_into("<I", buf, l_off + (n_l - 1) * F.LAYER.size + 12, n_t - 1)  # the head's weight
    image.set_crc(buf)
    assert _statuses(bytes(buf)) == (Status.BAD_REF,) * 2


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_section_mutations_agree(sections, kind: str) -> None:
    """Structured mutation of the section (every header byte with several flips, then seeded random
    bytes over its arrays), the CRCs made right each time: the C validator and image.read give the
    same status, and the sweep reaches BAD_TOKENIZER as well as images that stay valid."""
    data = _image(sections[kind], pad=2)
    off, nbytes = _section_at(data)
    rng = np.random.default_rng(26)
    spots = [(at, flip) for at in range(F.TOKENIZER_HEADER.size) for flip in (0x01, 0x10, 0x80, 0xFF)]
    spots += [(int(at), int(flip)) for at, flip in zip(rng.integers(F.TOKENIZER_HEADER.size, nbytes, 600),
                                                       rng.integers(1, 256, 600))]
    seen = set()
    for at, flip in spots:
        buf = bytearray(data)
        buf[off + at] ^= flip
        image.set_tensor_crcs(buf)
        c, py = _statuses(bytes(buf))
        assert c == py == _engine.validate_structure(bytes(buf)) == image.status(bytes(buf), check="structure"), \
            (at, flip, c, py)
        seen.add(c)
    assert Status.BAD_TOKENIZER in seen and 0 in seen
