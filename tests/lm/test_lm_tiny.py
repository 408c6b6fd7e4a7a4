"""The tiny King James language model (examples/tiny_lm): the committed weights score what
their metrics.json says on held-out text, generate deterministically and write KJV words.

Retraining is `make train-tiny-lm` (tens of minutes), never run here.
"""
from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch

from helpers.build import ROOT

sys.path.insert(0, str(ROOT / "examples" / "tiny_lm"))
import corpus  # noqa: E402
import generate_torch as G  # noqa: E402
import train as T  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian's bible-kjv (scripts/setup.sh)")


@pytest.fixture(scope="module")
def kjv() -> corpus.Corpus:
    return corpus.load()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return G.load()


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((T.MODEL_DIR / T.METRICS).read_text())


def test_split_holds_out_the_last_books(kjv: corpus.Corpus) -> None:
    assert kjv.held_out.startswith(b"Jude, the servant of Jesus Christ")
    assert kjv.held_out.endswith(b"The grace of our Lord Jesus Christ be with you all. Amen.\n")
    # 3 John is the last book trained on.
    assert kjv.train.startswith(b"In the beginning God created the heaven and the earth.\n")
    assert kjv.train.endswith(b"Peace be to thee. Our friends salute thee. Greet the friends by name.\n")
    assert kjv.held_out not in kjv.train
    assert 0.015 < len(kjv.held_out) / (len(kjv.train) + len(kjv.held_out)) < 0.02


def test_committed_model_is_the_configured_architecture(model, metrics: dict) -> None:
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and cfg.vocab_size == 256 and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2 and cfg.mlp_only_layers == [0]
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    assert cfg.max_position_embeddings == T.CONTEXT
    assert T.n_parameters(model) == metrics["parameters"] == T.n_parameters(T.Qwen3MoeForCausalLM(T.config()))


def test_held_out_perplexity_matches_the_record(model, kjv: corpus.Corpus, metrics: dict) -> None:
    nll, count = T.held_out_nll(model, kjv.held_out[: T.TEST_SLICE_BYTES])
    recorded = metrics["test_slice"]
    assert count == recorded["held_out_bytes_scored"]
    assert nll == pytest.approx(recorded["held_out_nll_nats_per_byte"], abs=1e-4)
    # The model learned the language: a byte costs well under the 8 bits of a uniform guess,
    # and the whole held-out figure is of the same order as the slice.
    assert metrics["held_out_bits_per_byte"] < 2.5
    assert abs(metrics["held_out_bits_per_byte"] - recorded["held_out_bits_per_byte"]) < 0.3


def test_greedy_generation_is_deterministic_and_writes_kjv_words(model, kjv: corpus.Corpus) -> None:
    prompt = "And the LORD spake unto Moses, saying,"
    first = G.generate(model, prompt, max_new_bytes=160, past_newline=True)
    assert first == G.generate(model, prompt, max_new_bytes=160, past_newline=True)
    assert len(first) == 160
    vocabulary = set(re.findall(r"[A-Za-z]+", kjv.train.decode("ascii")))
    words = re.findall(r"[A-Za-z]+", first)[:-1]  # the last word may be cut off by the byte limit
    assert len(words) >= 15
    known = sum(w in vocabulary for w in words)
    assert known >= 0.9 * len(words), (first, [w for w in words if w not in vocabulary])


def test_generation_stops_at_the_end_of_a_verse(model) -> None:
    """A verse ends with a newline; generation stops there unless asked to go on."""
    prompt = "And the evening and the morning were the first day."
    onward = G.generate(model, prompt, max_new_bytes=40, past_newline=True)
    assert onward.startswith("\n") and len(onward) == 40
    assert G.generate(model, prompt, max_new_bytes=40) == "\n"


def test_generation_refuses_what_the_context_cannot_hold(model) -> None:
    with pytest.raises(ValueError, match="256-byte context"):
        G.generate(model, "x" * 200, max_new_bytes=57)
    with pytest.raises(ValueError, match="prompt is empty"):
        G.generate(model, "")


@pytest.mark.slow
def test_training_is_seeded() -> None:
    """Two short runs from one seed end in the same weights; another seed does not."""
    a, _ = T.train(steps=2, seed=3, threads=1, progress=False)
    b, _ = T.train(steps=2, seed=3, threads=1, progress=False)
    c, _ = T.train(steps=2, seed=4, threads=1, progress=False)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.state_dict().values(), c.state_dict().values()))
