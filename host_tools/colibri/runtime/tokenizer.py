"""Tokenizers for token models: text to ids and back, for `colibri generate`.

Two kinds behind one interface: the built-in byte-level tokenizer (a UTF-8 byte is its own
id, 0..255 — what examples/tiny_lm uses, so a device needs no tokenizer at all) and a
Hugging Face `tokenizers` JSON file read from disk. The engine sees only ids; the tokenizer
is the user's choice and must match the one the model was trained with.

Streaming: a model emits one token at a time, and one character may span several tokens
(a multi-byte UTF-8 sequence split across byte tokens, or byte-fallback pieces of a BPE).
`StreamDecoder` prints only the text that can no longer change, so a stream never shows a
half character or a replacement mark that a later token would have completed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the bytes of the text's UTF-8 encoding."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"byte-level ids are 0..255, got {int(bad[0])}")
        # Invalid UTF-8 (a model may emit any byte sequence) shows as U+FFFD rather than failing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (tokenizer.json), loaded from disk; nothing is downloaded."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # pragma: no cover - transformers depends on it, so the venv has it
            raise RuntimeError("a tokenizer JSON file needs the `tokenizers` package (pip install tokenizers)") from e
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {self.path}")
        try:
            self._tok = _Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own Exception subclass with the parse error
            raise ValueError(f"{self.path} is not a Hugging Face tokenizers JSON file: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # No special tokens added: the prompt is exactly the user's text.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=self.skip_special)

    skip_special = False  # a file given with --tokenizer shows its special tokens, as before


class SentencePieceTokenizer:
    """A SentencePiece model (tokenizer.model, or the proto a tokenizer section rebuilds), run by the
    `sentencepiece` library; `skip` ids (a padded vocabulary's UNUSED rows) decode to nothing."""

    def __init__(self, model_proto: bytes, vocab_size: int | None = None) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self._size = self._sp.get_piece_size()
        self.vocab_size = self._size if vocab_size is None else vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < self._size])


def load(spec: str) -> ByteTokenizer | HFTokenizer | SentencePieceTokenizer:
    """'byte' for the built-in byte-level tokenizer, else the path of a tokenizers JSON file or of a
    SentencePiece model (tokenizer.model)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".model"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        return SentencePieceTokenizer(path.read_bytes())
    return HFTokenizer(spec)


class StreamDecoder:
    """Incremental decoding: `push(id)` returns the text that token completes, `flush()` the rest.

    Text is decoded from all ids so far (tokenizers whose pieces depend on their neighbours,
    such as SentencePiece's leading-space handling, decode right only in context) and only the
    part past what was already emitted is returned. A trailing U+FFFD is held back: it is an
    incomplete UTF-8 sequence that the next token may complete. The concatenation of every
    push and the flush equals decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._emitted = 0  # characters of decode(ids) already returned

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        stable = len(text)
        # At most 3 replacement marks can be an unfinished 4-byte sequence's leading bytes.
        while stable > self._emitted and len(text) - stable < 3 and text[stable - 1] == REPLACEMENT:
            stable -= 1
        if stable <= self._emitted:
            return ""
        out = text[self._emitted:stable]
        self._emitted = stable
        return out

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        out = text[self._emitted:]
        self._emitted = len(text)
        return out
