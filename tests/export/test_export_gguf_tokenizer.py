"""A GGUF file's tokenizer metadata goes into the image as its tokenizer section
(colibri.checkpoints.gguf_tokenizer; issue 26).

Each folder holds a tiny random MoE model and a tokenizer trained here; its GGUF is written with the
gguf package, its tokenizer as llama.cpp's converter writes it (helpers.gguf_files.converter_tokenizer).
The GGUF's image then carries the section the folder's image carries, byte for byte, and encodes and
decodes the corpus (multi-byte UTF-8, emoji) id for id as the folder's own tokenizer, run by its
library. What Colibri does not carry is refused by name and nothing is written."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import pytest
import sentencepiece
from click.testing import CliRunner
from tokenizers import Tokenizer

import colibri
from colibri.checkpoints import gguf_file, gguf_tokenizer, hf_folder
from colibri.cli import main
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.errors import ExportError
from colibri.runtime import tokenizer_build
from helpers import tokenizers_trained as trained
from helpers.gguf_files import write_gguf
from helpers.hf_lm_models import ARCHS, randomised

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# Llama 3's split, as its tokenizer.json (and transformers' GGUF conversion of `llama-bpe`) writes it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# A word the merges alone split (q+z first, then nothing joins x and qz) but which is a token of its own:
# Llama 3's ignore_merges takes it whole.
WHOLE_WORD = "xqz"


def llama3_bpe(folder: Path) -> Path:
    """A byte-level BPE with Llama 3's split and ignore_merges, and WHOLE_WORD a token that only
    ignore_merges reaches (its merges q z, x q, xq z in that order)."""
    path = trained.byte_bpe(folder, added=False, regex_split=LLAMA3_SPLIT, ignore_merges=True)
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    for token in ("qz", "xq", WHOLE_WORD):
        vocab[token] = len(vocab)
    spec["model"]["merges"] += [["q", "z"], ["x", "q"], ["xq", "z"]]
    path.write_text(json.dumps(spec))
    return path


# name: (architecture, tokenizer writer, its vocabulary, tokenizer.ggml.pre)
CASES = {
    "mixtral-sentencepiece": ("mixtral", lambda d: trained.sentencepiece_model(d), 600, None),
    "qwen2-byte-bpe": ("qwen2_moe", lambda d: trained.byte_bpe(d, regex_split=QWEN2_SPLIT), 401, "qwen2"),
    "olmoe-byte-bpe": ("olmoe", lambda d: trained.byte_bpe(d), 408, "olmo"),  # 7 rows padded: [PADn] in the GGUF
    "mixtral-llama3-bpe": ("mixtral", llama3_bpe, 403, "llama-bpe"),  # a Llama 3 style MoE: `llama` with gpt2
}
TEXTS = [*trained.CORPUS, "a colibri bird <|endoftext|> sings", f"{WHOLE_WORD} {WHOLE_WORD}s", ""]


def with_vocab(arch: str, vocab: int, seed: int):
    model = ARCHS[arch]()
    cfg = copy.deepcopy(model.config)
    cfg.vocab_size = vocab
    return randomised(type(model)(cfg), seed)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (the folder, its GGUF file)."""
    root = tmp_path_factory.mktemp("gguftok")
    out = {}
    for i, (name, (arch, write_tokenizer, vocab, pre)) in enumerate(CASES.items()):
        folder = root / name
        model = with_vocab(arch, vocab, 40 + i)
        model.save_pretrained(folder, safe_serialization=True)
        write_tokenizer(folder)
        out[name] = folder, write_gguf(model, root / f"{name}.gguf", "F32", tokenizer=folder, pre=pre or "gpt-2")
    return out


def _library(folder: Path):
    """The folder's tokenizer, run by its own library: (encode, decode)."""
    if (folder / "tokenizer.model").is_file():
        sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        return (lambda t: sp.encode(t)), (lambda ids: sp.decode(ids))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return (lambda t: tok.encode(t, add_special_tokens=False).ids), (lambda ids: tok.decode(ids))


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_image_carries_the_folders_tokenizer(sources, tmp_path, name):
    folder, file = sources[name]
    from_folder, from_gguf = tmp_path / "folder.clb", tmp_path / "gguf.clb"
    hf_folder.export_folder(folder, from_folder, max_seq_len=16)
    result = gguf_file.export_gguf(file, from_gguf, max_seq_len=16, dtype="f32")
    assert result.version == F.TOKENIZER_VERSION
    want, got = TS.find(from_folder.read_bytes()), TS.find(from_gguf.read_bytes())
    assert got is not None and got == want  # the same section, byte for byte
    assert from_gguf.read_bytes() == from_folder.read_bytes()  # and so the same image
    encode, decode = _library(folder)
    lm = colibri.LM(from_gguf)
    for text in TEXTS:
        ids = lm.encode(text)
        assert ids == encode(text), text
        assert lm.decode(ids) == decode(ids), text


