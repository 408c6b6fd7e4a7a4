"""Tokenizer sections from a model folder's files, and library tokenizers from sections.

`from_folder(DIR)` reads `tokenizer.model` (SentencePiece, through the `sentencepiece` library and
its model proto) or else `tokenizer.json` (through `tokenizers`) and returns the
`TokenizerSection` the image carries (docs/lm.md "Tokenizer section"); what Colibri does not
carry is refused by name. `rebuild(section)` makes the `tokenizers.Tokenizer` or
`sentencepiece.SentencePieceProcessor` that encodes and decodes as the original did, from the
section alone.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..image.tokenizer_section import TokenizerSection
from ..model import format as F
from ..model.errors import ExportError
from ..model.format import NONE, Normalizer, PreTokenizer, TokenizerFlag, TokenizerKind, TokenType

# SentencePiece's piece types (sentencepiece_model.proto ModelProto.SentencePiece.Type) and ours.
_SP_TYPES = {1: TokenType.NORMAL, 2: TokenType.UNKNOWN, 3: TokenType.CONTROL, 4: TokenType.USER_DEFINED,
             5: TokenType.UNUSED, 6: TokenType.BYTE}
_SP_TYPE_OF = {v: k for k, v in _SP_TYPES.items()}
_SP_MODEL_TYPES = {1: TokenizerKind.SENTENCEPIECE_UNIGRAM, 2: TokenizerKind.SENTENCEPIECE_BPE}
SPACE = "\N{LOWER ONE EIGHTH BLOCK}"  # U+2581, SentencePiece's space


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: symbol -> byte (GPT-2's table, as `transformers` gives it)."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError as e:  # pragma: no cover - the tokenizer extra installs it
        raise ExportError("a byte-level BPE tokenizer section needs `transformers` "
                          "(pip install colibri-moe[tokenizer])") from e
    return {c: b for b, c in bytes_to_unicode().items()}


def _refuse(path: Path, what: str) -> None:
    raise ExportError(f"{path}: {what}; Colibri carries byte-level BPE (tokenizer.json) and SentencePiece "
                      "(tokenizer.model) tokenizers (docs/lm.md \"Tokenizer section\"); nothing written")


def _specials_from_config(folder: Path, section: TokenizerSection, by_text: dict[bytes, int]) -> None:
    """bos/eos/pad/unk from tokenizer_config.json (token text), else config.json (ids)."""
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        for name in ("bos", "eos", "pad", "unk"):
            v = cfg.get(f"{name}_token")
            text = v.get("content") if isinstance(v, dict) else v
            if isinstance(text, str) and text.encode() in by_text and getattr(section, name) is None:
                setattr(section, name, by_text[text.encode()])
    model_cfg = folder / "config.json"
    if model_cfg.is_file():
        cfg = json.loads(model_cfg.read_text())
        for name in ("bos", "eos", "pad"):
            v = cfg.get(f"{name}_token_id")
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int) and 0 <= v < section.vocab_size and getattr(section, name) is None:
                setattr(section, name, v)


def _split_then_byte_level(pre: dict) -> bool:
    """Sequence[Split(Regex, isolated, not inverted), ByteLevel(use_regex=False)]: the Qwen2 form."""
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) != 2:
        return False
    split, level = steps
    return (split.get("type") == "Split" and "Regex" in split.get("pattern", {})
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and level.get("type") == "ByteLevel" and not level.get("use_regex", True))


def from_tokenizer_json(path: str | Path) -> TokenizerSection:
    """A byte-level BPE `tokenizer.json`, read by `tokenizers` (its JSON as the library writes it)."""
    from tokenizers import Tokenizer

    path = Path(path)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise ExportError(f"{path} is not a Hugging Face tokenizers JSON file: {e}") from e
    spec = json.loads(tok.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        _refuse(path, f"tokenizer model {model.get('type')!r}")
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            _refuse(path, f"BPE option {option}={model[option]!r}")
    if model.get("byte_fallback"):
        _refuse(path, "BPE with byte_fallback (SentencePiece-style: give the folder's tokenizer.model)")
    normalizer = spec.get("normalizer")
    if normalizer is None:
        norm = Normalizer.NONE
    elif normalizer.get("type") == "NFC":
        norm = Normalizer.NFC
    else:
        _refuse(path, f"normalizer {normalizer.get('type')!r} (Colibri supports none and NFC)")
    flags = TokenizerFlag(0)
    pattern = ""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        kind_pre, level = PreTokenizer.BYTE_LEVEL, pre
    elif _split_then_byte_level(pre):
        kind_pre, level = PreTokenizer.SPLIT_BYTE_LEVEL, pre["pretokenizers"][1]
        pattern = pre["pretokenizers"][0]["pattern"]["Regex"]
        if pattern not in F.SPLIT_PATTERNS.values():  # the device's encoder implements these (docs/lm.md)
            _refuse(path, f"Split pattern {pattern[:80]!r}: the device encodes Qwen2's and Llama 3's "
                          f"({', '.join(F.SPLIT_PATTERNS)}) only")
    else:
        _refuse(path, f"pre-tokenizer {json.dumps(pre)[:120]} (Colibri supports ByteLevel with its regex, and "
                      "Split(regex, isolated) then ByteLevel without)")
    if level.get("add_prefix_space"):
        flags |= TokenizerFlag.ADD_PREFIX_SPACE
    if model.get("ignore_merges"):
        flags |= TokenizerFlag.IGNORE_MERGES
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        _refuse(path, f"decoder {decoder.get('type')!r} with a ByteLevel pre-tokenizer (ByteLevel expected)")
    to_byte = _byte_decoder()
    vocab: dict[str, int] = model["vocab"]
    added = spec.get("added_tokens") or []
    n = max([*vocab.values(), *(a["id"] for a in added)], default=-1) + 1
    tokens: list[bytes] = [b""] * n
    types = np.full(n, TokenType.UNUSED, np.uint8)
    for text, i in vocab.items():
        try:
            tokens[i] = bytes(to_byte[c] for c in text)
        except KeyError:
            _refuse(path, f"vocabulary entry {text!r} (id {i}) is not in the byte-level alphabet")
        types[i] = TokenType.NORMAL
    for a in added:
        for option in ("lstrip", "rstrip", "single_word"):
            if a.get(option):
                _refuse(path, f"added token {a['content']!r} with {option}")
        if a.get("normalized", not a.get("special")) != (not a.get("special")):
            _refuse(path, f"added token {a['content']!r} with normalized={a.get('normalized')} "
                          f"(special tokens unnormalized, others normalized)")
        tokens[a["id"]] = a["content"].encode("utf-8")  # added tokens decode to their text, not through ByteLevel
        types[a["id"]] = TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED
    unk = None
    if model.get("unk_token") is not None:
        unk = vocab.get(model["unk_token"])
        # an added token stays one (tokenizers matches it in the text, and skips a special one in decoding)
        if unk is not None and types[unk] == TokenType.NORMAL:
            types[unk] = TokenType.UNKNOWN
    merges = []
    for m in model.get("merges", []):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        ids = vocab.get(left), vocab.get(right), vocab.get(left + right)
        if None in ids:
            _refuse(path, f"merge {left!r} + {right!r} names a token the vocabulary lacks")
        merges.append(ids)
    byte_ids = np.full(F.TOKENIZER_BYTE_IDS, NONE, np.uint32)
    for c, b in to_byte.items():
        if c not in vocab:
            _refuse(path, f"the vocabulary lacks byte 0x{b:02x} ({c!r}): not a byte-level BPE")
        byte_ids[b] = vocab[c]
    section = TokenizerSection(
        kind=TokenizerKind.BYTE_BPE, tokens=tokens, types=types, flags=int(flags), normalizer=norm,
        pre_tokenizer=kind_pre, pattern=pattern, merges=np.asarray(merges, np.uint32).reshape(-1, 3),
        byte_ids=byte_ids, unk=unk)
    return section


def from_sentencepiece(path: str | Path) -> TokenizerSection:
    """A SentencePiece `tokenizer.model`, read through `sentencepiece`'s model proto."""
    from sentencepiece import sentencepiece_model_pb2

    path = Path(path)
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise ExportError(f"{path} is not a SentencePiece model: {e}") from e
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type not in _SP_MODEL_TYPES:
        _refuse(path, f"SentencePiece model type {trainer.model_type} (BPE = 2 and unigram = 1 are carried)")
    if norm.name not in ("identity", "") or norm.precompiled_charsmap or norm.normalization_rule_tsv:
        _refuse(path, f"SentencePiece normaliser {norm.name!r} (Colibri supports 'identity')")
    if proto.HasField("denormalizer_spec") and (proto.denormalizer_spec.precompiled_charsmap
                                                or proto.denormalizer_spec.normalization_rule_tsv):
        _refuse(path, "a SentencePiece denormaliser")
    if trainer.treat_whitespace_as_suffix or not norm.escape_whitespaces:
        _refuse(path, "SentencePiece whitespace as a suffix, or unescaped whitespace")
    if trainer.unk_surface.encode() != F.SENTENCEPIECE_UNKNOWN_SURFACE:
        _refuse(path, f"SentencePiece unk_surface {trainer.unk_surface!r} (the default ' \\u2047 ')")
    tokens, types, scores = [], [], []
    byte_ids = np.full(F.TOKENIZER_BYTE_IDS, NONE, np.uint32)
    for i, p in enumerate(proto.pieces):
        kind = _SP_TYPES.get(p.type)
        if kind is None:
            _refuse(path, f"piece {p.piece!r} of type {p.type}")
        if kind == TokenType.BYTE:
            value = int(p.piece[3:5], 16)  # "<0xNN>"
            tokens.append(bytes([value]))
            byte_ids[value] = i
        else:
            if " " in p.piece:  # the section's space is U+2581's: a raw one would encode as it
                _refuse(path, f"piece {p.piece!r} (id {i}) holds a raw space, which the section cannot tell "
                              "from U+2581")
            if kind == TokenType.UNUSED and trainer.model_type == 2:
                _refuse(path, f"unused piece {p.piece!r} (id {i}) in a BPE model: sentencepiece re-splits it "
                              "by the merges it took, which the device's encoder does not keep")
            tokens.append(p.piece.replace(SPACE, " ").encode("utf-8"))
        types.append(kind)
        scores.append(p.score)
    flags = TokenizerFlag(0)
    if norm.add_dummy_prefix:
        flags |= TokenizerFlag.ADD_DUMMY_PREFIX
    if norm.remove_extra_whitespaces:
        flags |= TokenizerFlag.REMOVE_EXTRA_WHITESPACES
    if trainer.byte_fallback:
        flags |= TokenizerFlag.BYTE_FALLBACK
        if np.any(byte_ids == NONE):
            _refuse(path, "byte fallback without all 256 <0xNN> pieces")
    else:
        byte_ids[:] = NONE

    def special(v: int) -> int | None:
        return v if 0 <= v < len(tokens) else None

    return TokenizerSection(
        kind=_SP_MODEL_TYPES[trainer.model_type], tokens=tokens, types=np.asarray(types, np.uint8), flags=int(flags),
        scores=np.asarray(scores, np.float32), byte_ids=byte_ids, bos=special(trainer.bos_id),
        eos=special(trainer.eos_id), pad=special(trainer.pad_id), unk=special(trainer.unk_id))


