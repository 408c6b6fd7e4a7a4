"""The tokenizer goes into the image at export (format v6, docs/lm.md "Tokenizer section"): from a
Hugging Face folder's tokenizer.json or tokenizer.model, streamed and in memory alike (byte for byte
the same image), left out on request, refused before anything is written when it cannot be the
model's; `colibri info` shows it and `colibri generate` needs no --tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

import colibri
from colibri.checkpoints import hf_folder
from colibri.cli import main
from colibri.frontends import hf_lm
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.errors import ExportError
from helpers import tokenizers_trained as trained
from helpers.hf_lm_models import mixtral


def _folder(root: Path, name: str, vocab: int, tokenizer) -> Path:
    folder = root / name
    mixtral(vocab).save_pretrained(folder, safe_serialization=True)
    tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokfolders")
    return {
        "bpe": _folder(root, "bpe", 408, trained.byte_bpe),  # 401 tokens, 7 padding rows
        "sp": _folder(root, "sp", 600, trained.sentencepiece_model),
    }


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_streamed_and_in_memory_exports_carry_the_same_tokenizer(folders, tmp_path, kind: str) -> None:
    folder = folders[kind]
    model = AutoModelForCausalLM.from_pretrained(folder)
    for dtype in ("f32", "q8"):
        out = tmp_path / f"{dtype}.clb"
        result = hf_folder.export_folder(folder, out, max_seq_len=16, dtype=dtype)
        assert result.version == F.TOKENIZER_VERSION
        want = hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False, tokenizer=folder).image
        assert out.read_bytes() == want, dtype
    section = TS.parse(TS.find(want), 408 if kind == "bpe" else 600)
    assert section.eos is not None and section.kind == (F.TokenizerKind.BYTE_BPE if kind == "bpe"
                                                          else F.TokenizerKind.SENTENCEPIECE_BPE)
    lm = colibri.LM(out)
    ids = lm.encode("Grüße 🎉")
    assert lm.decode(ids) == "Grüße 🎉"


def test_no_tokenizer_leaves_it_out(folders, tmp_path) -> None:
    out = tmp_path / "plain.clb"
    result = hf_folder.export_folder(folders["bpe"], out, max_seq_len=16, tokenizer=False)
    assert result.version == F.LM_VERSION and TS.find(out.read_bytes()) is None
    assert not colibri.LM(out).has_tokenizer


def test_a_tokenizer_past_the_vocabulary_is_refused_before_writing(folders, tmp_path) -> None:
    folder = tmp_path / "small"
    mixtral(300).save_pretrained(folder, safe_serialization=True)
    trained.byte_bpe(folder)  # 401 tokens for 300 embedding rows
    out = tmp_path / "out.clb"
    with pytest.raises(ExportError, match="401 tokens but the model's embedding only 300 rows"):
        hf_folder.export_folder(folder, out, max_seq_len=16)
    assert not out.exists() and not list(tmp_path.glob(".out.clb.*"))
    with pytest.raises(ExportError, match="401 tokens"):
        hf_lm.export_lm(AutoModelForCausalLM.from_pretrained(folder), out, max_seq_len=16, tokenizer=folder)
    assert not out.exists()


def test_kinds_colibri_does_not_carry_are_refused_by_name(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "tokenizer.json"))
    from colibri.runtime import tokenizer_build

    with pytest.raises(ExportError, match="tokenizer model 'WordPiece'"):
        tokenizer_build.from_folder(tmp_path)
    spec = json.loads((trained.byte_bpe(tmp_path / "nfkc")).read_text())
    spec["normalizer"] = {"type": "NFKC"}
    (tmp_path / "nfkc" / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ExportError, match="normalizer 'NFKC'"):
        tokenizer_build.from_folder(tmp_path / "nfkc")
    import io

    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(trained.TRAINING), model_writer=buf,
                                             vocab_size=300, minloglevel=2, character_coverage=1.0,
                                             hard_vocab_limit=False)  # the default normaliser, nmt_nfkc
    (tmp_path / "nfkc.model").write_bytes(buf.getvalue())
    with pytest.raises(ExportError, match="SentencePiece normaliser 'nmt_nfkc'"):
        tokenizer_build.from_sentencepiece(tmp_path / "nfkc.model")


def test_cli_export_info_and_generate(folders, tmp_path) -> None:
    runner = CliRunner()
    out = tmp_path / "m.clb"
    res = runner.invoke(main, ["export", str(folders["sp"]), str(out), "--max-seq-len", "24"])
    assert res.exit_code == 0, res.output
    assert "tokenizer: SentencePiece BPE, 600 tokens" in res.output
    info = runner.invoke(main, ["info", str(out), "--json"])
    tok = json.loads(info.output)["tokenizer"]
    assert tok["kind"] == "sentencepiece_bpe" and tok["vocab_size"] == 600
    assert tok["special"]["eos"] == {"id": 2, "text": "</s>"} and tok["special"]["bos"]["id"] == 1
    text = runner.invoke(main, ["info", str(out)])
    assert "tokenizer SentencePiece BPE, 600 tokens" in text.output
    gen = runner.invoke(main, ["generate", str(out), "--prompt", "Grüße aus", "-n", "10"])
    assert gen.exit_code == 0, gen.output
    lm = colibri.LM(out)
    assert gen.output == "Grüße aus" + lm.generate_text("Grüße aus", 10) + "\n"
    plain = tmp_path / "plain.clb"
    assert runner.invoke(main, ["export", str(folders["sp"]), str(plain), "--max-seq-len", "24",
                                "--no-tokenizer"]).exit_code == 0
    assert "tokenizer none" in runner.invoke(main, ["info", str(plain)]).output
    # an outside tokenizer larger than the model is refused before the first token
    big = runner.invoke(main, ["generate", str(out), "--prompt", "x", "--tokenizer",
                               str(trained.sentencepiece_model(tmp_path / "big", vocab_size=700))])
    assert big.exit_code != 0 and "cannot be this model's tokenizer" in big.output


def test_what_the_device_cannot_encode_is_refused_by_name(tmp_path) -> None:
    """The builder refuses what the C encoder could not reproduce (docs/lm.md "Encoding"): a Split
    pattern other than Qwen2's and Llama 3's, a SentencePiece piece with a raw space, an unused
    piece in a SentencePiece BPE model."""
    from sentencepiece import sentencepiece_model_pb2

    from colibri.runtime import tokenizer_build

    trained.byte_bpe(tmp_path / "split", regex_split=r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+")
    with pytest.raises(ExportError, match=r"Split pattern .*the device encodes Qwen2's and Llama 3's"):
        tokenizer_build.from_folder(tmp_path / "split")
    for name in F.SPLIT_PATTERNS:  # the two it implements pass
        trained.byte_bpe(tmp_path / name, regex_split=F.SPLIT_PATTERNS[name])
        assert tokenizer_build.from_folder(tmp_path / name).pattern == F.SPLIT_PATTERNS[name]
    path = trained.sentencepiece_model(tmp_path / "sp")
    for what, edit, message in (
        ("raw space", lambda p: setattr(p, "piece", "a b"), "holds a raw space"),
        ("unused", lambda p: setattr(p, "type", 5), "unused piece .* in a BPE model"),
    ):
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(path.read_bytes())
        edit(proto.pieces[300])
        bad = tmp_path / f"{what}.model"
        bad.write_bytes(proto.SerializeToString())
        with pytest.raises(ExportError, match=message):
            tokenizer_build.from_sentencepiece(bad)