def test_both_kinds_are_read(sources):
    kinds = {name: gguf_tokenizer.section_from_gguf(sources[name][1]).kind for name in CASES}
    assert kinds == {"mixtral-sentencepiece": F.TokenizerKind.SENTENCEPIECE_BPE,
                     "qwen2-byte-bpe": F.TokenizerKind.BYTE_BPE, "olmoe-byte-bpe": F.TokenizerKind.BYTE_BPE,
                     "mixtral-llama3-bpe": F.TokenizerKind.BYTE_BPE}
    section = gguf_tokenizer.section_from_gguf(sources["qwen2-byte-bpe"][1])
    assert section.pre_tokenizer == F.PreTokenizer.SPLIT_BYTE_LEVEL and section.pattern == QWEN2_SPLIT
    assert section.eos == section.bos == 0 and section.tokens[0] == b"<|endoftext|>"
    added = section.tokens.index(b"colibri bird")  # a user-defined token with a space, whole at its id
    assert section.types[added] == F.TokenType.USER_DEFINED


def test_llama3_bpe_takes_a_whole_word_token_as_llama_cpp_does(sources):
    """`llama-bpe`: Llama 3's split (the C encoder's LLAMA3_PATTERN) and ignore_merges, which llama.cpp
    sets for this name and transformers' conversion leaves out: without it WHOLE_WORD would be two
    tokens, as the folder's tokenizer without the flag shows."""
    folder, file = sources["mixtral-llama3-bpe"]
    section = gguf_tokenizer.section_from_gguf(file)
    assert section.pre_tokenizer == F.PreTokenizer.SPLIT_BYTE_LEVEL and section.pattern == F.LLAMA3_PATTERN
    assert section.flags & F.TokenizerFlag.IGNORE_MERGES
    spec = json.loads((folder / "tokenizer.json").read_text())
    whole = spec["model"]["vocab"][WHOLE_WORD]
    spec["model"]["ignore_merges"] = False
    assert len(Tokenizer.from_str(json.dumps(spec)).encode(WHOLE_WORD).ids) == 2
    out = file.with_suffix(".clb")
    gguf_file.export_gguf(file, out, max_seq_len=16, dtype="f32")
    lm = colibri.LM(out)
    assert lm.encode(WHOLE_WORD) == lm.encode_device(WHOLE_WORD) == [whole]


def test_a_unigram_model_is_carried_as_llama_cpp_runs_it(tmp_path):
    """A GGUF keeps no SentencePiece model type: llama.cpp merges by score (BPE) whatever the model
    was trained as, and so does the image; pieces, scores and specials are the folder's."""
    folder = tmp_path / "uni"
    model = with_vocab("mixtral", 500, 7)
    model.save_pretrained(folder, safe_serialization=True)
    trained.sentencepiece_model(folder, 500, model_type="unigram")
    file = write_gguf(model, tmp_path / "uni.gguf", tokenizer=folder)
    got = gguf_tokenizer.section_from_gguf(file)
    want = tokenizer_build.from_folder(folder)
    assert want.kind == F.TokenizerKind.SENTENCEPIECE_UNIGRAM and got.kind == F.TokenizerKind.SENTENCEPIECE_BPE
    # The trainer stopped short of 500 pieces: the converter pads the file with [PADn] tokens, which the
    # section's own padding stands for.
    assert want.vocab_size < 500 and gguf_file.tokenizer_metadata(file).tokens[-1] == b"[PAD499]"
    assert got.tokens == want.tokens and (got.scores == want.scores).all() and (got.types == want.types).all()
    assert got.specials() == want.specials()


def test_no_tokenizer_and_another_tokenizer(sources, tmp_path):
    folder, file = sources["olmoe-byte-bpe"]
    out = tmp_path / "plain.clb"
    assert gguf_file.export_gguf(file, out, max_seq_len=16, tokenizer=False).version == F.LM_VERSION
    assert TS.find(out.read_bytes()) is None
    other = tmp_path / "other.clb"
    gguf_file.export_gguf(file, other, max_seq_len=16, tokenizer=folder / "tokenizer.json")
    assert TS.find(other.read_bytes()) == tokenizer_build.packed_for(folder / "tokenizer.json", 408, "t")
    bare = write_gguf(with_vocab("olmoe", 401, 3), tmp_path / "bare.gguf")  # no_vocab: nothing to carry
    assert gguf_file.export_gguf(bare, tmp_path / "bare.clb", max_seq_len=16).version == F.LM_VERSION


def _edited(sources, tmp_path, name, edit) -> Path:
    folder, _ = sources[name]
    arch, _, vocab, pre = CASES[name]

    def metadata(w):
        edit(w.kv_data[0])
    return write_gguf(with_vocab(arch, vocab, 5), tmp_path / "edited.gguf", tokenizer=folder, pre=pre or "gpt-2",
                      metadata=metadata)