def from_folder(folder: str | Path) -> TokenizerSection | None:
    """The folder's tokenizer (tokenizer.model first: a SentencePiece model is its own reference,
    the tokenizer.json beside it a conversion), its special ids completed from tokenizer_config.json
    and config.json; None when the folder has neither file."""
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        section = from_sentencepiece(folder / "tokenizer.model")
    elif (folder / "tokenizer.json").is_file():
        section = from_tokenizer_json(folder / "tokenizer.json")
    else:
        return None
    _specials_from_config(folder, section, {t: i for i, t in enumerate(section.tokens)
                                            if section.types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED,
                                                                    TokenType.UNKNOWN)})
    return section


def from_spec(spec: str | Path | TokenizerSection) -> TokenizerSection:
    """A section from a model folder, a tokenizer.json, a SentencePiece .model file or a section."""
    if isinstance(spec, TokenizerSection):
        return spec
    path = Path(spec)
    if path.is_dir():
        section = from_folder(path)
        if section is None:
            raise ExportError(f"{path}: no tokenizer.model or tokenizer.json in the folder; nothing written")
        return section
    if not path.is_file():
        raise ExportError(f"{path}: no such tokenizer file or folder; nothing written")
    return from_sentencepiece(path) if path.suffix == ".model" else from_tokenizer_json(path)


