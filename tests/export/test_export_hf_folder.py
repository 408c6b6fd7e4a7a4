"""A Hugging Face folder exported streamed (colibri.checkpoints.hf_folder, image.stream; issue 26).

The streamed image must be byte for byte the in-memory export (`hf_lm.export_lm`) of the same
model, loaded as a user loads it (`from_pretrained`), for each architecture, source dtype (f32,
bf16, f16, sharded) and weight dtype. Bad input is refused naming the file and the tensor, and
leaves nothing at the output path."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

import colibri
from colibri.cli import main
from colibri.checkpoints import hf_folder
from colibri.frontends import hf_lm
from colibri.image import stream
from colibri.model import format as F
from colibri.model.errors import ExportError
from colibri.model.ir import Embedding, Graph, Linear
from helpers.hf_lm_models import ARCHS

SOURCES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch, make in ARCHS.items():
        model = make()
        for src, dt in SOURCES.items():
            folder = root / f"{arch}-{src}"
            model.to(dt).save_pretrained(folder, safe_serialization=True, max_shard_size="30KB")
            out[arch, src] = folder
    return out


def _mixtral_f32(folders, tmp_path: Path) -> Path:
    folder = tmp_path / "mixtral"
    shutil.copytree(folders["mixtral", "f32"], folder)
    return folder


@pytest.mark.parametrize("src", list(SOURCES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_streamed_image_is_the_in_memory_one(folders, tmp_path, arch, src):
    folder = folders[arch, src]
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded through the index
    model = AutoModelForCausalLM.from_pretrained(folder)
    for dtype in ("f32", "f16", "q8", "q4"):
        want = hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False).image
        out = tmp_path / f"{dtype}.clb"
        result = colibri.export(folder, out, max_seq_len=16, dtype=dtype)
        assert out.read_bytes() == want, (arch, src, dtype)
        assert result.bytes_written == len(want)


def test_streamed_options_match_in_memory(folders, tmp_path):
    folder = folders["qwen2_moe", "bf16"]  # q/k/v biases: q4 decides per weight where each bias goes
    model = AutoModelForCausalLM.from_pretrained(folder)
    opts = dict(max_seq_len=12, max_batch=4, kv_dtype="f16", dtype="q4", group=16, q8=["layers.7.shared"], int8_act=["layers.7.experts.*"],
                keep=["layers.3.o"], compensation=0.01)
    want = hf_lm.export_lm(model, check=False, **opts).image
    hf_folder.export_folder(folder, tmp_path / "o.clb", **opts)
    assert (tmp_path / "o.clb").read_bytes() == want


def test_fused_experts_checkpoint(folders, tmp_path):
    """transformers 5's fused expert tensors (gate_up_proj [E, 2I, H] = [w1; w3], down_proj [E, H, I]),
    in one model.safetensors: the same image as the per-expert layout."""
    src = folders["mixtral", "bf16"]
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        from safetensors.torch import load_file as load_torch

        tensors.update(load_torch(shard))
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe.experts"
        w = {k: [tensors.pop(f"{p}.{e}.{k}.weight") for e in range(4)] for k in ("w1", "w2", "w3")}
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([a, b]) for a, b in zip(w["w1"], w["w3"])])
        tensors[f"{p}.down_proj"] = torch.stack(w["w2"])
    folder = tmp_path / "fused"
    folder.mkdir()
    shutil.copy(src / "config.json", folder)
    from safetensors.torch import save_file as save_torch

    save_torch(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(src)
    for dtype in ("f32", "q8"):
        want = hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False).image
        hf_folder.export_folder(folder, tmp_path / "o.clb", max_seq_len=16, dtype=dtype)
        assert (tmp_path / "o.clb").read_bytes() == want


def test_bf16_checkpoint_passes_the_in_memory_check(folders):
    model = AutoModelForCausalLM.from_pretrained(folders["mixtral", "bf16"])
    assert next(model.parameters()).dtype == torch.bfloat16
    result = hf_lm.export_lm(model, max_seq_len=16)  # compared with its f32 widening: no tolerance error
    assert result.checks[0].ok


def test_max_seq_len_is_asked_for_by_name(folders, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folders["olmoe", "f32"])
    with pytest.raises(ExportError, match="max_seq_len"):
        colibri.export(model)
    with pytest.raises(ExportError, match="max_seq_len"):
        colibri.export(folders["olmoe", "f32"], tmp_path / "o.clb")
    result = CliRunner().invoke(main, ["export", str(folders["olmoe", "f32"]), str(tmp_path / "o.clb")])
    assert result.exit_code == 1 and "--max-seq-len" in result.output
    assert not (tmp_path / "o.clb").exists()


def test_cli_refuses_feature_model_options_for_a_folder(folders, tmp_path):
    out = tmp_path / "o.clb"
    result = CliRunner().invoke(main, ["export", str(folders["olmoe", "f32"]), str(out), "--max-seq-len", "16",
                                       "--page-aligned", "--prune", "1"])
    assert result.exit_code == 1 and "--prune is for feature models" in result.output
    assert not out.exists()


def test_cli_streams_with_progress_and_report(folders, tmp_path):
    folder, out = folders["qwen3_moe", "bf16"], tmp_path / "q.clb"
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--max-seq-len", "16", "--dtype", "q8"])
    assert result.exit_code == 0, result.output
    assert "tensors" in result.output and "peak RSS" in result.output
    assert f"{out.stat().st_size} bytes" in result.output
    want = hf_lm.export_lm(AutoModelForCausalLM.from_pretrained(folder), max_seq_len=16, dtype="q8", check=False)
    assert out.read_bytes() == want.image


def _refused(folder: Path, tmp_path: Path, match: str, **opts) -> None:
    out = tmp_path / "out" / "m.clb"
    with pytest.raises(ExportError, match=match) as info:
        hf_folder.export_folder(folder, out, max_seq_len=opts.pop("max_seq_len", 16), **opts)
    assert "\n" not in str(info.value)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # no image, no temporary file


def _shard_of(folder: Path, tensor: str) -> Path:
    return folder / json.loads((folder / hf_folder.INDEX).read_text())["weight_map"][tensor]


def test_missing_shard(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    shard = _shard_of(folder, "model.layers.1.self_attn.q_proj.weight")
    shard.unlink()
    _refused(folder, tmp_path, rf"{shard.name}: missing shard \(the index puts tensor model\.")


def test_truncated_shard(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    shard = _shard_of(folder, "model.layers.1.block_sparse_moe.experts.2.w2.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _refused(folder, tmp_path, rf"{shard.name}: not a readable safetensors file \(.*incomplete")


def _rewrite(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_wrong_shape(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    shard = _shard_of(folder, name)
    _rewrite(shard, lambda t: t.__setitem__(name, t[name][:-1].copy()))
    _refused(folder, tmp_path, rf"{shard.name}: tensor {name} has shape \[23, 32\], config.json gives \[24, 32\]")


def test_wrong_dtype(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = _shard_of(folder, name)
    _rewrite(shard, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    _refused(folder, tmp_path, rf"{shard.name}: tensor {name} is I32; Colibri reads F32, F16, BF16")


def test_non_finite_weights(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    shard = _shard_of(folder, name)

    def poison(t):
        t[name] = t[name].copy()
        t[name][2, 3] = np.nan
    _rewrite(shard, poison)
    _refused(folder, tmp_path, rf"{shard.name}: tensor {name}: 1 of 768 values are NaN/Inf", dtype="q8")


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, match", [
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type 'linear'"),
    ({"sliding_window": 8}, "a sliding window of 8 tokens in layer 0, shorter than max_seq_len=16"),
    ({"hidden_act": "gelu_10"}, "hidden_act 'gelu_10'"),
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM is not a supported causal LM"),
    ({"num_key_value_heads": 4}, r"k_proj.weight has shape \[16, 32\], config.json gives \[32, 32\]"),
    ({"vocab_size": 100}, r"model.embed_tokens.weight holds 96 token rows, config.json's vocab_size is 100"),
    ({"num_hidden_layers": 1}, "is past config.json's num_hidden_layers=1"),
    ({"final_logit_softcapping": 30.0}, "scaled or soft-capped logits"),
    ({"clip_qkv": 8.0}, r"clip_qkv=8.0 \(clamped q/k/v\)"),
    # values of the wrong kind, refused before any arithmetic uses them (found by the fuzz test)
    ({"num_key_value_heads": 0}, r"num_key_value_heads is 0, a positive integer is expected"),
    ({"hidden_act": ["silu"]}, r'hidden_act is \["silu"\], a string is expected'),
    ({"rms_norm_eps": "1e-6"}, r'rms_norm_eps is "1e-6", a number is expected'),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, r"rope_parameters.rope_theta is \[1\]"),
    ({"tie_word_embeddings": 1}, r"tie_word_embeddings is 1, true or false is expected"),
])
def test_config_the_engine_would_compute_differently(folders, tmp_path, changes, match):
    folder = _mixtral_f32(folders, tmp_path)
    _edit_config(folder, **changes)
    _refused(folder, tmp_path, match)


def test_index_naming_no_shard_file(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    index = folder / hf_folder.INDEX
    doc = json.loads(index.read_text())
    doc["weight_map"]["lm_head.weight"] = 7
    index.write_text(json.dumps(doc))
    _refused(folder, tmp_path, r"weight_map must map tensor names to shard file names in the folder")


def test_head_disagreeing_with_the_vocabulary(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    shard = _shard_of(folder, "lm_head.weight")
    _rewrite(shard, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:90].copy()))
    _refused(folder, tmp_path, r"tensor lm_head.weight has shape \[90, 32\], for a vocabulary of 96")


def test_a_failure_leaves_the_old_file(folders, tmp_path):
    folder = _mixtral_f32(folders, tmp_path)
    out = tmp_path / "m.clb"
    out.write_bytes(b"old")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"  # late in the file: payloads already written
    shard = _shard_of(folder, name)

    def poison(t):
        t[name] = t[name].copy()
        t[name][0, 0] = np.inf
    _rewrite(shard, poison)
    with pytest.raises(ExportError, match=name):
        hf_folder.export_folder(folder, out, max_seq_len=16)
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.clb")] == []


def _past_4_gib() -> Graph:
    def never():
        raise AssertionError("read")

    big = hf_folder.PlannedWeight(name="layers.0", where="x", shape=(70_000, 16_384), load=never)
    return Graph(layers=[Embedding(big), Linear(big)], input_size=70_000, output_size=70_000)


def test_an_image_past_4_gib_is_laid_out_as_version_7_before_writing():
    """4.3 GiB of f32 from the records alone: version 7 (64-bit sizes) is chosen before any tensor is
    read; the 4 GiB refusal is gone."""
    plan = stream.layout(_past_4_gib())
    assert plan.version == F.WIDE_VERSION and stream.least_size(plan) > F.NARROW_LIMIT
    assert plan.payload_start == F.WIDE_HEADER_SIZE + F.TENSOR_WIDE.size + 2 * F.LAYER.size + 4


@pytest.mark.parametrize("dtype", ["f16", "q8"])
def test_folder_export_past_the_narrow_limit_is_version_7(folders, tmp_path, monkeypatch, dtype):
    """With the 4 GiB boundary moved below the image (writer.NARROW_LIMIT), the streamed export
    writes version 7: the in-memory export's version-7 bytes, and the same logits as the narrow file,
    bit for bit. The CLI says such an image runs on 64-bit hosts only."""
    from colibri.image import writer

    folder = folders["mixtral", "f32"]
    narrow_path, wide_path = tmp_path / "narrow.clb", tmp_path / "wide.clb"
    colibri.export(folder, narrow_path, max_seq_len=16, dtype=dtype)
    narrow = narrow_path.read_bytes()
    monkeypatch.setattr(writer, "NARROW_LIMIT", len(narrow) - 1)
    result = CliRunner().invoke(main, ["export", str(folder), str(wide_path), "--max-seq-len", "16", "--dtype", dtype])
    assert result.exit_code == 0, result.output
    assert "format v7" in result.output and "runs on 64-bit hosts only" in result.output
    wide = wide_path.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert wide == hf_lm.export_lm(model, max_seq_len=16, dtype=dtype, check=False).image
    assert wide[4] == F.WIDE_VERSION and narrow[4] == F.LM_VERSION
    ids = [3, 1, 4, 1, 5]
    got = colibri.LM(str(wide_path)).forward_tokens(ids)
    assert got.tobytes() == colibri.LM(str(narrow_path)).forward_tokens(ids).tobytes()


def test_an_image_past_4_gib_in_a_narrow_version_is_refused_before_writing(tmp_path):
    with pytest.raises(ExportError, match="past format version 4's 32-bit sizes and offsets"):
        stream.write_file(_past_4_gib(), tmp_path / "big.clb", version=F.LM_VERSION)
    assert list(tmp_path.iterdir()) == []


def test_cli_folder_export_needs_no_torch(folders, tmp_path):
    from helpers.without_torch import LAUNCH, REFUSED

    folder, out = folders["olmoe", "bf16"], tmp_path / "o.clb"
    run = subprocess.run([sys.executable, "-c", LAUNCH, "export", str(folder), str(out), "--max-seq-len", "16",
                          "--dtype", "q4"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert REFUSED not in run.stderr
    want = hf_lm.export_lm(AutoModelForCausalLM.from_pretrained(folder), max_seq_len=16, dtype="q4", check=False)
    assert out.read_bytes() == want.image
