"""The C engine's encoder (colibri_tokenizer_encode, docs/lm.md "Encoding"): text to ids from the
image's own tokenizer section, id for id with the library the tokenizer came from (`tokenizers` for
byte-level BPE, `sentencepiece` for SentencePiece BPE and unigram), for tokenizers trained here, on
a corpus of ASCII, accents, CJK, emoji, multi-byte sequences, whitespace runs, digits and
punctuation and on seeded random text; its buffer bounds and statuses; the section's token index
(section version 2) validated by C and Python status for status; version-1 sections still valid."""
from __future__ import annotations

import random
import struct
import unicodedata

import pytest

import colibri
from colibri import image
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.errors import ColibriError
from colibri.model.format import Status
from colibri.runtime import _engine, tokenizer_build
from helpers import lmmodels
from helpers import tokenizers_trained as trained

KINDS = {
    "bpe_gpt2": lambda d: trained.byte_bpe(d),
    "bpe_gpt2_prefix": lambda d: trained.byte_bpe(d, add_prefix_space=True),
    "bpe_gpt2_all_merges": lambda d: trained.byte_bpe(d, vocab_size=3000),  # every merge the text allows
    "sp_bpe_all_merges": lambda d: trained.sentencepiece_model(d, vocab_size=3000),
    "bpe_qwen2_nfc": lambda d: trained.byte_bpe(d, regex_split=F.QWEN2_PATTERN, nfc=True),
    "bpe_qwen2_prefix": lambda d: trained.byte_bpe(d, regex_split=F.QWEN2_PATTERN, add_prefix_space=True),
    "bpe_llama3": lambda d: trained.byte_bpe(d, regex_split=F.LLAMA3_PATTERN, ignore_merges=True),
    "sp_bpe": lambda d: trained.sentencepiece_model(d, user_defined_symbols=("<tool>", "colibri")),
    "sp_bpe_extra_ws": lambda d: trained.sentencepiece_model(d, remove_extra_whitespaces=True),
    "sp_bpe_no_prefix": lambda d: trained.sentencepiece_model(d, add_dummy_prefix=False),
    "sp_no_fallback": lambda d: trained.sentencepiece_model(d, vocab_size=500, byte_fallback=False),
    "sp_unigram": lambda d: trained.sentencepiece_model(d, model_type="unigram",
                                                        user_defined_symbols=("<tool>", "colibri")),
    "sp_unigram_extra_ws": lambda d: trained.sentencepiece_model(d, model_type="unigram",
                                                                 remove_extra_whitespaces=True),
    "sp_unigram_no_fallback": lambda d: trained.sentencepiece_model(d, model_type="unigram", vocab_size=500,
                                                                    byte_fallback=False),
}

# Beyond the decoding corpus: what each pre-tokenizer and normaliser rule turns on.
EXTRA = [
    "",
    " ",
    "   ",
    "I'm sure you're right, it's they'll we've he'd I'M IT'S THEY'LL 'ſ 're''s",
    "Digits 1 12 123 1234 1234567 3.14159 ٣٤٥ ⅷ ½",
    "a  b   c\n\nd\r\n e \t\tf\n \n g   ",
    "\u3000ideographic\u00a0no-break\u2028line\u0085next",
    "<|endoftext|>between<|endoftext|><|endoftext|>",
    "a colibri bird, colibri birds<|endoftext|>colibri bird",
    "▁literal ▁ spaces▁▁",
    "<tool>colibri<tool> x",
    "x" * 300,
    "!!!???... ,,, ;; (parens) [brackets] {braces} -- __ ** //",
    "mixed123abc ABC'S ö1ü2 東京1タワー 🎉1🎉",
    "\x00\x01control\x7f chars",
    "한국어 문장도 하나 있습니다. 가나다 각낙닥",
]

# Random text from an alphabet that crosses every class border the splits and the normaliser test.
ALPHABET = (list("aAbzZ09 '\t\n\r.,!?-_sStTrReEvVlLmMdD") + ["  ", "\u00a0", "\u3000", "ſ", "é", "ß", "ö", "東",
            "語", "の", "テ", "한", "🎉", "👍🏽", "👨‍👩‍👧", "𝔘", "٣", "½", "\u0301", "\u200d", "▁", "\x00",
            "<|endoftext|>", "colibri bird", "<tool>", "colibri", "ÿ", "ı", "\u2028", "\u0085", "k", "\u212a"])


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24))) for _ in range(count)]


