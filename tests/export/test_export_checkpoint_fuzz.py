"""The GGUF and safetensors readers' error paths under mutated files (issue 26): every case is a
written image or a one-line ColibriError, never another exception, never a partial output.

CI runs COLIBRI_FUZZ_CHECKPOINTS cases of each (default 1000); `make fuzz-checkpoints` runs the
full size. The seeds are small models of each reader's kinds: GGUF Q8_0 with F16 fallbacks, Q4_0
`llama` (permuted q/k, carried blocks), F16 with biases, a shared expert and a dense layer; safetensors
folders sharded through an index and in one file."""
from __future__ import annotations

import os
import random

import pytest

from helpers.checkpoint_fuzz import Tally, fuzz_folders, fuzz_gguf
from helpers.gguf_files import block_models, write_gguf
from helpers.hf_lm_models import ARCHS

CASES = int(os.environ.get("COLIBRI_FUZZ_CHECKPOINTS", "1000"))
SEED = int(os.environ.get("COLIBRI_FUZZ_SEED", "26"))


@pytest.fixture(scope="module")
def models():
    small = {arch: make() for arch, make in ARCHS.items()}
    return small, block_models()


def test_gguf_reader_fuzz(models, tmp_path):
    small, blocks = models
    seeds = [write_gguf(small["olmoe"], tmp_path / "olmoe-q8.gguf", "Q8_0"),
             write_gguf(blocks["mixtral"], tmp_path / "mixtral-q4.gguf", "Q4_0", tokenizer="llama"),
             write_gguf(small["qwen2_moe"], tmp_path / "qwen2-f16.gguf", "F16")]
    tally = Tally()
    fuzz_gguf(seeds, tmp_path / "work", CASES, random.Random(SEED), tally)
    print("\n".join(["gguf:", *tally.lines()]))
    assert not tally.failures, "\n".join(tally.lines())
    assert {o for _, o in tally.outcomes} == {"written", "refused"}  # both paths reached


def test_safetensors_reader_fuzz(models, tmp_path):
    small, _ = models
    seeds = []
    for arch, shard in (("olmoe", "40KB"), ("qwen3_moe", None)):
        folder = tmp_path / arch
        if shard:
            small[arch].save_pretrained(folder, max_shard_size=shard)
        else:
            small[arch].save_pretrained(folder)
        seeds.append(folder)
    tally = Tally()
    fuzz_folders(seeds, tmp_path / "work", CASES, random.Random(SEED), tally)
    print("\n".join(["safetensors:", *tally.lines()]))
    assert not tally.failures, "\n".join(tally.lines())
    assert {o for _, o in tally.outcomes} == {"written", "refused"}
