"""`colibri hil` and `colibri footprint` with token models (issue 26): the runner in QEMU mps2-an500
runs the prefill and a decode step and its logits are compared with colibri.LM's; what the board
cannot hold (an image past its model buffer, a KV cache past its arena) is refused before any byte
is uploaded."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from colibri import image
from colibri.cli import main
from colibri.quant.quantize import quantize
from helpers import lmmodels

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]


def _write(tmp_path: Path, name: str, graph) -> Path:
    path = tmp_path / name
    path.write_bytes(image.write(graph))
    return path


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm")
    return {"f32": _write(root, "f32.clb", lmmodels.token_model(5, max_batch=4)),
            "q8": _write(root, "q8.clb", quantize(lmmodels.token_model(6, max_batch=4, qk_norm="head"), "q8"))}


@pytest.mark.parametrize("dtype", ["f32", "q8"])
def test_hil_runs_a_token_model(lm_files, dtype: str) -> None:
    r = CliRunner().invoke(main, ["hil", str(lm_files[dtype])])
    assert r.exit_code == 0, r.output
    assert re.search(r"prefill 4 tokens: max \|device - host\| [\d.e-]+; work [\d,]+ instructions", r.output)
    assert "decode 1 token: max |device - host|" in r.output
    assert "device agrees with the host engine" in r.output


def test_hil_token_model_reference_kernels_bit_for_bit(lm_files) -> None:
    r = CliRunner().invoke(main, ["hil", "--reference-kernels", str(lm_files["q8"])])
    assert r.exit_code == 0, r.output
    assert "prefill 4 tokens: max |device - host| 0;" in r.output
    assert "decode 1 token: max |device - host| 0;" in r.output
    assert "device agrees with the host engine bit for bit" in r.output


def test_footprint_of_a_token_model(lm_files) -> None:
    r = CliRunner().invoke(main, ["footprint", str(lm_files["f32"])])
    assert r.exit_code == 0, r.output
    assert re.search(r"model f32\.clb: [\d,]+ B image, [\d,]+ B arena \(KV cache [\d,]+ B\), stack high-water [\d,]+ B",
                     r.output)


@pytest.mark.parametrize("command", ["hil", "footprint"])
def test_what_the_board_cannot_hold_is_refused_before_uploading(tmp_path, command: str) -> None:
    """A 5 MB image (the emulated board's runner holds 2 MiB of model) and a KV cache of 38 MB
    (its arena is 1 MiB): one line each, naming the budget, and no upload (no progress bar)."""
    big = _write(tmp_path, "big.clb", lmmodels.token_model(7, vocab=20_000, d=32, hidden=8))
    long = _write(tmp_path, "long.clb", lmmodels.token_model(8, max_seq_len=200_000))
    board = r"mps2-an500 \(QEMU\)"
    for path, want in ((big, rf"big\.clb: the image is [\d,]+ B and {board}'s runner holds 2,097,152 B of model"),
                       (long, rf"long\.clb: the KV cache alone is [\d,]+ B and {board}'s arena holds 1,048,576 B")):
        r = CliRunner().invoke(main, [command, str(path)])
        assert r.exit_code != 0, r.output
        assert re.search(want, r.output), r.output
        assert "nothing uploaded" in r.output
        assert "uploading" not in r.output.lower()