class Library:
    """The tokenizer as its own library encodes it from the folder's file (the reference)."""

    def __init__(self, path) -> None:
        if path.suffix == ".model":
            import sentencepiece

            self.encode = sentencepiece.SentencePieceProcessor(model_file=str(path)).encode
            self.nfc = False
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            self.encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self.nfc = tok.normalizer is not None


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    path = KINDS[request.param](folder)
    section = tokenizer_build.from_folder(folder)
    g = lmmodels.token_model(0, vocab=section.vocab_size + 2)  # two padding rows, as Qwen's
    g.tokenizer = TS.pack(section.padded(g.vocab_size))
    return request.param, image.write(g), Library(path)


def _nfc_may_change(text: str) -> bool:
    return any(_table_class(ord(c)) & 4 for c in text)


def _table_class(cp: int) -> int:
    import bisect

    starts, classes = _runs()
    return classes[bisect.bisect_right(starts, cp) - 1]


_RUNS: list = []


def _runs() -> tuple[list[int], list[int]]:
    if not _RUNS:
        text = (F.__file__ and __import__("pathlib").Path(__file__).resolve().parents[2]
                / "firmware/colibri_core/src/colibri_unicode_classes.h").read_text()
        body = text[text.index("{") + 1 : text.index("}")]
        data = bytes(int(x, 16) for x in body.replace("\n", "").split(",") if x.strip())
        values = [int.from_bytes(data[i : i + 3], "little") for i in range(0, len(data), 3)]
        _RUNS.extend([[v >> 3 for v in values], [v & 7 for v in values]])
    return _RUNS[0], _RUNS[1]


def test_device_encoding_agrees_with_the_library_id_for_id(case) -> None:
    name, data, lib = case
    encoder = _engine.TextDecoder(data)
    texts = trained.CORPUS + EXTRA + random_texts(26, 400)
    refused = 0
    for text in texts:
        if lib.nfc and _nfc_may_change(text):
            with pytest.raises(_engine.EngineError) as exc:
                encoder.encode(text)
            assert exc.value.args[0] == Status.TEXT_NOT_NORMALIZED, (name, text)
            refused += 1
            continue
        want = list(lib.encode(text))
        got = encoder.encode(text)
        assert got == want, (name, text, got, want)
        assert len(got) <= 3 * len(text.encode()) + 3
    assert refused < len(texts) // 3, (name, refused)


def test_nfc_check_passes_only_text_that_is_its_own_nfc() -> None:
    """What the table lets through an NFC normaliser unchanged is NFC already (tokenizers' NFC and
    Python's agree), on random strings drawn mostly from the characters NFC touches."""
    from tokenizers import normalizers

    nfc = normalizers.NFC()
    rng = random.Random(7)
    pool = [chr(c) for c in range(0x20, 0x3400) if not 0xD800 <= c <= 0xDFFF] + ["\U0001F389", "\U0001D518"]
    passed = 0
    for _ in range(4000):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
        if not _nfc_may_change(text):
            passed += 1
            assert nfc.normalize_str(text) == text == unicodedata.normalize("NFC", text), ascii(text)
    assert passed > 1000
    for text in ("e\u0301", "\u212b", "\u1100\u1161", "\uf900"):  # combining, singleton, jamo, compatibility
        assert _nfc_may_change(text)


