"""A GGUF export's anonymous memory does not grow with the model (issue 26: a few tensors, never the model).

`colibri export model.gguf out.clb` runs in a subprocess that samples its own RssAnon (/proc/self/status:
the process's private memory, without the mapped pages of the files it reads and writes, which
ru_maxrss counts too). Two pure-Q4_0 Mixtral files differ only in their number of layers; each
export's peak over its RssAnon before the export starts is its working memory, which may not grow
with the layers by more than a few of the model's largest tensors. What it once did: the export's
closing validation unpacked every int4 weight of the written image (one byte per value, about the
size of the GGUF again)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.anon_peak import cli_script
from helpers.gguf_files import write_random_mixtral_q4_0

HIDDEN, EXPERTS, INTERMEDIATE, VOCAB = 256, 8, 512, 2048
LARGEST_F32 = 4 * VOCAB * HIDDEN  # the embedding table and the head; an expert matrix is a quarter of it

SAMPLED_EXPORT = cli_script(
    """import colibri.checkpoints.gguf_file, colibri.checkpoints.gguf_tokenizer, colibri.image.stream  # noqa: E401
import colibri.runtime.tokenizer_build, gguf, rich.progress  # noqa: E401""",
    interval=0.002,
)


def working_memory(tmp_path: Path, layers: int, *options: str) -> int:
    """Peak RssAnon of `colibri export` of a `layers`-layer Q4_0 Mixtral, over its RssAnon before the export."""
    model = write_random_mixtral_q4_0(tmp_path / f"m{layers}.gguf", hidden=HIDDEN, layers=layers, experts=EXPERTS,
                                      intermediate=INTERMEDIATE, vocab=VOCAB, seed=layers)
    out = tmp_path / f"m{layers}.clb"
    run = subprocess.run([sys.executable, "-c", SAMPLED_EXPORT, "export", str(model), str(out), "--max-seq-len", "64",
                          *options], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert out.stat().st_size > model.stat().st_size * 0.9  # the image holds the model (carried int4 blocks)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return got["peak"] - got["before"]


@pytest.mark.slow
@pytest.mark.parametrize("options", [(), ("--dtype", "q8")], ids=["q4-carried", "q8-requantised"])
def test_gguf_export_memory_does_not_grow_with_the_layers(tmp_path: Path, options: tuple[str, ...]) -> None:
    few, many = working_memory(tmp_path, 2, *options), working_memory(tmp_path, 14, *options)
    # 12 more layers are ~40 M more parameters (tens of MB of int4 values unpacked, ~160 MB of f32): the
    # growth allowed is two of the largest tensors in f32 (4 MiB) and the allocator's slack
    assert many - few <= 2 * LARGEST_F32 + 8 * 2**20, (few / 2**20, many / 2**20)