def packed_for(spec: str | Path | TokenizerSection, vocab: int, where: str) -> bytes:
    """The packed section of `spec` for a model of `vocab` rows, refused before anything is written
    when it cannot be that model's (see `for_model`)."""
    from ..image.tokenizer_section import pack

    return pack(for_model(from_spec(spec), vocab, where))


def for_model(section: TokenizerSection, vocab: int, where: str) -> TokenizerSection:
    """The section padded to the model's `vocab` rows; a tokenizer with ids past them is refused
    (the model could not take them) before anything is written."""
    if section.vocab_size > vocab:
        raise ExportError(f"{where}: the tokenizer has {section.vocab_size} tokens but the model's embedding only "
                          f"{vocab} rows: it cannot be this model's tokenizer; nothing written")
    return section.padded(vocab)


class _Tokenizers:
    """A rebuilt `tokenizers.Tokenizer`: special tokens skipped in decoding, UNUSED ids dropped."""

    def __init__(self, tok, vocab: int) -> None:
        self._tok, self._vocab = tok, vocab

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _rebuild_byte_bpe(section: TokenizerSection) -> _Tokenizers:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_symbol = bytes_to_unicode()
    symbols = ["".join(to_symbol[b] for b in t) for t in section.tokens]
    types = section.types
    vocab = {symbols[i]: i for i in range(section.vocab_size) if types[i] in (TokenType.NORMAL, TokenType.UNKNOWN)}
    # Added tokens in the model's vocabulary too, by their text: add_tokens then keeps each at its id.
    added = [i for i in range(section.vocab_size) if types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)]
    vocab.update({section.tokens[i].decode("utf-8"): i for i in added})
    merges = [(symbols[left], symbols[right]) for left, right, _ in section.merges.tolist()]
    unk = None if section.unk is None else symbols[section.unk]
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                       ignore_merges=bool(section.flags & TokenizerFlag.IGNORE_MERGES))
    tok = Tokenizer(model)
    prefix = bool(section.flags & TokenizerFlag.ADD_PREFIX_SPACE)
    if section.pre_tokenizer == PreTokenizer.BYTE_LEVEL:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(section.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)])
    if section.normalizer == Normalizer.NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    for i in added:
        content = section.tokens[i].decode("utf-8")
        special = types[i] == TokenType.CONTROL
        tok.add_tokens([AddedToken(content, special=special, normalized=not special)])
        if tok.token_to_id(content) != i:
            raise ExportError(f"tokenizer section: added token {content!r} is id {i} but rebuilds as "
                              f"{tok.token_to_id(content)}")
    return _Tokenizers(tok, section.vocab_size)


