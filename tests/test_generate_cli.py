"""`colibri generate`: a token model continues a text prompt, streamed; the tokenizers it uses.

The streamed text must be what the engine's one-call generate makes (colibri.LM.generate, the
loop in C) and what the numpy reference makes (reference.LMState.generate), greedy and sampled,
and a character split across tokens must reach stdout whole.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import colibri
from colibri import cli as colibri_cli
from colibri import image, reference
from colibri.runtime import tokenizer as tok

import lmmodels
from conftest import ROOT

VOCAB = 300  # the byte ids plus room for a BPE tokenizer's merges
MAX_SEQ_LEN = 40
PROMPT = "Héllo, wörld"  # two 2-byte UTF-8 characters: 14 byte tokens


@pytest.fixture(scope="module")
def token_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "lm.clb"
    path.write_bytes(image.write(lmmodels.token_model(3, vocab=VOCAB, d=16, max_seq_len=MAX_SEQ_LEN, max_batch=4,
                                                      tied=True, qk_norm="head")))
    return path


def generate(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(colibri_cli.main, ["generate", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("sampling", [
    dict(),
    dict(temperature=0.9, top_k=50, top_p=0.95, seed=11),
    dict(temperature=1.5, seed=2**40 + 3),
])
def test_streamed_text_is_the_engines_and_the_references_continuation(token_model: Path, sampling: dict) -> None:
    ids = tok.ByteTokenizer().encode(PROMPT)
    n = MAX_SEQ_LEN - len(ids) + 1  # fills the cache exactly
    want = colibri.LM(token_model).generate(ids, n, **sampling)
    assert want == reference.LMState(image.read(token_model.read_bytes())).generate(ids, n, **sampling)
    assert len(want) == n
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sampling.items()]
    code, out, err = generate(str(token_model), "--prompt", PROMPT, "-n", str(n), *flags)
    assert code == 0, err
    assert out == PROMPT + tok.ByteTokenizer().decode(want) + "\n"
    code, out, _ = generate(str(token_model), "--prompt", PROMPT, "-n", str(n), "--no-echo", *flags)
    assert out == tok.ByteTokenizer().decode(want) + "\n"


def test_stream_yields_generates_tokens_and_stops_at_the_stop_id(token_model: Path) -> None:
    lm = colibri.LM(token_model)
    ids = [5, 200, 17]
    for sampling in (dict(), dict(temperature=1.0, top_k=0, top_p=0.9, seed=4)):
        whole = lm.generate(ids, 30, **sampling)
        assert list(lm.stream(ids, 30, **sampling)) == whole
        assert lm.position == len(ids) + 29  # the last token is not fed back, as generate
        stop = whole[7]
        cut = whole[: whole.index(stop) + 1]
        assert list(lm.stream(ids, 30, stop=stop, **sampling)) == cut
    assert list(lm.stream(ids, 0)) == []


def test_stream_checks_everything_before_the_first_token(token_model: Path) -> None:
    lm = colibri.LM(token_model)
    lm.forward_tokens([1, 2])
    with pytest.raises(colibri.InputError, match="max_seq_len is 40"):
        lm.stream([1] * 30, 12)  # raises on the call, not on the first next()
    with pytest.raises(colibri.InputError, match="sampler"):
        lm.stream([1], 3, temperature=-1.0)
    assert lm.position == 2  # a refused stream leaves the sequence alone


def test_stop_id_ends_generation(token_model: Path) -> None:
    ids = tok.ByteTokenizer().encode(PROMPT)
    whole = colibri.LM(token_model).generate(ids, 20)
    stop = whole[5]
    code, out, err = generate(str(token_model), "--prompt", PROMPT, "-n", "20", "--stop-id", str(stop), "--no-echo")
    assert code == 0, err
    assert out == tok.ByteTokenizer().decode(whole[: whole.index(stop) + 1]) + "\n"


def test_streams_to_stdout_token_by_token(token_model: Path) -> None:
    """A real process: the first text arrives while later tokens are still being made (the output
    is flushed per token, not buffered to the end), and the whole is generate's continuation."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "host_tools"))
    n = MAX_SEQ_LEN - 2
    proc = subprocess.Popen([sys.executable, "-c", "from colibri.cli import main; main()", "generate",
                             str(token_model), "--prompt", "ab", "-n", str(n), "--no-echo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    want = colibri.LM(token_model).generate([97, 98], n)
    assert out.decode("utf-8") == tok.ByteTokenizer().decode(want) + "\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x" * (MAX_SEQ_LEN + 1)], "cache is full"),
    (["--prompt", "x" * 30, "-n", "12"], "30 prompt tokens + 12 new ones need 41 positions, max_seq_len is 40"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "a", "--temperature", "-1"], "sampler"),
    (["--prompt", "a", "--top-p", "1.5"], "sampler"),
    (["--prompt", "a", "--stop-id", "300"], "--stop-id 300 is outside the model's vocabulary 0..299"),
    (["--prompt", "a", "--tokenizer", "missing.json"], "no tokenizer file at missing.json"),
])
def test_errors_are_one_line_and_status_1(token_model: Path, args: list[str], message: str) -> None:
    code, out, err = generate(str(token_model), *args)
    assert code == 1
    assert out == ""  # nothing streamed before the refusal
    assert message in err.lower() if message.islower() else message in err
    assert err.startswith("colibri: error:") and err.count("\n") == 1