def test_the_unicode_table_is_the_generators(tmp_path) -> None:
    """colibri_unicode_classes.h is what scripts/gen_unicode_classes.py makes from the installed
    tokenizers' regex classes (rerun it when the library's Unicode version moves)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_unicode_classes", root / "scripts/gen_unicode_classes.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render(gen.classes()) == (root / "firmware/colibri_core/src/colibri_unicode_classes.h").read_text()


def test_lm_encode_device(case) -> None:
    name, data, lib = case
    lm = colibri.LM(data)
    for text in trained.CORPUS[:4]:
        if lib.nfc and _nfc_may_change(text):
            continue
        assert lm.encode_device(text) == lm.encode(text) == list(lib.encode(text)), name
    with pytest.raises(ColibriError) as exc:
        lm.encode_device("ok \ud800")  # a lone surrogate: not UTF-8 a device could hold
    assert exc.value.status == Status.BAD_TEXT


def test_buffers_and_statuses(case) -> None:
    name, data, lib = case
    encoder = _engine.TextDecoder(data)
    text = "Hello, world! Grüße 🎉"
    raw = text.encode()
    want = encoder.encode(text)
    work = 16 * len(raw) + 64  # COLIBRI_TOKENIZER_ENCODE_WORK_BYTES
    assert encoder.encode_into(raw, len(want), work) == (0, len(want), want)
    assert encoder.encode_into(raw, len(want) - 1, work) == (Status.BUFFER_SIZE, len(want), want[:-1])
    assert encoder.encode_into(raw, 0, work) == (Status.BUFFER_SIZE, len(want), [])
    assert encoder.encode_into(raw, len(want), work - 1)[0] == Status.ARENA_TOO_SMALL
    assert encoder.encode_into(raw, len(want), 0)[0] == Status.ARENA_TOO_SMALL
    assert encoder.encode_into(b"", 0, 0) == (0, 0, [])
    for bad in (b"\xff", b"ok\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"a\xf4\x90\x80\x80"):
        assert encoder.encode_into(bad, 64, 4096)[0] == Status.BAD_TEXT, bad


def test_random_bytes_never_crash(case) -> None:
    """Arbitrary bytes in: an id list or BAD_TEXT / TEXT_NOT_NORMALIZED, and the ids are the
    library's whenever the bytes are UTF-8."""
    name, data, lib = case
    encoder = _engine.TextDecoder(data)
    rng = random.Random(3)
    for _ in range(300):
        raw = bytes(rng.randrange(256) if rng.random() < 0.3 else rng.choice(b"ab c\n'1\xc3\xa9")
                    for _ in range(rng.randint(0, 40)))
        status, n, ids = encoder.encode_into(raw, 3 * len(raw) + 3, 16 * len(raw) + 64)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            assert status == Status.BAD_TEXT
            continue
        if status == Status.TEXT_NOT_NORMALIZED:
            assert lib.nfc and _nfc_may_change(text)
            continue
        assert status == 0 and ids == list(lib.encode(text)), (name, raw)


# ---- the token index (section version 2) and version-1 sections ----


@pytest.fixture(scope="module")
def bpe_image(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("bpe")
    trained.byte_bpe(folder)
    section = tokenizer_build.from_folder(folder)
    g = lmmodels.token_model(0, vocab=section.vocab_size + 1)
    g.tokenizer = TS.pack(section.padded(g.vocab_size))
    return image.write(g)


def _section_at(data: bytes) -> int:
    n_t, t_off = F.HEADER.unpack_from(data, 0)[9:11]
    for i in range(n_t):
        off, _, _, _, dtype, *_ = F.TENSOR.unpack_from(data, t_off + i * F.TENSOR.size)
        if dtype == F.DType.TOKENIZER:
            return off
    raise AssertionError("no tokenizer section")


def _edit(data: bytes, at: int, fmt: str, *values) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, _section_at(data) + at, *values)
    image.set_tensor_crcs(buf)
    return bytes(buf)


def _statuses(data: bytes) -> tuple[int, int]:
    return _engine.validate(data), image.status(data)


def test_the_index_is_the_ids_sorted_by_bytes(bpe_image) -> None:
    off = _section_at(bpe_image)
    fields = F.TOKENIZER_HEADER.unpack_from(bpe_image, off)
    assert fields[1] == F.TOKENIZER_SECTION_VERSION == 2
    vocab, index_at = fields[4], fields[-1]
    section = TS.parse(TS.find(bpe_image), vocab)
    index = struct.unpack_from(f"<{vocab}I", bpe_image, off + index_at)
    assert sorted(index) == list(range(vocab))
    keys = [(section.tokens[i], i) for i in index]
    assert keys == sorted(keys)


