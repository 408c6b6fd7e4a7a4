"""Reading a GGUF file's header and metadata through PyPI's `gguf` package (issue 26): the bounded
reader every GGUF path opens a file with, typed metadata access, and the tokenizer metadata
(`tokenizer_metadata`). `gguf_file` (the weights) and `gguf_tokenizer` (the tokenizer section) are
built on it.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..model.errors import ExportError, MissingExtraError


def _gguf():
    try:
        import gguf
    except ModuleNotFoundError as exc:
        if exc.name != "gguf":
            raise
        raise MissingExtraError("reading a GGUF file (colibri export model.gguf)", "gguf", "gguf") from exc
    return gguf


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ---------------------------------------------------------------------------
# The file: header, metadata and tensor infos through gguf.GGUFReader


# The gguf reader walks a metadata array element by element and reads past the end of the file
# without complaint (empty fields): a corrupt length then loops, and builds objects, that many times,
# until memory runs out. So every read must lie inside the file, and an array may hold at most this
# many elements: no tokenizer comes near (vocabularies and merge lists hold under 300 000 entries).
MAX_METADATA_ARRAY = 1 << 21


def _reader_class():
    gguf = _gguf()

    class BoundedReader(gguf.GGUFReader):
        """gguf.GGUFReader whose every read lies inside the file and whose arrays are bounded."""

        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > self.data.nbytes:
                raise ValueError(f"a field at byte {int(offset)} runs past the end of the file ({self.data.nbytes} "
                                 "bytes)")
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == gguf.GGUFValueType.ARRAY:
                count = int(self._get(orig_offs + 4, np.uint64)[0])
                if count > MAX_METADATA_ARRAY:
                    raise ValueError(f"a metadata array of {count} elements at byte {int(orig_offs)} (at most "
                                     f"{MAX_METADATA_ARRAY} are read)")
            return super()._get_field_parts(orig_offs, raw_type)

    return BoundedReader


def _open(path: Path):
    _gguf()
    if not path.is_file():
        raise ExportError(f"{path}: no such GGUF file")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):  # a corrupt offset overflows numpy's uint64
            warnings.simplefilter("ignore", RuntimeWarning)
            reader = _reader_class()(path, "r")
    except Exception as exc:  # the reader's own checks (ValueError, KeyError) and what bad bytes make numpy raise
        raise ExportError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {_one_line(exc)})") from None
    if reader.byte_order != "I":
        raise ExportError(f"{path}: a big-endian GGUF file; Colibri reads little-endian ones")
    return reader


class _Meta:
    """Typed access to the metadata: each key checked for the kind of value it must hold."""

    def __init__(self, path: Path, reader, arch: str = "GGUF") -> None:
        self.path, self.reader, self.arch = path, reader, arch
        self.gguf = _gguf()

    def field(self, key: str):
        return self.reader.fields.get(key)

    def _value(self, key: str):
        f = self.field(key)
        if f is None:
            return None
        try:
            return f.types, f.contents()
        except Exception as exc:  # a string that is not UTF-8, a field whose parts do not decode
            raise ExportError(f"{self.path}: metadata {key} cannot be read ({_one_line(exc)})") from None

    def integer(self, key: str, default: int | None = None, *, required: bool = False, minimum: int = 0) -> int | None:
        got = self._value(key)
        if got is None:
            if required:
                raise ExportError(f"{self.path}: no metadata {key} (a {self.arch} model has it)")
            return default
        types, value = got
        t = self.gguf.GGUFValueType
        ints = (t.UINT8, t.INT8, t.UINT16, t.INT16, t.UINT32, t.INT32, t.UINT64, t.INT64)
        if len(types) != 1 or types[0] not in ints:
            raise ExportError(f"{self.path}: metadata {key} is {_type_name(types)}, an integer is expected")
        if value < minimum:
            raise ExportError(f"{self.path}: metadata {key}={value}, at least {minimum} is expected")
        return int(value)

    def number(self, key: str, default: float | None = None, *, required: bool = False) -> float | None:
        got = self._value(key)
        if got is None:
            if required:
                raise ExportError(f"{self.path}: no metadata {key} (a {self.arch} model has it)")
            return default
        types, value = got
        t = self.gguf.GGUFValueType
        if len(types) != 1 or types[0] not in (t.FLOAT32, t.FLOAT64, t.UINT32, t.INT32, t.UINT64, t.INT64):
            raise ExportError(f"{self.path}: metadata {key} is {_type_name(types)}, a number is expected")
        if not math.isfinite(float(value)):
            raise ExportError(f"{self.path}: metadata {key}={value}, a finite number is expected")
        return float(value)

    def string(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        got = self._value(key)
        if got is None:
            if required:
                raise ExportError(f"{self.path}: no metadata {key}")
            return default
        types, value = got
        if types != [self.gguf.GGUFValueType.STRING]:
            raise ExportError(f"{self.path}: metadata {key} is {_type_name(types)}, a string is expected")
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        got = self._value(key)
        if got is None:
            return default
        types, value = got
        if types != [self.gguf.GGUFValueType.BOOL]:
            raise ExportError(f"{self.path}: metadata {key} is {_type_name(types)}, a bool is expected")
        return bool(value)

    def array_length(self, key: str) -> int | None:
        f = self.field(key)
        if f is None:
            return None
        if not f.types or f.types[0] != self.gguf.GGUFValueType.ARRAY:
            raise ExportError(f"{self.path}: metadata {key} is {_type_name(f.types)}, an array is expected")
        return len(f.data)


def _type_name(types) -> str:
    return "/".join(t.name.lower() for t in types) or "empty"

# ---------------------------------------------------------------------------
# Tokenizer metadata, for the image's tokenizer section


@dataclass
class GGUFTokenizer:
    """A GGUF's tokenizer.ggml.* metadata as stored: `model` is llama.cpp's kind ("llama":
    SentencePiece pieces with scores; "gpt2": byte-level BPE with merges; ...), `tokens` each token's
    UTF-8 bytes as the file holds them (SentencePiece's ▁ and <0xNN> pieces, GPT-2's byte-to-unicode
    characters: decoding them is the tokenizer's kind's business)."""

    model: str
    tokens: list[bytes]
    scores: list[float] | None = None
    token_types: list[int] | None = None  # llama.cpp's: 1 normal, 2 unknown, 3 control, 4 user, 5 unused, 6 byte
    merges: list[bytes] | None = None  # "left right" pairs, highest priority first
    pre: str | None = None  # the pre-tokeniser llama.cpp names (tokenizer.ggml.pre)
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, unknown, padding, seperator... -> id
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None
    add_space_prefix: bool | None = None  # SentencePiece: add_dummy_prefix
    remove_extra_whitespaces: bool | None = None  # SentencePiece's normaliser option
    precompiled_charsmap: int = 0  # bytes of a SentencePiece normaliser's character map (0: none)


def tokenizer_metadata(path: str | Path) -> GGUFTokenizer | None:
    """The file's tokenizer.ggml.* metadata, or None when it has no vocabulary; malformed entries
    (a wrong type, a length other than the vocabulary's, an id past it) are ExportErrors."""
    path = Path(path)
    reader = _open(path)
    gguf = _gguf()
    meta = _Meta(path, reader)
    t = gguf.GGUFValueType
    tokens_field = meta.field("tokenizer.ggml.tokens")
    if tokens_field is None:
        return None

    def array(key: str, want, convert):
        f = meta.field(key)
        if f is None:
            return None
        if len(f.types) != 2 or f.types[0] != t.ARRAY or f.types[1] not in want:
            raise ExportError(f"{path}: metadata {key} is {_type_name(f.types)}, an array of "
                              f"{'/'.join(w.name.lower() for w in want)} is expected")
        return [convert(f.parts[i]) for i in f.data]

    tokens = array("tokenizer.ggml.tokens", (t.STRING,), lambda p: bytes(p))
    n = len(tokens)
    scores = array("tokenizer.ggml.scores", (t.FLOAT32,), lambda p: float(p[0]))
    types = array("tokenizer.ggml.token_type", (t.INT32, t.UINT32), lambda p: int(p[0]))
    merges = array("tokenizer.ggml.merges", (t.STRING,), lambda p: bytes(p))
    for key, values in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
        if values is not None and len(values) != n:
            raise ExportError(f"{path}: metadata {key} holds {len(values)} entries for {n} tokens")
    special = {}
    for key in ("bos", "eos", "unknown", "padding", "seperator", "eot", "eom", "mask"):
        value = meta.integer(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            if value >= n:
                raise ExportError(f"{path}: metadata tokenizer.ggml.{key}_token_id={value} is past the {n} tokens")
            special[key] = value
    return GGUFTokenizer(
        model=meta.string("tokenizer.ggml.model", required=True), tokens=tokens, scores=scores, token_types=types,
        merges=merges, pre=meta.string("tokenizer.ggml.pre"), special=special,
        add_bos=meta.boolean("tokenizer.ggml.add_bos_token"), add_eos=meta.boolean("tokenizer.ggml.add_eos_token"),
        chat_template=meta.string("tokenizer.chat_template"),
        add_space_prefix=meta.boolean("tokenizer.ggml.add_space_prefix"),
        remove_extra_whitespaces=meta.boolean("tokenizer.ggml.remove_extra_whitespaces"),
        precompiled_charsmap=meta.array_length("tokenizer.ggml.precompiled_charsmap") or 0,
    )