def _rebuild_sentencepiece(section: TokenizerSection):
    from sentencepiece import sentencepiece_model_pb2

    from .tokenizer import SentencePieceTokenizer

    proto = sentencepiece_model_pb2.ModelProto()
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    trainer.model_type = {v: k for k, v in _SP_MODEL_TYPES.items()}[section.kind]
    trainer.byte_fallback = bool(section.flags & TokenizerFlag.BYTE_FALLBACK)
    trainer.unk_surface = F.SENTENCEPIECE_UNKNOWN_SURFACE.decode()
    trainer.vocab_size = section.vocab_size
    for name in ("bos", "eos", "pad", "unk"):
        setattr(trainer, f"{name}_id", -1 if getattr(section, name) is None else getattr(section, name))
    norm.name = "identity"
    norm.add_dummy_prefix = bool(section.flags & TokenizerFlag.ADD_DUMMY_PREFIX)
    norm.remove_extra_whitespaces = bool(section.flags & TokenizerFlag.REMOVE_EXTRA_WHITESPACES)
    norm.escape_whitespaces = True
    for i in range(_last_piece(section)):
        kind = TokenType(int(section.types[i]))
        piece = proto.pieces.add()
        if kind == TokenType.BYTE:
            piece.piece = f"<0x{section.tokens[i][0]:02X}>"
        else:
            piece.piece = section.tokens[i].decode("utf-8").replace(" ", SPACE)
        piece.score = float(section.scores[i])
        piece.type = _SP_TYPE_OF[kind]
    return SentencePieceTokenizer(proto.SerializeToString(), vocab_size=section.vocab_size)


def _last_piece(section: TokenizerSection) -> int:
    """One past the last id that is not padding: padding rows are UNUSED with no bytes (a
    SentencePiece UNUSED piece has its text)."""
    lengths = np.array([len(t) for t in section.tokens])
    used = np.nonzero((section.types != TokenType.UNUSED) | (lengths > 0))[0]
    return int(used[-1]) + 1 if len(used) else 0


def rebuild(section: TokenizerSection):
    """The library tokenizer that encodes and decodes as the section's original (see the module doc)."""
    if section.kind == TokenizerKind.BYTE_BPE:
        return _rebuild_byte_bpe(section)
    return _rebuild_sentencepiece(section)


class SectionTokenizer:
    """The tokenizer of an image's tokenizer section (format v6, docs/lm.md), rebuilt for the
    `tokenizers` library (byte-level BPE) or `sentencepiece` (SentencePiece), which encode and
    decode; nothing is tokenized by hand. Special (CONTROL) tokens decode to nothing, as on the
    device. `section` is the `TokenizerSection` (kind, special ids, token bytes)."""

    def __init__(self, section) -> None:
        self.section = section
        self.vocab_size = section.vocab_size
        self._lib = rebuild(section)

    @property
    def eos(self) -> int | None:
        return self.section.eos

    @property
    def bos(self) -> int | None:
        return self.section.bos

    def encode(self, text: str) -> list[int]:
        return self._lib.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._lib.decode(ids)
