"""A GGUF file's tokenizer metadata -> the image's tokenizer section (issue 26; docs/export.md "GGUF files").

A GGUF holds no tokenizer.json or tokenizer.model: llama.cpp's converter writes the vocabulary, the
scores or merges and the special ids as `tokenizer.ggml.*` metadata (read by
`gguf_reader.tokenizer_metadata`). Each kind Colibri carries is handed, in the form its library
reads, to the folder path's section builder (`runtime.tokenizer_build`), so a GGUF and the folder
it was converted from give the same section where the two agree:

- `llama` (SentencePiece). A GGUF's pieces, scores and token types are SentencePiece's own model
  fields (the same type numbering), so they become a SentencePiece model proto
  (`sentencepiece_model_pb2`, the library's format) read by `tokenizer_build.from_sentencepiece`
  as a tokenizer.model is. Its model type is BPE whatever the original was trained as: llama.cpp
  tokenizes every `llama` vocabulary by merging the best-scored pair of pieces first, which is
  SentencePiece BPE, so a unigram model is run as BPE once it is a GGUF, by llama.cpp and by
  Colibri. The normaliser is identity with `add_space_prefix` (llama.cpp's default: true); extra
  whitespace is kept, as llama.cpp keeps it for this kind (`remove_extra_whitespaces` is read by
  its unigram tokenizer only); a precompiled character map is refused. Byte
  fallback holds when the 256 `<0xNN>` byte pieces are all there, as llama.cpp falls back to
  them whenever they are. transformers' GGUF converter is not used for this kind: it rebuilds
  SentencePiece as a byte-fallback BPE tokenizer.json, which the section does not carry.
- `gpt2` (byte-level BPE). transformers' GGUF tokenizer conversion
  (`transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`) builds the
  `tokenizers` fast tokenizer, whose JSON `tokenizer_build.from_tokenizer_json` reads. A GGUF names
  its pre-tokenizer (`tokenizer.ggml.pre`) instead of holding its regular expression; only the
  names in `PRE_TOKENIZERS`, whose expression llama.cpp and that conversion agree on, are taken.
  Three things are completed in the converted JSON: Llama 3's `llama-bpe` gets `ignore_merges`,
  which llama.cpp sets for it (and Llama 3's tokenizer.json holds) and the conversion leaves
  out; the tokens the file marks control or user-defined that the conversion leaves out of its
  added tokens (a user-defined token with a space, say) are added at their ids, as llama.cpp
  matches them whole; and with no normaliser,
  where `normalized` changes nothing, each added token's flag is the builder's convention
  (special ones unnormalised, the others normalised).

BOS, EOS, padding and unknown ids are the file's (for `llama`, without the keys, llama.cpp's
defaults: unknown 0, BOS 1, EOS 2). `tokenizer.ggml.add_bos_token` is read
(`GGUFTokenizer.add_bos`) but the section has no field for it: `colibri generate` adds no BOS, and
`--chat`'s template writes the BOS its model wants. Everything else (`tokenizer.ggml.model` bert,
t5, rwkv, ...; a pre-tokenizer not in the table) is refused by name, before anything is written.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..image.tokenizer_section import TokenizerSection
from ..model.errors import ExportError
from .gguf_reader import GGUFTokenizer, _gguf, tokenizer_metadata

# tokenizer.ggml.pre names carried for byte-level BPE, and what llama.cpp splits the text with:
# GPT-2's regular expression (the ByteLevel pre-tokenizer's own), Qwen2's or Llama 3's (Split then
# ByteLevel; the conversion writes the same expressions as format.SPLIT_PATTERNS).
PRE_TOKENIZERS = {"gpt-2": "GPT-2", "olmo": "GPT-2", "qwen2": "Qwen2", "llama-bpe": "Llama 3"}
# Names llama.cpp tokenizes with ignore_merges (a pre-tokenized word that is a token is taken whole,
# as Llama 3's tokenizer.json says), which transformers' conversion does not set.
IGNORE_MERGES = ("llama-bpe",)
# What llama.cpp takes a `llama` file without the key to mean (llama-vocab.cpp's defaults); it
# never removes extra whitespace from a SentencePiece BPE text, whatever the file says.
SENTENCEPIECE_ADD_SPACE_PREFIX = True
SENTENCEPIECE_SPECIALS = {"unknown": 0, "bos": 1, "eos": 2}
# SentencePiece's piece types (sentencepiece_model.proto) are llama.cpp's token types
# (gguf.TokenType: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) number for number.
NO_VOCABULARY = ("no_vocab", "none")


def carried_kinds() -> str:
    return "llama (SentencePiece) and gpt2 (byte-level BPE, pre-tokenizer " + ", ".join(PRE_TOKENIZERS) + ")"


def _refuse(path: Path, what: str) -> ExportError:
    return ExportError(f"{path}: {what}; Colibri carries the GGUF tokenizers {carried_kinds()} "
                       "(--no-tokenizer leaves it out); nothing written")


def section_from_gguf(path: str | Path, tok: GGUFTokenizer | None = None) -> TokenizerSection | None:
    """The tokenizer section of the GGUF file at `path` (its metadata `tok` if already read), or None
    when the file has no vocabulary (no tokenizer.ggml.tokens, or tokenizer.ggml.model no_vocab)."""
    path = Path(path)
    tok = tokenizer_metadata(path) if tok is None else tok
    if tok is None or tok.model in NO_VOCABULARY:
        return None
    tok = _without_padding(tok)
    if tok.model == "llama":
        defaults = {k: v for k, v in SENTENCEPIECE_SPECIALS.items() if v < len(tok.tokens)}
        tok.special = {**defaults, **tok.special}
        section = _sentencepiece(path, tok)
    elif tok.model == "gpt2":
        section = _byte_level_bpe(path, tok)
    else:
        raise _refuse(path, f"tokenizer.ggml.model {tok.model!r}")
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        if key in tok.special:
            setattr(section, name, tok.special[key])
    return section


def _without_padding(tok: GGUFTokenizer) -> GGUFTokenizer:
    """`tok` without the unused tokens that end it ([PADn]: llama.cpp's converter fills the embedding's
    rows past the tokenizer with them). No text encodes to one and each decodes to nothing, so the
    section's own padding (`tokenizer_build.for_model`: empty unused rows) stands for them, as it does
    for the folder the file came from."""
    if not tok.token_types:
        return tok
    n = len(tok.tokens)
    while n > 0 and tok.token_types[n - 1] == _gguf().TokenType.UNUSED:
        n -= 1
    if n == len(tok.tokens):
        return tok
    from dataclasses import replace

    return replace(tok, tokens=tok.tokens[:n], token_types=tok.token_types[:n],
                   scores=None if tok.scores is None else tok.scores[:n])


def _text(path: Path, tok: GGUFTokenizer, i: int) -> str:
    try:
        return tok.tokens[i].decode("utf-8")
    except UnicodeDecodeError:
        raise ExportError(f"{path}: metadata tokenizer.ggml.tokens[{i}] is not UTF-8 text ({tok.tokens[i][:16]!r}); "
                          "nothing written") from None


def _types(path: Path, tok: GGUFTokenizer) -> list[int]:
    known = {int(t) for t in _gguf().TokenType}
    types = tok.token_types or [int(_gguf().TokenType.NORMAL)] * len(tok.tokens)
    for i, t in enumerate(types):
        if t not in known:
            raise ExportError(f"{path}: metadata tokenizer.ggml.token_type[{i}]={t} is not a llama.cpp token type "
                              "(1 normal .. 6 byte); nothing written")
    return types


def _sentencepiece(path: Path, tok: GGUFTokenizer) -> TokenizerSection:
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    from ..runtime import tokenizer_build

    if tok.precompiled_charsmap:
        raise _refuse(path, "a SentencePiece normaliser (tokenizer.ggml.precompiled_charsmap)")
    TokenType = _gguf().TokenType
    types = list(_types(path, tok))
    if "unknown" in tok.special:  # llama.cpp's unknown piece is this id, whatever its type says (the
        types[tok.special["unknown"]] = TokenType.UNKNOWN  # converter marks a special <unk> control)
    proto = sentencepiece_model_pb2.ModelProto()
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    trainer.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tok.tokens)
    for field, key in (("unk_id", "unknown"), ("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
        setattr(trainer, field, tok.special.get(key, -1))
    norm.name = "identity"
    norm.add_dummy_prefix = SENTENCEPIECE_ADD_SPACE_PREFIX if tok.add_space_prefix is None else tok.add_space_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    byte_pieces = set()
    for i, kind in enumerate(types):
        piece = proto.pieces.add()
        piece.piece = _text(path, tok, i)
        piece.score = tok.scores[i] if tok.scores is not None else 0.0
        piece.type = kind
        if kind == TokenType.BYTE:
            byte_pieces.add(piece.piece)
    trainer.byte_fallback = byte_pieces >= {f"<0x{b:02X}>" for b in range(256)}
    model = proto.SerializeToString()
    try:  # the library's own checks: one unknown piece, no piece twice, byte pieces spelled <0xNN>
        sentencepiece.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, OSError) as exc:
        why = " ".join(str(exc).split())
        raise _refuse(path, f"its llama vocabulary is not a SentencePiece model ({why})") from None
    with tempfile.TemporaryDirectory(prefix="colibri-gguf-tok-") as tmp:
        model_path = Path(tmp) / "tokenizer.model"
        model_path.write_bytes(model)
        try:
            return tokenizer_build.from_sentencepiece(model_path)
        except ExportError as exc:
            raise ExportError(str(exc).replace(str(model_path), f"{path} (its llama vocabulary)")) from None


def _byte_level_bpe(path: Path, tok: GGUFTokenizer) -> TokenizerSection:
    from ..runtime import tokenizer_build

    if tok.pre not in PRE_TOKENIZERS:
        why = "no tokenizer.ggml.pre" if tok.pre is None else f"tokenizer.ggml.pre {tok.pre!r}"
        raise _refuse(path, f"a byte-level BPE with {why} (the text's split is named, not stored, in a GGUF)")
    if tok.merges is None:
        raise _refuse(path, "a gpt2 vocabulary without tokenizer.ggml.merges")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:
        raise ExportError("a GGUF's byte-level BPE tokenizer is converted by `transformers` "
                          "(pip install 'colibri-moe[tokenizer]'), or --no-tokenizer leaves it out") from exc
    TokenType = _gguf().TokenType
    types = _types(path, tok)
    texts = [_text(path, tok, i) for i in range(len(tok.tokens))]
    merges = [m.decode("utf-8", "replace") for m in tok.merges]
    for i, m in enumerate(merges):
        if m.count(" ") != 1:
            raise ExportError(f"{path}: metadata tokenizer.ggml.merges[{i}] {m!r} is not two tokens split by one "
                              "space; nothing written")
    tokenizer_dict = {"tokenizer_type": "gpt2", "pre_tokenizer_type": tok.pre, "tokens": texts, "merges": merges,
                      "token_type": types}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unknown", "unk_token_id"),
                      ("padding", "pad_token_id")):
        if key in tok.special:
            tokenizer_dict[name] = tok.special[key]
    try:
        converted, _ = convert_gguf_tokenizer("gpt2", tokenizer_dict)
        spec = json.loads(converted.to_str())
    except Exception as exc:  # tokenizers raises its own Exception subclass on a vocabulary it cannot build
        raise _refuse(path, f"transformers cannot build its gpt2 tokenizer ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]})") from None
    if tok.pre in IGNORE_MERGES:
        spec["model"]["ignore_merges"] = True
    added = {a["id"]: a for a in spec.get("added_tokens") or []}
    vocab = spec["model"]["vocab"]
    by_id = {i: text for text, i in vocab.items()}
    for i, kind in enumerate(types):
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED) and i not in added:
            # Kept out of the BPE vocabulary (where the conversion respelled it), as an added token is.
            vocab.pop(by_id.get(i), None)
            added[i] = {"id": i, "content": texts[i], "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": kind == TokenType.CONTROL}
    if spec.get("normalizer") is None:
        for a in added.values():
            a["normalized"] = not a["special"]
    spec["added_tokens"] = [added[i] for i in sorted(added)]
    from tokenizers import Tokenizer

    rebuilt = Tokenizer.from_str(json.dumps(spec))
    for i, a in added.items():
        if rebuilt.token_to_id(a["content"]) != i:
            raise _refuse(path, f"token {i} {a['content']!r} (marked {TokenType(types[i]).name.lower()}) is another "
                                "token's text, or is added before tokens of the vocabulary")
    with tempfile.TemporaryDirectory(prefix="colibri-gguf-tok-") as tmp:
        json_path = Path(tmp) / "tokenizer.json"
        json_path.write_text(json.dumps(spec, ensure_ascii=False))
        try:
            section = tokenizer_build.from_tokenizer_json(json_path)
        except ExportError as exc:
            raise ExportError(str(exc).replace(str(json_path), f"{path} (its gpt2 vocabulary)")) from None
    if section.vocab_size != len(tok.tokens):
        raise _refuse(path, f"its gpt2 vocabulary of {len(tok.tokens)} tokens converts to {section.vocab_size}")
    return section