def test_feature_model_is_refused_by_kind(tmp_path: Path) -> None:
    import torch

    from colibri.frontends.exporter import export

    export(torch.nn.Sequential(torch.nn.Linear(4, 3)), tmp_path / "f.clb", max_batch=1)
    code, out, err = generate(str(tmp_path / "f.clb"), "--prompt", "a")
    assert code == 1 and out == ""
    assert "feature model" in err and "colibri.Model" in err


def test_prompt_beyond_the_models_vocabulary_names_the_tokenizer(tmp_path: Path) -> None:
    small = tmp_path / "small.clb"
    small.write_bytes(image.write(lmmodels.token_model(0, vocab=40, max_seq_len=16)))
    code, _, err = generate(str(small), "--prompt", "hi")
    assert code == 1
    assert "token id 105 but the model's vocabulary is 0..39: is --tokenizer byte the one" in err


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8() -> None:
    t = tok.ByteTokenizer()
    text = "Zoë — 日本 🐦"
    assert t.encode(text) == list(text.encode("utf-8"))
    assert t.decode(t.encode(text)) == text
    assert t.decode([0xFF, 0x41]) == "\N{REPLACEMENT CHARACTER}A"  # a model may emit invalid UTF-8
    with pytest.raises(ValueError, match="0..255, got 256"):
        t.decode([256])


@pytest.mark.parametrize("data", [
    "Zoë — 日本 🐦".encode(),
    b"\xf0\x9f\x90",  # a 4-byte character cut short at the end
    b"a\xff\xfeb\xe6\x97",  # invalid bytes, then a cut 3-byte character
    b"\xe6\x97\xe6\x97\xa5",  # a cut character followed by a whole one
])
def test_stream_decoder_never_splits_a_character(data: bytes) -> None:
    t = tok.ByteTokenizer()
    d = tok.StreamDecoder(t)
    pieces = [d.push(b) for b in data]
    pieces.append(d.flush())
    assert "".join(pieces) == t.decode(list(data))
    text = "".join(pieces)
    # No piece ends inside a character: each decodes to a prefix of the final text.
    emitted = ""
    for p in pieces:
        emitted += p
        assert text.startswith(emitted)
    if data == "Zoë — 日本 🐦".encode():
        assert "\N{REPLACEMENT CHARACTER}" not in "".join(pieces)
        assert pieces[2] == "" and pieces[3] == "ë"  # ë is 2 bytes: nothing, then the whole


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with VOCAB ids, trained here on a few lines (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator(["In the beginning God created the heaven and the earth."] * 20 + ["Zoë wörld"] * 5,
                          trainer=trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    t.save(str(path))
    return path


def test_hf_tokenizer_file(bpe_json: Path, token_model: Path) -> None:
    t = tok.load(str(bpe_json))
    assert isinstance(t, tok.HFTokenizer) and t.vocab_size <= VOCAB
    text = "In the beginning Zoë"
    ids = t.encode(text)
    assert len(ids) < len(text.encode()) and t.decode(ids) == text  # merges used, nothing lost
    want = colibri.LM(token_model).generate(ids, 20, temperature=0.7, seed=5)
    code, out, err = generate(str(token_model), "--prompt", text, "-n", "20", "--temperature", "0.7", "--seed", "5",
                              "--tokenizer", str(bpe_json), "--no-echo")
    assert code == 0, err
    assert out == t.decode(want) + "\n"


def test_hf_tokenizer_refuses_a_file_that_is_not_one(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizers JSON file"):
        tok.load(str(bad))
