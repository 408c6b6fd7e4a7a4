"""Text from the image's own tokenizer (docs/lm.md "Decoding"): the C engine's streaming decoder and
the host's library tokenizer rebuilt from the section agree with `tokenizers` / `sentencepiece` id
for id and byte for byte, on a corpus with multi-byte UTF-8 and emoji, for byte-level BPE and
SentencePiece tokenizers trained here; EOS ends generation."""
from __future__ import annotations

import numpy as np
import pytest

import colibri
from colibri import image
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.errors import ColibriError
from colibri.model.format import Status, TokenizerFlag, TokenizerKind, TokenType
from colibri.runtime import _engine, tokenizer_build
from colibri.runtime.tokenizer_build import SectionTokenizer
from helpers import lmmodels
from helpers import tokenizers_trained as trained

# Qwen2's split, one of the patterns the device's encoder implements.
SPLIT = F.QWEN2_PATTERN

KINDS = {
    "byte_bpe": lambda d: trained.byte_bpe(d),
    "byte_bpe_split": lambda d: trained.byte_bpe(d, regex_split=SPLIT),
    "sp_bpe": lambda d: trained.sentencepiece_model(d),
    "sp_unigram": lambda d: trained.sentencepiece_model(d, model_type="unigram"),
    "sp_bpe_extra_ws": lambda d: trained.sentencepiece_model(d, remove_extra_whitespaces=True),
    "sp_bpe_no_prefix": lambda d: trained.sentencepiece_model(d, add_dummy_prefix=False),
    "sp_no_fallback": lambda d: trained.sentencepiece_model(d, vocab_size=500, byte_fallback=False),
}


class Library:
    """The tokenizer as its own library runs it from the folder's file (the reference)."""

    def __init__(self, path) -> None:
        if path.suffix == ".model":
            import sentencepiece

            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
            self.encode = self.sp.encode
            self.decode = self.sp.decode
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            self.encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    path = KINDS[request.param](folder)
    section = tokenizer_build.from_folder(folder)
    g = lmmodels.token_model(0, vocab=section.vocab_size + 2)  # two padding rows, as Qwen's
    g.tokenizer = TS.pack(section.padded(g.vocab_size))
    return request.param, image.write(g), Library(path), section


def _c_stream(data: bytes, ids: list[int]) -> tuple[list[bytes], bytes]:
    decoder = _engine.TextDecoder(data)
    return [decoder.push(i) for i in ids], decoder.flush()


def test_host_encoding_agrees_id_for_id(case) -> None:
    name, data, lib, _ = case
    host = SectionTokenizer(TS.parse(TS.find(data), image.read(data).vocab_size))
    for text in trained.CORPUS:
        assert host.encode(text) == list(lib.encode(text)), (name, text)


def test_c_and_host_decoding_agree_byte_for_byte(case) -> None:
    name, data, lib, section = case
    host = SectionTokenizer(TS.parse(TS.find(data), image.read(data).vocab_size))
    specials = [v for v in (section.bos, section.eos) if v is not None]
    for text in trained.CORPUS:
        ids = list(lib.encode(text))
        for seq in (ids, specials[:1] + ids + specials[1:]):
            want = lib.decode(seq)
            pieces, tail = _c_stream(data, seq)
            assert b"".join(pieces) + tail == want.encode("utf-8"), (name, text, seq)
            assert host.decode(seq) == want, (name, text)
            # streaming-safe: every piece is whole UTF-8, and the text so far is a prefix of the whole
            so_far = ""
            for piece in pieces:
                so_far += piece.decode("utf-8")
                assert want.startswith(so_far)
            assert tail == b""


def test_a_character_split_across_tokens_comes_out_whole(case) -> None:
    """Emoji and CJK characters the tokenizer spells with several byte tokens: the pieces holding
    their first bytes give nothing, the last gives the whole character."""
    name, data, lib, section = case
    split_seen = 0
    for text in trained.CORPUS:
        ids = list(lib.encode(text))
        pieces, _ = _c_stream(data, ids)
        for i, t in enumerate(ids):
            own = _engine.TextDecoder(data).piece(t)
            try:
                own.decode("utf-8")
            except UnicodeDecodeError:  # this token alone is part of a character
                split_seen += 1
                assert all(p == b"" or p.decode("utf-8") for p in pieces[: i + 1])
    if section.flags & TokenizerFlag.BYTE_FALLBACK or section.kind == TokenizerKind.BYTE_BPE:
        assert split_seen > 0, name