def test_index_faults_agree(bpe_image) -> None:
    off = _section_at(bpe_image)
    fields = F.TOKENIZER_HEADER.unpack_from(bpe_image, off)
    vocab, index_at = fields[4], fields[-1]
    first, second = struct.unpack_from("<2I", bpe_image, off + index_at + 4 * 100)
    faults = {
        "an id past the vocabulary": _edit(bpe_image, index_at + 4 * 5, "<I", vocab),
        "two entries swapped": _edit(bpe_image, index_at + 4 * 100, "<2I", second, first),
        "an entry repeated": _edit(bpe_image, index_at + 4 * 100, "<2I", first, first),
        "the index past the section": _edit(bpe_image, 76, "<I", 0xFFFFFF00),
        "the index misaligned": _edit(bpe_image, 76, "<I", index_at + 2),
        "no index in version 2": _edit(bpe_image, 76, "<I", 0),
        "section version 3": _edit(bpe_image, 4, "<H", 3),
        "section version 0": _edit(bpe_image, 4, "<H", 0),
    }
    for what, data in faults.items():
        assert _statuses(data) == (Status.BAD_TOKENIZER,) * 2, what


def test_version_1_sections_stay_valid_and_decode(bpe_image) -> None:
    """A section written before the index (version 1: its last 4 header bytes reserved) validates
    and decodes; encoding it is UNSUPPORTED (re-export the image); an index offset in a version-1
    header is a reserved field set."""
    v1 = _edit(_edit(bpe_image, 4, "<H", 1), 76, "<I", 0)
    assert _statuses(v1) == (0, 0)
    decoder = _engine.TextDecoder(v1)
    ids = _engine.TextDecoder(bpe_image).encode("Hello, world!")
    assert b"".join(decoder.push(i) for i in ids) == b"Hello, world!"
    with pytest.raises(_engine.EngineError) as exc:
        decoder.encode("Hello")
    assert exc.value.args[0] == Status.UNSUPPORTED
    reserved = _edit(bpe_image, 4, "<H", 1)  # version 1 with the index offset still set
    assert _statuses(reserved) == (Status.BAD_TOKENIZER,) * 2


def test_an_unknown_split_pattern_is_unsupported_on_the_device(bpe_image, tmp_path) -> None:
    """A SPLIT_BYTE_LEVEL section whose pattern is none the encoder implements (the builder refuses
    such a tokenizer.json; a section made otherwise) decodes, and its encoding is UNSUPPORTED."""
    trained.byte_bpe(tmp_path, regex_split=F.QWEN2_PATTERN)
    section = tokenizer_build.from_folder(tmp_path)
    section.pattern = F.QWEN2_PATTERN.replace(r"\p{N}|", r"\p{N}{1,2}|")
    g = lmmodels.token_model(0, vocab=section.vocab_size)
    g.tokenizer = TS.pack(section)
    data = image.write(g)
    assert _statuses(data) == (0, 0)
    with pytest.raises(_engine.EngineError) as exc:
        _engine.TextDecoder(data).encode("Hello")
    assert exc.value.args[0] == Status.UNSUPPORTED


def test_an_unknown_token_that_is_a_special_token_stays_special(tmp_path) -> None:
    """A byte-level BPE whose unk_token is an added special token: tokenizers matches it in the text
    and skips it in decoding, so the section keeps it CONTROL and the device does the same."""
    import json

    from tokenizers import Tokenizer

    path = trained.byte_bpe(tmp_path)
    spec = json.loads(path.read_text())
    spec["model"]["unk_token"] = "<|endoftext|>"
    path.write_text(json.dumps(spec))
    section = tokenizer_build.from_folder(tmp_path)
    assert section.unk is not None and section.types[section.unk] == F.TokenType.CONTROL
    g = lmmodels.token_model(0, vocab=section.vocab_size)
    g.tokenizer = TS.pack(section)
    data = image.write(g)
    lib = Tokenizer.from_file(str(path))
    text = "a<|endoftext|>b colibri bird"
    ids = lib.encode(text, add_special_tokens=False).ids
    assert section.unk in ids and _engine.TextDecoder(data).encode(text) == ids
    assert colibri.LM(data).decode(ids) == lib.decode(ids, skip_special_tokens=True)
