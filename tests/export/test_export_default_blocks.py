"""Int8 activation blocks by default on Linux-sized token models (docs/quantization.md "Activation
blocks by default"): a q8/q4 token-model export that names no activation form runs every int8/int4
layer, expert and attention block with INT8_BLOCKS once its image is 16 MiB or more (the size from
which it is page-aligned too: no microcontroller slot holds it), and none below. The in-memory, the
folder and the GGUF export agree byte for byte; `int8_blocks=()` / `--int8-blocks none` turns it off.

The tests lower the 16 MiB threshold to 1 byte (image.writer.LINUX_LAYOUT_MIN_BYTES) so that tiny
models stand for big ones."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import colibri
from colibri.checkpoints import gguf_file, hf_folder
from colibri.cli import main
from colibri.frontends import hf_lm
from colibri.image import reader, writer
from colibri.model.ir import Attention, Linear, MoE
from helpers.gguf_files import write_gguf
from helpers.hf_lm_models import ARCHS


def _forms(data: bytes) -> dict[str, bool]:
    """Each linear layer's, expert's and attention block's INT8_BLOCKS flag, by name."""
    graph = reader.read(data, check="structure")
    out = {}
    for i, layer in enumerate(graph.layers):
        if isinstance(layer, (Linear, Attention)):
            out[f"layers.{i}"] = bool(layer.int8_blocks)
        elif isinstance(layer, MoE):
            for j, e in enumerate(layer.experts):
                out[f"layers.{i}.experts.{j}"] = bool(e.int8_blocks)
    return out


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return ARCHS["mixtral"]()


@pytest.fixture
def linux_sized(monkeypatch):
    monkeypatch.setattr(writer, "LINUX_LAYOUT_MIN_BYTES", 1)


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_below_16_mib_a_token_model_keeps_f32_activations(model, dtype):
    data = hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False).image
    assert len(data) < 16 << 20 and not any(_forms(data).values())


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_a_linux_sized_token_model_gets_blocks_on_every_int8_layer(model, linux_sized, dtype):
    forms = _forms(hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False).image)
    assert len(forms) > 10 and all(forms.values()), forms
    head = max(forms, key=lambda n: int(n.split(".")[1]))
    kept = _forms(hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False, keep=[head]).image)
    assert not kept[head] and all(v for n, v in kept.items() if n != head)  # an f32 head is left as it is
    assert not any(_forms(hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False, int8_blocks=()).image)
                   .values())
    rows = hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False, int8_act=["layers.*"]).image
    assert not any(_forms(rows).values())  # an activation form named: nothing added
    f32 = hf_lm.export_lm(model, max_seq_len=16, dtype="f32", check=False).image
    assert not any(_forms(f32).values())


def test_the_streamed_exports_choose_the_same(model, linux_sized, tmp_path):
    folder = tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    want = hf_lm.export_lm(model, max_seq_len=16, dtype="q4", check=False).image
    hf_folder.export_folder(folder, tmp_path / "f.clb", max_seq_len=16, dtype="q4", tokenizer=False)
    assert (tmp_path / "f.clb").read_bytes() == want
    gguf = write_gguf(model, tmp_path / "m-F32.gguf", "F32")
    gguf_file.export_gguf(gguf, tmp_path / "g.clb", max_seq_len=16, dtype="q4", tokenizer=False)
    assert _forms((tmp_path / "g.clb").read_bytes()) == _forms(want)


def test_cli_none_turns_the_default_off(model, linux_sized, tmp_path):
    folder = tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    runner = CliRunner()
    for extra, on in (([], True), (["--int8-blocks", "none"], False)):
        out = tmp_path / f"{on}.clb"
        r = runner.invoke(main, ["export", str(folder), str(out), "--max-seq-len", "16", "--dtype", "q4", *extra])
        assert r.exit_code == 0, r.output
        assert all(_forms(out.read_bytes()).values()) is on
    r = runner.invoke(main, ["export", str(folder), str(tmp_path / "x.clb"), "--max-seq-len", "16", "--dtype", "q4",
                             "--int8-blocks", "none", "--int8-blocks", "layers.*"])
    assert r.exit_code != 0 and "no other pattern" in r.output
    assert colibri.LM(str(tmp_path / "True.clb")).forward_tokens([1, 2, 3]).shape[0] == 3