def test_invalid_sequences_become_replacement_characters(case) -> None:
    """Ids a model may draw in any order: what is left incomplete or ill-formed is U+FFFD, one per
    maximal ill-formed subpart, as Python's errors='replace'."""
    name, data, lib, section = case
    if not np.any(section.byte_ids != 0xFFFFFFFF):  # no byte fallback: unseen characters are <unk>, " \u2047 "
        ids = list(lib.encode("𝔘 🦜"))
        assert section.unk in ids
        pieces, tail = _c_stream(data, ids)
        assert b"".join(pieces) + tail == lib.decode(ids).encode() and "\u2047" in lib.decode(ids)
        return
    by_byte = {b: int(i) for b, i in enumerate(section.byte_ids)}
    for raw in (b"\xe2\x82", b"\xe2A", b"\x80\x80", b"\xf0\x9f\x8e", b"\xc0\xaf", b"\xed\xa0\x80", b"ok\xf4\x90"):
        seq = [by_byte[b] for b in raw]
        pieces, tail = _c_stream(data, seq)
        got = b"".join(pieces) + tail
        assert got == raw.decode("utf-8", errors="replace").encode("utf-8"), (name, raw, got)


def test_padding_and_control_ids_decode_to_nothing(case) -> None:
    name, data, lib, section = case
    vocab = image.read(data).vocab_size
    pad_ids = [vocab - 2, vocab - 1]
    assert all(_engine.TextDecoder(data).piece(i) == b"" for i in pad_ids)
    control = [i for i in range(section.vocab_size) if section.types[i] == TokenType.CONTROL]
    ids = list(lib.encode("Hello, world!"))
    pieces, tail = _c_stream(data, control + pad_ids + ids + pad_ids)
    assert b"".join(pieces) + tail == lib.decode(ids).encode()
    decoder = _engine.TextDecoder(data)
    for bad in (-1, vocab, 2**31 - 1):
        with pytest.raises(_engine.EngineError) as exc:
            decoder.push(bad)
        assert exc.value.args[0] == Status.BAD_TOKEN


def test_lm_text_in_and_out(case) -> None:
    name, data, lib, section = case
    lm = colibri.LM(data)
    assert lm.has_tokenizer
    assert lm.eos == section.eos and lm.bos == section.bos
    for text in trained.CORPUS[:4]:
        ids = lm.encode(text)
        assert ids == list(lib.encode(text))
        assert lm.decode(ids) == lib.decode(ids)
    out = lm.generate_text("Hello", 6, stop=None)
    ids = lm.generate(lm.encode("Hello"), 6, stop=None)
    assert out == lib.decode(ids)


def test_no_tokenizer_is_its_own_status() -> None:
    data = image.write(lmmodels.token_model(0))
    lm = colibri.LM(data)
    assert not lm.has_tokenizer and lm.eos is None
    with pytest.raises(ColibriError) as exc:
        lm.decode([1, 2])
    assert exc.value.status == Status.NO_TOKENIZER
    with pytest.raises(_engine.EngineError) as raw:
        _engine.TextDecoder(data)
    assert raw.value.args[0] == Status.NO_TOKENIZER


def test_eos_ends_generation(tmp_path) -> None:
    """A head that always prefers EOS: generate and stream end after it, unless stop=None."""
    trained.byte_bpe(tmp_path)
    section = tokenizer_build.from_folder(tmp_path)
    g = lmmodels.token_model(0, vocab=section.vocab_size)
    head = g.layers[-1]
    head.weight = np.zeros_like(head.weight)
    head.bias = np.zeros(g.vocab_size, np.float32)
    head.bias[section.eos] = 10.0
    g.tokenizer = TS.pack(section)
    lm = colibri.LM(image.write(g))
    prompt = lm.encode("Hello")
    assert lm.generate(prompt, 8) == [section.eos]
    assert list(lm.stream(prompt, 8)) == [section.eos]
    assert lm.generate(prompt, 8, stop=None) == [section.eos] * 8
    assert lm.generate_text("Hello", 8) == ""
