"""The tiny King James model (examples/tiny_lm) through the C engine: its f32 image gives PyTorch's
logits and greedy bytes, its held-out score matches PyTorch's on a few windows, and the demo's
`colibri generate` streams the same bytes. The whole held-out perplexity per dtype is the
tiny_lm_engine group of scripts/measure.py (tests/docs/test_docs_measured.py)."""
from __future__ import annotations

import math
import shutil
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import colibri
from colibri import cli as colibri_cli

from helpers.build import ROOT

sys.path.insert(0, str(ROOT / "examples" / "tiny_lm"))
import corpus  # noqa: E402
import evaluate  # noqa: E402
import generate_torch as G  # noqa: E402
import train as T  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    torch.set_num_threads(1)
    return G.load()


@pytest.fixture(scope="module")
def lm() -> colibri.LM:
    return colibri.LM(evaluate.image_path("f32"))


def test_image_is_the_deployment_shape(lm: colibri.LM) -> None:
    assert lm.vocab_size == 256 and lm.max_seq_len == T.CONTEXT and lm.max_batch == evaluate.MAX_BATCH
    # 3 layers x (k, v) x 256 positions x 2 kv heads x head_dim 16, f32.
    assert lm.kv_cache_bytes == 3 * 2 * 256 * 2 * 16 * 4
    assert lm.arena_size > lm.kv_cache_bytes


def test_logits_match_pytorch_over_a_window(lm: colibri.LM, hf_model) -> None:
    window = corpus.load().held_out[:64]
    lm.reset()
    got = lm.forward_tokens(list(window))
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([list(window)])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * (1 + np.abs(want).max())


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian's bible-kjv (scripts/setup.sh)")
def test_held_out_score_matches_pytorch(lm: colibri.LM, hf_model) -> None:
    text = corpus.load().held_out[: 2 * T.CONTEXT]
    nll, count = evaluate.held_out_nll(lm, text)
    want, want_count = T.held_out_nll(hf_model, text)
    assert count == want_count == 2 * (T.CONTEXT - 1)
    assert nll == pytest.approx(want, abs=1e-5)
    assert math.exp(nll) < 5  # a trained model, not a uniform guess (perplexity 256)


def test_greedy_bytes_are_pytorchs_and_the_cli_streams_them(lm: colibri.LM, hf_model) -> None:
    prompt = "And God said,"
    want = G.generate(hf_model, prompt, max_new_bytes=48, past_newline=True)
    got = lm.generate(list(prompt.encode()), 48)
    assert bytes(got).decode("ascii") == want
    result = CliRunner().invoke(colibri_cli.main, ["generate", str(evaluate.image_path("f32")), "--prompt", prompt,
                                                   "-n", "48"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == prompt + want + "\n"