def _value(kind, value):
    return gguf.GGUFValue(value, kind)


@pytest.mark.parametrize("name, edit, match", [
    ("olmoe-byte-bpe", lambda kv: kv.__setitem__("tokenizer.ggml.model", _value(gguf.GGUFValueType.STRING, "bert")),
     r"tokenizer\.ggml\.model 'bert'; Colibri carries the GGUF tokenizers llama \(SentencePiece\) and gpt2"),
    ("olmoe-byte-bpe", lambda kv: kv.__setitem__("tokenizer.ggml.pre", _value(gguf.GGUFValueType.STRING, "default")),
     r"a byte-level BPE with tokenizer\.ggml\.pre 'default' \(the text's split is named, not stored"),
    ("olmoe-byte-bpe", lambda kv: kv.pop("tokenizer.ggml.pre"), r"a byte-level BPE with no tokenizer\.ggml\.pre"),
    ("olmoe-byte-bpe", lambda kv: kv.pop("tokenizer.ggml.merges"),
     r"a gpt2 vocabulary without tokenizer\.ggml\.merges"),
    ("mixtral-sentencepiece",
     lambda kv: kv.__setitem__("tokenizer.ggml.precompiled_charsmap",
                               _value(gguf.GGUFValueType.ARRAY, [1, 2, 3])),
     r"a SentencePiece normaliser \(tokenizer\.ggml\.precompiled_charsmap\)"),
    ("mixtral-sentencepiece", lambda kv: kv["tokenizer.ggml.tokens"].value.__setitem__(600 - 1, "\u2581the"),
     r"its llama vocabulary is not a SentencePiece model \(.*already defined"),
    ("mixtral-sentencepiece",
     lambda kv: kv.__setitem__("tokenizer.ggml.token_type", _value(gguf.GGUFValueType.ARRAY, [9] * 600)),
     r"tokenizer\.ggml\.token_type\[0\]=9 is not a llama\.cpp token type"),
])
def test_what_is_not_carried_is_refused_by_name(sources, tmp_path, name, edit, match):
    file = _edited(sources, tmp_path, name, edit)
    out = tmp_path / "out.clb"
    with pytest.raises(ExportError, match=match) as info:
        gguf_file.export_gguf(file, out, max_seq_len=16)
    assert str(file) in str(info.value) and "nothing written" in str(info.value)
    assert not out.exists() and not list(tmp_path.glob(".out.clb*"))


def test_cli_export_carries_it_and_generate_needs_no_tokenizer(sources, tmp_path):
    folder, file = sources["mixtral-sentencepiece"]
    runner = CliRunner()
    out = tmp_path / "m.clb"
    res = runner.invoke(main, ["export", str(file), str(out), "--max-seq-len", "24"])
    assert res.exit_code == 0, res.output
    assert "tokenizer: SentencePiece BPE, 600 tokens" in res.output
    gen = runner.invoke(main, ["generate", str(out), "--prompt", "Grüße 🎉", "-n", "6"])
    assert gen.exit_code == 0, gen.output
    assert gen.output == "Grüße 🎉" + colibri.LM(out).generate_text("Grüße 🎉", 6) + "\n"
    plain = tmp_path / "plain.clb"
    res = runner.invoke(main, ["export", str(file), str(plain), "--max-seq-len", "24", "--no-tokenizer"])
    assert res.exit_code == 0 and "tokenizer:" not in res.output
    assert "tokenizer none" in runner.invoke(main, ["info", str(plain)]).output


CONVERTER = Path(__file__).resolve().parents[2] / "build" / "llama.cpp" / "src" / "convert_hf_to_gguf.py"


@pytest.mark.slow
@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter not there: run make bench-lm-setup")
def test_llama_cpps_own_converter_gives_the_folders_section(sources, tmp_path):
    """The SentencePiece Mixtral folder through llama.cpp's convert_hf_to_gguf.py itself (not the
    gguf-writer stand-in above): the GGUF's image carries the folder's section, byte for byte."""
    import subprocess
    import sys

    folder, _ = sources["mixtral-sentencepiece"]
    file = tmp_path / "converted.gguf"
    run = subprocess.run([sys.executable, str(CONVERTER), str(folder), "--outfile", str(file), "--outtype", "f32"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    from_folder, from_gguf = tmp_path / "folder.clb", tmp_path / "gguf.clb"
    hf_folder.export_folder(folder, from_folder, max_seq_len=16)
    gguf_file.export_gguf(file, from_gguf, max_seq_len=16, dtype="f32")
    assert TS.find(from_gguf.read_bytes()) == TS.find(from_folder.read_bytes())
    encode, _ = _library(folder)
    lm = colibri.LM(from_gguf)
    assert all(lm.encode(text) == encode(text) for text in TEXTS)
