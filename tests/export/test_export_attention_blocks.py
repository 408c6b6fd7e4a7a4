"""`--int8-blocks` patterns choose attention blocks too (docs/lm.md "Attention record"), alike in the
in-memory export (hf_lm.export_lm), the streamed folder export (hf_folder) and the GGUF import
(gguf_file): the three give the same bytes, with INT8_BLOCKS on every attention record that `layers.*`
or its own `layers.N` names, and the engine runs the image as the numpy reference does."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

import colibri
from colibri import reference
from colibri.checkpoints import gguf_file, hf_folder
from colibri.cli import main
from colibri.frontends import hf_lm
from colibri.image import reader
from colibri.model.errors import ExportError
from colibri.model.ir import Attention
from helpers.gguf_files import write_gguf
from helpers.hf_lm_models import ARCHS


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_blocks")
    out = {}
    for arch, make in ARCHS.items():
        out[arch] = root / arch
        make().save_pretrained(out[arch], safe_serialization=True, max_shard_size="30KB")
    return out


def _attention_blocks(data: bytes) -> list[bool]:
    return [layer.int8_blocks for layer in reader.read(data).layers if isinstance(layer, Attention)]


@pytest.mark.parametrize("dtype", ["q8", "q4"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_streamed_and_in_memory_exports_are_the_same_bytes(folders, tmp_path, arch, dtype):
    folder = folders[arch]
    model = AutoModelForCausalLM.from_pretrained(folder)
    for patterns in (["layers.*"], ["layers.*.experts.*", "layers.3"]):
        opts = dict(max_seq_len=16, max_batch=4, dtype=dtype, int8_blocks=patterns)
        want = hf_lm.export_lm(model, check=False, **opts).image
        out = tmp_path / f"{dtype}.clb"
        colibri.export(folder, out, **opts)
        assert out.read_bytes() == want, (arch, dtype, patterns)
        # layers.3 is the first decoder layer's attention (EMBED, then 8 layers a decoder layer)
        assert _attention_blocks(want) == ([True, True] if patterns == ["layers.*"] else [True, False])
    blocks = hf_lm.export_lm(model, check=False, max_seq_len=16, dtype=dtype, int8_blocks=["layers.11"]).image
    assert _attention_blocks(blocks) == [False, True]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_import_sets_the_flag_as_the_folder_export(folders, tmp_path, arch):
    model = AutoModelForCausalLM.from_pretrained(folders[arch])
    file = write_gguf(model, tmp_path / f"{arch}.gguf", "F32")
    for dtype in ("q8", "q4"):
        want, got = tmp_path / f"want-{dtype}.clb", tmp_path / f"got-{dtype}.clb"
        hf_folder.export_folder(folders[arch], want, max_seq_len=16, dtype=dtype, int8_blocks=["layers.*"])
        gguf_file.export_gguf(file, got, max_seq_len=16, dtype=dtype, int8_blocks=["layers.*"])
        assert got.read_bytes() == want.read_bytes(), (arch, dtype)
        assert _attention_blocks(got.read_bytes()) == [True, True]


def test_the_image_runs_as_the_reference(folders, tmp_path):
    out = tmp_path / "mixtral.clb"
    runner = CliRunner()
    r = runner.invoke(main, ["export", str(folders["mixtral"]), str(out), "--max-seq-len", "16", "--dtype", "q4",
                             "--int8-blocks", "layers.*", "--max-batch", "8"])
    assert r.exit_code == 0, r.output
    data = out.read_bytes()
    assert _attention_blocks(data) == [True, True]
    ids = [5, 17, 3, 90, 41, 8]
    want = reference.LMState(reader.read(data)).forward_tokens(ids)
    got = colibri.LM(data).forward_tokens(ids)
    assert np.abs(got - want).max() <= 2e-3 * (1 + np.abs(want).max())


def test_a_float_projection_is_refused_by_name(folders, tmp_path):
    with pytest.raises(ExportError, match=r"layers\.3: int8 activations need int8 weights"):
        hf_folder.export_folder(folders["mixtral"], tmp_path / "x.clb", max_seq_len=16, dtype="q8",
                                keep=["layers.3.v"], int8_blocks=["layers.*"])
    assert not (tmp_path / "x.clb").exists()


def test_info_names_the_attention_blocks(folders, tmp_path):
    out = tmp_path / "olmoe.clb"
    colibri.export(folders["olmoe"], out, max_seq_len=16, dtype="q8", int8_blocks=["layers.3"])
    r = CliRunner().invoke(main, ["info", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output)["layers"] if "attention" in row]
    assert [row["dtype"].endswith(" int8-blocks") for row in rows] == [True, False]
