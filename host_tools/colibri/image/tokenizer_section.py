"""The tokenizer section of a format-6 image (docs/lm.md "Tokenizer section"): `pack` lays it out,
`parse` validates it in the C validator's order (`colibri_tokenizer_check`, colibri_image.c) and
returns a view of it.

The section is what a device needs to turn ids into text and text into ids without parsing
anything into RAM: an 80-byte header, then arrays reached through offsets from the section's
start (token offsets into one bytes blob, a type per token, SentencePiece scores, byte-level BPE
merges with an index sorted by pair for binary search, the id of each single byte). Building one
from a `tokenizer.json` or `tokenizer.model` is `colibri.runtime.tokenizer`'s job; this module only
knows the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import format as F
from ..model.errors import error_for
from ..model.format import NONE, Normalizer, PreTokenizer, Status, TokenizerFlag, TokenizerKind, TokenType

_SENTENCEPIECE = (TokenizerKind.SENTENCEPIECE_BPE, TokenizerKind.SENTENCEPIECE_UNIGRAM)


@dataclass
class TokenizerSection:
    """One tokenizer, as the section holds it. `tokens[i]` are token i's bytes: byte-level BPE
    tokens byte-decoded, SentencePiece pieces with U+2581 as a space and <0xNN> pieces as their
    byte; CONTROL and UNKNOWN tokens keep their text (they decode by their type)."""

    kind: TokenizerKind
    tokens: list[bytes]
    types: np.ndarray  # u8 [vocab], TokenType
    flags: int = 0
    normalizer: Normalizer = Normalizer.NONE
    pre_tokenizer: PreTokenizer = PreTokenizer.NONE
    pattern: str = ""  # SPLIT_BYTE_LEVEL's regular expression
    scores: np.ndarray | None = None  # f32 [vocab], SentencePiece only
    merges: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.uint32))  # [M, 3] left, right, result
    byte_ids: np.ndarray = field(default_factory=lambda: np.full(F.TOKENIZER_BYTE_IDS, NONE, np.uint32))
    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    unk: int | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def is_sentencepiece(self) -> bool:
        return self.kind in _SENTENCEPIECE

    def specials(self) -> dict[str, int]:
        """The special ids the section names: {"bos": id, ...}, absent ones left out."""
        return {name: v for name in ("bos", "eos", "pad", "unk") if (v := getattr(self, name)) is not None}

    def summary(self) -> str:
        """One line: kind, tokens, special ids, e.g. `SentencePiece BPE, 32000 tokens, bos 1, eos 2`."""
        names = {TokenizerKind.BYTE_BPE: "byte-level BPE", TokenizerKind.SENTENCEPIECE_BPE: "SentencePiece BPE",
                 TokenizerKind.SENTENCEPIECE_UNIGRAM: "SentencePiece unigram"}
        unused = int(np.sum(self.types == TokenType.UNUSED))
        parts = [names[self.kind], f"{self.vocab_size} tokens" + (f" ({unused} unused)" if unused else "")]
        parts += [f"{name} {v} {self.tokens[v].decode('utf-8', 'replace')!r}" for name, v in self.specials().items()]
        if self.kind == TokenizerKind.BYTE_BPE:
            parts.append(f"{len(self.merges)} merges")
        return ", ".join(parts)

    def padded(self, vocab: int) -> TokenizerSection:
        """The section for a model of `vocab` embedding rows (>= this tokenizer's): the rows past it
        (a vocabulary padded to a multiple, as Qwen's) become UNUSED tokens, which decode to nothing."""
        extra = vocab - self.vocab_size
        if extra < 0:
            raise ValueError(f"the tokenizer has {self.vocab_size} tokens, more than the model's {vocab}")
        if extra == 0:
            return self
        scores = None if self.scores is None else np.concatenate([self.scores, np.zeros(extra, np.float32)])
        return TokenizerSection(
            kind=self.kind, tokens=self.tokens + [b""] * extra,
            types=np.concatenate([self.types, np.full(extra, TokenType.UNUSED, np.uint8)]),
            flags=self.flags, normalizer=self.normalizer, pre_tokenizer=self.pre_tokenizer, pattern=self.pattern,
            scores=scores, merges=self.merges, byte_ids=self.byte_ids,
            bos=self.bos, eos=self.eos, pad=self.pad, unk=self.unk)

    def piece(self, token: int) -> bytes:
        """What one token decodes to on its own, before SentencePiece's leading-space rule (the C
        engine's colibri_tokenizer_piece)."""
        kind = TokenType(int(self.types[token]))
        if kind in (TokenType.CONTROL, TokenType.UNUSED):
            return b""
        if kind == TokenType.UNKNOWN and self.is_sentencepiece:
            return F.SENTENCEPIECE_UNKNOWN_SURFACE
        return self.tokens[token]


def _up(n: int) -> int:
    return (n + F.TOKENIZER_ARRAY_ALIGN - 1) // F.TOKENIZER_ARRAY_ALIGN * F.TOKENIZER_ARRAY_ALIGN


def _id(v: int | None) -> int:
    return NONE if v is None else int(v)


def merge_order(merges: np.ndarray) -> np.ndarray:
    """Merge indices sorted by their (left, right) pair: the index a device binary-searches."""
    if len(merges) == 0:
        return np.zeros(0, np.uint32)
    return np.lexsort((merges[:, 1], merges[:, 0])).astype(np.uint32)


def token_index(tokens: list[bytes]) -> np.ndarray:
    """The ids sorted by their bytes, then by id (section version 2): what the encoder binary-searches
    for a piece by its bytes."""
    return np.asarray(sorted(range(len(tokens)), key=lambda i: (tokens[i], i)), np.uint32)


def pack(section: TokenizerSection) -> bytes:
    """The section's bytes (version 2): the header, then token offsets, token bytes, types, scores,
    merges, merge order, byte ids, the pattern and the token index, each at a multiple of 4 (an
    empty array at offset 0)."""
    vocab = section.vocab_size
    blob = b"".join(section.tokens)
    offsets = np.zeros(vocab + 1, np.uint32)
    np.cumsum([len(t) for t in section.tokens], out=offsets[1:])
    merges = np.ascontiguousarray(section.merges, dtype="<u4").reshape(-1, 3)
    pattern = section.pattern.encode("utf-8")
    arrays = [
        offsets.astype("<u4").tobytes(),
        blob,
        np.asarray(section.types, np.uint8).tobytes(),
        b"" if section.scores is None else np.asarray(section.scores, "<f4").tobytes(),
        merges.tobytes(),
        merge_order(merges).astype("<u4").tobytes(),
        np.asarray(section.byte_ids, "<u4").tobytes(),
        pattern,
        token_index(section.tokens).astype("<u4").tobytes(),
    ]
    at, pos = [], F.TOKENIZER_HEADER.size
    for a in arrays:
        if a:
            pos = _up(pos)
            at.append(pos)
            pos += len(a)
        else:
            at.append(0)
    buf = bytearray(_up(pos))
    for off, a in zip(at, arrays):
        buf[off : off + len(a)] = a
    F.TOKENIZER_HEADER.pack_into(
        buf, 0, F.TOKENIZER_MAGIC, F.TOKENIZER_SECTION_VERSION, int(section.kind), int(section.flags), vocab,
        len(merges),
        _id(section.bos), _id(section.eos), _id(section.pad), _id(section.unk),
        int(section.normalizer), int(section.pre_tokenizer), 0,
        at[0], at[1], len(blob), at[2], at[3], at[4], at[5], at[6], at[7], len(pattern), at[8])
    return bytes(buf)


def _bad(detail: str) -> None:
    raise error_for(Status.BAD_TOKENIZER, f"tokenizer section: {detail}")


def parse(data: bytes | bytearray | memoryview, vocab: int, work=None) -> TokenizerSection:
    """Validate a section against a model of `vocab` tokens (BAD_TOKENIZER for the first fault, in
    the order docs/lm.md gives and colibri_tokenizer_check follows) and return it."""
    buf = memoryview(data).cast("B")
    n = len(buf)
    if n < F.TOKENIZER_HEADER.size:
        _bad(f"{n} bytes, its header alone is {F.TOKENIZER_HEADER.size}")
    (magic, version, kind, flags, count, n_merges, bos, eos, pad, unk, normalizer, pre, reserved,
     offsets_at, bytes_at, bytes_size, types_at, scores_at, merges_at, order_at, byte_ids_at, pattern_at,
     pattern_size, index_at) = F.TOKENIZER_HEADER.unpack_from(buf, 0)
    if work is not None:
        work.visits += 1
    if magic != F.TOKENIZER_MAGIC or not F.TOKENIZER_SECTION_VERSION_MIN <= version <= F.TOKENIZER_SECTION_VERSION:
        _bad(f"magic 0x{magic:08x} version {version} (want 0x{F.TOKENIZER_MAGIC:08x} version "
             f"{F.TOKENIZER_SECTION_VERSION_MIN}..{F.TOKENIZER_SECTION_VERSION})")
    indexed = version >= F.TOKENIZER_INDEX_VERSION
    if kind not in iter(TokenizerKind):
        _bad(f"kind {kind}")
    kind = TokenizerKind(kind)
    sentencepiece = kind in _SENTENCEPIECE
    if flags & ~int(F.TOKENIZER_KIND_FLAGS[kind]):
        _bad(f"flags 0x{flags:02x} for {kind.name}")
    normalizers = (Normalizer.NONE,) if sentencepiece else (Normalizer.NONE, Normalizer.NFC)
    pres = (PreTokenizer.NONE,) if sentencepiece else (PreTokenizer.BYTE_LEVEL, PreTokenizer.SPLIT_BYTE_LEVEL)
    if normalizer not in normalizers or pre not in pres:
        _bad(f"normalizer {normalizer} / pre-tokenizer {pre} for {kind.name}")
    if reserved or (not indexed and index_at):
        _bad("reserved bytes set")
    if count != vocab:
        _bad(f"{count} tokens for a model of {vocab}")
    for name, v in (("bos", bos), ("eos", eos), ("pad", pad), ("unk", unk)):
        if v != NONE and v >= count:
            _bad(f"{name} id {v} outside the vocabulary 0..{count - 1}")
    if sentencepiece and n_merges:
        _bad(f"{n_merges} merges in a SentencePiece section")
    if (pattern_size != 0) != (pre == PreTokenizer.SPLIT_BYTE_LEVEL):
        _bad(f"a pattern of {pattern_size} bytes with pre-tokenizer {pre}")
    arrays = (("token offsets", offsets_at, 4 * (count + 1)), ("token bytes", bytes_at, bytes_size),
              ("types", types_at, count), ("scores", scores_at, 4 * count if sentencepiece else 0),
              ("merges", merges_at, 12 * n_merges), ("merge order", order_at, 4 * n_merges),
              ("byte ids", byte_ids_at, 4 * F.TOKENIZER_BYTE_IDS), ("pattern", pattern_at, pattern_size),
              ("token index", index_at, 4 * count if indexed else 0))
    for name, off, size in arrays:
        if size == 0:
            if off != 0:
                _bad(f"{name}: an empty array at offset {off} (0)")
        elif off % F.TOKENIZER_ARRAY_ALIGN or off < F.TOKENIZER_HEADER.size or off + size > n:
            _bad(f"{name} at {off} x {size} bytes outside the section of {n} (4-aligned, after the header)")
    offsets = np.frombuffer(buf, "<u4", count + 1, offsets_at)
    if work is not None:
        work.visits += count + 1
    if offsets[0] != 0 or np.any(np.diff(offsets.astype(np.int64)) < 0) or offsets[-1] != bytes_size:
        _bad(f"token offsets are not 0 .. {bytes_size} non-decreasing")
    types = np.frombuffer(buf, np.uint8, count, types_at)
    lengths = np.diff(offsets.astype(np.int64))
    if work is not None:
        work.visits += count
    known = (types >= TokenType.NORMAL) & (types <= TokenType.UNUSED)
    if not np.all(known):
        _bad(f"token {int(np.argmin(known))} has type {int(types[np.argmin(known)])}")
    is_byte = types == TokenType.BYTE
    if np.any(is_byte) and not (sentencepiece and flags & TokenizerFlag.BYTE_FALLBACK):
        _bad("BYTE tokens without SentencePiece byte fallback")
    if np.any(lengths[is_byte] != 1):
        _bad("a BYTE token is not one byte")
    scores = None
    if sentencepiece:
        scores = np.frombuffer(buf, "<f4", count, scores_at)
        if work is not None:
            work.visits += count
        if not np.all(np.isfinite(scores)):
            _bad("a score is not finite")
    merges = np.frombuffer(buf, "<u4", 3 * n_merges, merges_at).reshape(n_merges, 3) if n_merges else \
        np.zeros((0, 3), np.uint32)
    if n_merges:
        if work is not None:
            work.visits += 2 * n_merges
        if np.any(merges >= count):
            _bad("a merge names a token outside the vocabulary")
        order = np.frombuffer(buf, "<u4", n_merges, order_at)
        if np.any(order >= n_merges):
            _bad("the merge order names a merge past merge_count")
        keys = merges[order, 0].astype(np.uint64) << np.uint64(32) | merges[order, 1].astype(np.uint64)
        if len(keys) > 1 and np.any(keys[1:] <= keys[:-1]):
            _bad("the merge order is not strictly increasing by (left, right)")
    byte_ids = np.frombuffer(buf, "<u4", F.TOKENIZER_BYTE_IDS, byte_ids_at)
    if work is not None:
        work.visits += F.TOKENIZER_BYTE_IDS
    blob = bytes(buf[bytes_at : bytes_at + bytes_size]) if bytes_size else b""
    need = not sentencepiece or flags & TokenizerFlag.BYTE_FALLBACK
    for b, t in enumerate(byte_ids.tolist()):
        if not need:
            if t != NONE:
                _bad(f"byte {b} names token {t} without byte fallback")
            continue
        if t >= count or lengths[t] != 1 or blob[offsets[t]] != b or (sentencepiece and types[t] != TokenType.BYTE):
            _bad(f"byte 0x{b:02x}: token {t} is not that byte")
    pattern = ""
    if pattern_size:
        try:
            pattern = bytes(buf[pattern_at : pattern_at + pattern_size]).decode("utf-8")
        except UnicodeDecodeError:
            _bad("the pattern is not UTF-8")
        if work is not None:
            work.visits += 1
    tokens = [blob[offsets[i] : offsets[i + 1]] for i in range(count)]
    if indexed and count:
        index = np.frombuffer(buf, "<u4", count, index_at)
        if work is not None:
            work.visits += count
        if np.any(index >= count):
            _bad("the token index names a token past the vocabulary")
        keys = [(tokens[i], i) for i in index.tolist()]
        if any(b <= a for a, b in zip(keys, keys[1:])):
            _bad("the token index is not strictly increasing by (bytes, id)")

    def special(v: int) -> int | None:
        return None if v == NONE else int(v)

    return TokenizerSection(
        kind=kind, tokens=tokens, types=types.copy(), flags=flags, normalizer=Normalizer(normalizer),
        pre_tokenizer=PreTokenizer(pre), pattern=pattern, scores=None if scores is None else scores.copy(),
        merges=merges.copy(), byte_ids=byte_ids.copy(), bos=special(bos), eos=special(eos), pad=special(pad),
        unk=special(unk))



def find(image: bytes | bytearray | memoryview) -> bytes | None:
    """The tokenizer section's bytes in a validated image (its TOKENIZER tensor), without reading
    the rest of it into a graph; None when it has none."""
    buf = memoryview(image).cast("B")
    if int.from_bytes(buf[4:6], "little") < F.TOKENIZER_VERSION:
        return None
    count, table = F.HEADER.unpack_from(buf, 0)[9:11]
    for i in range(count):
        off, nbytes, _, _, dtype, *_ = F.TENSOR.unpack_from(buf, table + i * F.TENSOR.size)
        if dtype == F.DType.TOKENIZER:
            return bytes(buf[off : off + nbytes])
    return None
