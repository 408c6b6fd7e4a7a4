"""A GGUF file exported streamed (colibri.checkpoints.gguf_file; issue 26).

The GGUF files are written by the tests (helpers.gguf_files) from the tiny random Hugging Face
models, in llama.cpp's converter layout. Read back, an F32/F16/BF16 file gives byte for byte the
image the Hugging Face folder of the same weights gives; a Q8_0/Q4_0 file the image of the folder
holding its dequantised weights; Q4_0 carried into q4 holds the GGUF's values exactly. Bad input is
one line naming the file and the tensor or key, and leaves nothing at the output path."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import colibri
from colibri.checkpoints import gguf_file, hf_folder
from colibri.cli import main
from colibri.frontends.hf_lm import LM_RTOL
from colibri.image import reader
from colibri.model.errors import ExportError
from colibri.model.ir import Q4Weight, Q8Weight, dense
from colibri.model.walks import weight_slots
from helpers.gguf_files import (
    GGUF_ARCH,
    block_models,
    dequantised,
    gguf_tensors,
    rope_interleave,
    with_weights,
    write_gguf,
)
from helpers.hf_lm_models import ARCHS

SOURCES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {arch: make() for arch, make in ARCHS.items()}


@pytest.fixture(scope="module")
def blocks() -> dict[str, torch.nn.Module]:
    return block_models()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _folder(model: torch.nn.Module, path: Path) -> Path:
    if not path.exists():
        model.save_pretrained(path, safe_serialization=True, max_shard_size="30KB")
    return path


def _file(model, path: Path, qtype: str, **kw) -> Path:
    return path if path.exists() and not kw else write_gguf(model, path, qtype, **kw)


@pytest.mark.parametrize("src", list(SOURCES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_float_gguf_image_is_the_folder_image(models, root, tmp_path, arch, src):
    """F32, F16 and BF16 files: the image is byte for byte the folder export of the same weights, in
    every dtype (llama's q/k rows back in Hugging Face's order, the engine's RoPE unchanged)."""
    model = copy.deepcopy(models[arch]).to(SOURCES[src])
    folder = _folder(model, root / f"{arch}-{src}")
    file = _file(copy.deepcopy(model).to(torch.float32), root / f"{arch}-{src}.gguf", src)  # the folder's values
    for dtype in ("f32", "f16", "q8", "q4"):
        want, got = tmp_path / f"want-{dtype}.clb", tmp_path / f"got-{dtype}.clb"
        hf_folder.export_folder(folder, want, max_seq_len=16, dtype=dtype)
        result = colibri.export(file, got, max_seq_len=16, dtype=dtype)
        assert got.read_bytes() == want.read_bytes(), (arch, src, dtype)
        assert result.bytes_written == got.stat().st_size


def test_llama_q_k_rows_are_permuted_in_the_file_and_back_in_the_image(models, root):
    """The converter's permutation is not the identity on these heads: without undoing it the image
    would differ from the folder's (the test above)."""
    model = models["mixtral"]
    file = _file(model, root / "mixtral-F32.gguf", "F32")
    values = dequantised(file)
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(values["blk.0.attn_q.weight"], q)
    assert np.array_equal(values["blk.0.attn_q.weight"], rope_interleave(q, 4))
    assert np.array_equal(gguf_file.unpermute_rows(values["blk.0.attn_q.weight"], 4), q)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantised_gguf_is_the_folder_of_its_dequantised_weights(blocks, root, tmp_path, arch, qtype):
    """A Q8_0/Q4_0 file in f32 is byte for byte the folder export of the model holding its
    dequantised weights; in its own dtype (Q4_0 carried into q4, the table kept exact) the C
    engine's logits match PyTorch's on that model within the f32 export check's tolerance."""
    model = blocks[arch]
    file = _file(model, root / f"block-{arch}-{qtype}.gguf", qtype)
    stands_for = with_weights(model, dequantised(file))
    folder = _folder(stands_for, root / f"block-{arch}-{qtype}")
    want, got = tmp_path / "want.clb", tmp_path / "got.clb"
    hf_folder.export_folder(folder, want, max_seq_len=16, dtype="f32")
    gguf_file.export_gguf(file, got, max_seq_len=16, dtype="f32")
    assert got.read_bytes() == want.read_bytes()
    ids = [3, 17, 42, 5, 88, 1, 60, 9]
    with torch.no_grad():
        ref = stands_for(torch.tensor([ids])).logits[0].numpy()
    own = tmp_path / "own.clb"
    result = gguf_file.export_gguf(file, own, max_seq_len=16, keep=["layers.0"] if qtype == "Q4_0" else ())
    assert result.dtype == {"Q8_0": "q8", "Q4_0": "q4"}[qtype]
    logits = colibri.LM(str(own)).forward_tokens(ids)
    bound = LM_RTOL * (1 + np.abs(ref).max())
    if qtype == "Q4_0":  # every weight and bias the file's own: only the order of the arithmetic differs
        assert np.abs(logits - ref).max() <= 0.05 * bound
    else:  # Q8_0 requantised into per-row int8: an error (50-120 of those bounds here), and its report
        assert 0 < np.abs(logits - ref).max() < 300 * bound
        assert all(not r.exact and 0 < r.rel_l2 < 1e-2 for r in result.records.values() if r.kind == "q8")


def _image_weights(path: Path) -> dict[str, np.ndarray]:
    graph = reader.read(path.read_bytes())
    return {name: dense(getattr(owner, attr)) for name, owner, attr in weight_slots(graph)}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("group", [32, 16, 8])
def test_q4_0_carried_into_q4_is_lossless(blocks, root, tmp_path, arch, group):
    """Declared exact is exact: every weight the export records as carried over holds, in the image
    read back, the GGUF's dequantised values (the gguf package's own dequantisation)."""
    model = blocks[arch]
    file = _file(model, root / f"block-{arch}-Q4_0.gguf", "Q4_0")
    out = tmp_path / "q4.clb"
    result = gguf_file.export_gguf(file, out, max_seq_len=16, dtype="q4", group=group)
    image = _image_weights(out)
    source = dequantised(file)
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    carried = [n for n, r in result.records.items() if r.carried]
    assert len(carried) >= 20 and all(result.records[n].exact for n in carried)
    negative_blocks = 0
    for name in carried:
        rec = result.records[name]
        tensor, _, expert = rec.tensor.partition("[")
        want = source[tensor][int(expert[:-1])] if expert else source[tensor]
        if GGUF_ARCH[type(model).__name__] == "llama" and tensor.endswith(("attn_q.weight", "attn_k.weight")):
            want = gguf_file.unpermute_rows(want, heads if "attn_q" in tensor else kv)
        assert np.array_equal(image[name], want), name
        negative_blocks += int((want.reshape(want.shape[0], -1, 32).max(axis=2) > -want.reshape(
            want.shape[0], -1, 32).min(axis=2)).sum())
    assert negative_blocks > 0  # blocks whose largest magnitude is positive: d < 0, the E fix-up exercised
    assert any("Q4_0 -> q4" in line for line in result.lines())



@pytest.mark.parametrize("arch", list(ARCHS))
def test_q4_puts_attention_k_v_in_q8_unless_the_file_has_them_in_q4_0(blocks, root, tmp_path, arch):
    """Quantised by Colibri (an F32 file to q4), k and v are q8 as in the folder export; a Q4_0 file's
    k and v stay int4, carried as they are, like its other Q4_0 matrices."""
    model = blocks[arch]

    def kinds(out: Path) -> dict[str, type]:
        graph = reader.read(out.read_bytes(), check="structure")
        return {n: type(getattr(o, a)) for n, o, a in weight_slots(graph) if n.endswith((".q", ".k", ".v", ".o"))}

    requantised = kinds(_export(_file(model, root / f"block-{arch}-F32.gguf", "F32"), tmp_path / "f.clb"))
    assert {t for n, t in requantised.items() if n.endswith((".k", ".v"))} == {Q8Weight}
    assert {t for n, t in requantised.items() if n.endswith((".q", ".o"))} == {Q4Weight}
    q4_0 = gguf_file.export_gguf(_file(model, root / f"block-{arch}-Q4_0.gguf", "Q4_0"), tmp_path / "c.clb",
                                 max_seq_len=16, dtype="q4")
    carried = {n for n, r in q4_0.records.items() if r.carried}
    kv = {n for n in kinds(tmp_path / "c.clb") if n.endswith((".k", ".v"))}
    assert kv and kv <= carried


def _export(file: Path, out: Path) -> Path:
    gguf_file.export_gguf(file, out, max_seq_len=16, dtype="q4")
    return out


def test_q4_0_block_mapping(tmp_path):
    """The carry-over itself: d < 0 blocks negated, their -8·d codes as 7·|d| plus |d| in E; a subnormal
    scale or a group wider than a block has no exact int4 form (None: requantised instead)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    got = gguf_file.q4_from_q4_0(blocks, 64, 32, None, gguf)
    assert isinstance(got, Q4Weight) and got.q.min() >= -8 and got.q.max() <= 7
    assert np.array_equal(dense(got), want)
    d = blocks.reshape(6, 2, 18)[:, :, :2].copy().view("<f2")[:, :, 0]
    codes = want.reshape(6, 2, 32) / d.astype(np.float32)[:, :, None]  # c - 8
    fixed = int(((codes == -8) & np.signbit(d)[:, :, None]).sum())
    assert got.nnz == fixed >= int(np.signbit(d).sum())  # each negative block's largest weight (and ties) in E
    assert np.all(got.val.astype(np.float32) > 0)
    assert gguf_file.q4_from_q4_0(blocks, 64, 64, None, gguf) is None
    tiny = blocks.copy().reshape(6, 2, 18)
    tiny[0, 0, :2] = np.frombuffer(np.float16(1e-6).tobytes(), np.uint8)  # subnormal in f16
    assert gguf_file.q4_from_q4_0(tiny.reshape(6, 36), 64, 32, None, gguf) is None


def test_group_wider_than_a_block_is_requantised_and_reported(blocks, root, tmp_path):
    file = _file(blocks["olmoe"], root / "block-olmoe-Q4_0.gguf", "Q4_0")
    result = gguf_file.export_gguf(file, tmp_path / "g64.clb", max_seq_len=16, dtype="q4", group=64)
    assert not any(r.carried for r in result.records.values())
    assert any("requantised (Q4_0 -> q4)" in line for line in result.lines())


def test_f16_into_f16_is_exact_and_q8_0_into_f32_too(models, blocks, root, tmp_path):
    r16 = gguf_file.export_gguf(_file(models["qwen3_moe"], root / "qwen3_moe-F16.gguf", "F16"), tmp_path / "a.clb",
                                max_seq_len=16)
    assert r16.dtype == "f16" and all(r.exact for r in r16.records.values())
    r8 = gguf_file.export_gguf(_file(blocks["qwen3_moe"], root / "block-qwen3_moe-Q8_0.gguf", "Q8_0"),
                               tmp_path / "b.clb", max_seq_len=16, dtype="f32")
    assert all(r.exact for r in r8.records.values()) and {r.source for r in r8.records.values()} >= {"Q8_0"}


def test_cli_streams_a_gguf_with_progress_and_report(blocks, root, tmp_path):
    file = _file(blocks["mixtral"], root / "block-mixtral-Q4_0.gguf", "Q4_0")
    out = tmp_path / "m.clb"
    run = CliRunner().invoke(main, ["export", str(file), str(out), "--max-seq-len", "16"])
    assert run.exit_code == 0, run.output
    assert "tensors" in run.output and "peak RSS" in run.output and f"{out.stat().st_size} bytes" in run.output
    assert "dtype q4: the file's own" in run.output
    assert "Q4_0 -> q4" in run.output and "requantised (Q4_0 -> q8)" in run.output  # the q8 table
    want = tmp_path / "want.clb"
    gguf_file.export_gguf(file, want, max_seq_len=16, dtype="q4")
    assert out.read_bytes() == want.read_bytes()
    run = CliRunner().invoke(main, ["export", str(file), str(out), "--max-seq-len", "16", "--dtype", "f32"])
    assert run.exit_code == 0 and "the file's own" not in run.output and "requantised" not in run.output


def test_cli_gguf_export_needs_no_torch(models, root, tmp_path):
    from helpers.without_torch import LAUNCH, REFUSED

    file, out = _file(models["olmoe"], root / "olmoe-F16.gguf", "F16"), tmp_path / "o.clb"
    run = subprocess.run([sys.executable, "-c", LAUNCH, "export", str(file), str(out), "--max-seq-len", "16",
                          "--dtype", "q8"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert REFUSED not in run.stderr
    want = tmp_path / "want.clb"
    gguf_file.export_gguf(file, want, max_seq_len=16, dtype="q8")
    assert out.read_bytes() == want.read_bytes()


def test_max_seq_len_is_asked_for_with_the_files_context_length(models, root, tmp_path):
    file, out = _file(models["olmoe"], root / "olmoe-F32.gguf", "F32"), tmp_path / "o.clb"
    with pytest.raises(ExportError, match=r"max_seq_len.*context_length is 256"):
        colibri.export(file, out)
    run = CliRunner().invoke(main, ["export", str(file), str(out)])
    assert run.exit_code == 1 and "--max-seq-len" in run.output and "context_length is 256" in run.output
    assert not out.exists()


# ---------------------------------------------------------------------------
# Bad input: one line naming the file and the tensor or key, nothing written


def _refused(file: Path, tmp_path: Path, match: str, **opts) -> None:
    out = tmp_path / "out" / "m.clb"
    with pytest.raises(ExportError, match=match) as info:
        gguf_file.export_gguf(file, out, max_seq_len=opts.pop("max_seq_len", 16), **opts)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(file))
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # no image, no temporary file


def _tensors(model) -> dict[str, np.ndarray]:
    return gguf_tensors(model)


def test_unsupported_tensor_type_is_refused_by_name(blocks, tmp_path):
    file = write_gguf(blocks["olmoe"], tmp_path / "q5.gguf", "Q8_0", types={"blk.1.ffn_down_exps.weight": "Q5_0"})
    _refused(file, tmp_path, r"tensor blk\.1\.ffn_down_exps\.weight: GGUF type Q5_0 is not supported "
                             r"\(F32, F16, BF16, Q8_0, Q4_0")


def test_wrong_dtype_is_refused_by_name(models, tmp_path):
    t = _tensors(models["olmoe"])
    t["blk.0.attn_norm.weight"] = t["blk.0.attn_norm.weight"].astype(np.int32)
    file = write_gguf(models["olmoe"], tmp_path / "i32.gguf", tensors=t, types={"blk.0.attn_norm.weight": "I32"})
    _refused(file, tmp_path, r"tensor blk\.0\.attn_norm\.weight: GGUF type I32 is not supported")


@pytest.mark.parametrize("arch, match", [
    ("gemma2", r"general\.architecture 'gemma2' is not a model Colibri exports \(supported: llama, qwen2moe"),
    ("llama-dense", r"llama\.expert_count is 0 or missing: a dense llama model"),
])
def test_unsupported_architecture(models, tmp_path, arch, match):
    def meta(w):
        if arch == "gemma2":
            w.kv_data[0].pop("general.architecture")
            w.add_string("general.architecture", "gemma2")
        else:
            w.kv_data[0].pop("llama.expert_count")
    _refused(write_gguf(models["mixtral"], tmp_path / "a.gguf", metadata=meta), tmp_path, match)


@pytest.mark.parametrize("cut", ["header", "tensor data"])
def test_truncated_file(models, root, tmp_path, cut):
    data = _file(models["qwen2_moe"], root / "qwen2_moe-F32.gguf", "F32").read_bytes()
    file = tmp_path / "t.gguf"
    file.write_bytes(data[:200] if cut == "header" else data[:-100])
    _refused(file, tmp_path, r"not a readable GGUF file \(")


def test_wrong_shape(models, tmp_path):
    t = _tensors(models["qwen3_moe"])
    t["blk.1.ffn_up_exps.weight"] = t["blk.1.ffn_up_exps.weight"][:, :-1].copy()
    file = write_gguf(models["qwen3_moe"], tmp_path / "s.gguf", tensors=t)
    _refused(file, tmp_path, r"tensor blk\.1\.ffn_up_exps\.weight has shape \[32, 15, 6\], the metadata gives "
                             r"\[32, 16, 6\] \(GGUF order\)")


def test_missing_tensor(models, tmp_path):
    t = _tensors(models["mixtral"])
    del t["blk.1.attn_k.weight"]
    _refused(write_gguf(models["mixtral"], tmp_path / "m.gguf", tensors=t), tmp_path,
             r"no tensor blk\.1\.attn_k\.weight \(a llama model has it\)")


def test_vocabulary_disagreeing_with_the_embedding(models, tmp_path):
    def fewer(w):
        w.kv_data[0].pop("tokenizer.ggml.tokens")
        w.add_token_list([f"t{i}" for i in range(95)])
    _refused(write_gguf(models["olmoe"], tmp_path / "v.gguf", metadata=fewer), tmp_path,
             r"tokenizer\.ggml\.tokens holds 95 tokens, tensor token_embd\.weight 96 rows")

    def declared(w):
        w.kv_data[0].pop("llama.vocab_size")
        w.add_vocab_size(100)
    _refused(write_gguf(models["mixtral"], tmp_path / "d.gguf", metadata=declared), tmp_path,
             r"llama\.vocab_size=100, tensor token_embd\.weight holds 96")
    t = _tensors(models["mixtral"])
    t["output.weight"] = t["output.weight"][:90].copy()
    _refused(write_gguf(models["mixtral"], tmp_path / "o.gguf", tensors=t), tmp_path,
             r"tensor output\.weight has shape \[32, 90\], the vocabulary of token_embd\.weight \(96\) gives "
             r"\[32, 96\]")


def _with(key: str, value, kind: str = "uint32"):
    def edit(w):
        w.kv_data[0].pop(key, None)
        getattr(w, f"add_{kind}")(key, value)
    return edit


@pytest.mark.parametrize("arch, edit, match", [
    ("olmoe", _with("olmoe.rope.scaling.type", "linear", "string"), r"scaled RoPE \(olmoe\.rope\.scaling\.type=linear"),
    ("olmoe", _with("olmoe.expert_used_count", 9), r"olmoe\.expert_used_count=9 with 4 experts"),
    ("olmoe", _with("olmoe.block_count", "two", "string"), r"metadata olmoe\.block_count is string, an integer"),
    ("mixtral", _with("llama.rope.dimension_count", 4), r"rope\.dimension_count=4 rotates part of a 8-wide head"),
    ("olmoe", _with("olmoe.attention.sliding_window", 8), r"a sliding window of 8 tokens in layer 0, shorter than "
                                                          r"max_seq_len=16"),
    ("qwen3_moe", _with("qwen3moe.expert_weights_scale", 2.5, "float32"), r"expert_weights_scale=2\.5"),
    ("qwen2_moe", _with("qwen2moe.attention.layer_norm_rms_epsilon", 0.0, "float32"),
     r"rms_norm_eps=0, the engine needs eps > 0"),
    ("olmoe", _with("olmoe.attention.head_count_kv", 3), r"tensor blk\.0\.attn_k\.weight has shape \[32, 8\], the "
                                                         r"metadata gives \[32, 24\]"),
])
def test_metadata_the_engine_would_compute_differently(models, tmp_path, arch, edit, match):
    _refused(write_gguf(models[arch], tmp_path / "m.gguf", metadata=edit), tmp_path, match)


def test_unknown_and_scaling_tensors(models, tmp_path):
    t = _tensors(models["olmoe"])
    t["blk.0.ffn_gate.0.weight"] = np.zeros((16, 32), np.float32)  # the old per-expert Mixtral layout
    _refused(write_gguf(models["olmoe"], tmp_path / "u.gguf", tensors=t), tmp_path,
             r"tensor blk\.0\.ffn_gate\.0\.weight is not part of a olmoe model as Colibri reads it")
    t = _tensors(models["mixtral"])
    t["rope_freqs.weight"] = np.ones(4, np.float32)
    _refused(write_gguf(models["mixtral"], tmp_path / "r.gguf", tensors=t), tmp_path, r"scaled RoPE")


def test_non_finite_weights(models, tmp_path):
    t = _tensors(models["qwen2_moe"])
    t["blk.0.ffn_down_exps.weight"] = t["blk.0.ffn_down_exps.weight"].copy()
    t["blk.0.ffn_down_exps.weight"][2, 3, 4] = np.inf
    file = write_gguf(models["qwen2_moe"], tmp_path / "n.gguf", tensors=t)
    _refused(file, tmp_path, r"tensor blk\.0\.ffn_down_exps\.weight\[2\]: 1 of 512 values are NaN/Inf", dtype="q8")


def test_a_failure_leaves_the_old_file(models, tmp_path):
    t = _tensors(models["mixtral"])
    t["output.weight"] = t["output.weight"].copy()
    t["output.weight"][5, 5] = np.nan  # the last tensor written: the others are on disk by then
    file = write_gguf(models["mixtral"], tmp_path / "late.gguf", tensors=t)
    out = tmp_path / "m.clb"
    out.write_bytes(b"old")
    with pytest.raises(ExportError, match="output.weight"):
        gguf_file.export_gguf(file, out, max_seq_len=16)
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.clb")] == []


@pytest.mark.parametrize("count, match", [
    (10**5 + 3, r"runs past the end of the file"),  # the reader would read empty fields past it
    (10**7, r"a metadata array of 10000000 elements at byte \d+ \(at most 2097152 are read\)"),
])
def test_corrupt_array_length(models, root, tmp_path, count, match):
    """A metadata array's length past the file or past any tokenizer: refused at once (the gguf
    package alone loops over it, building objects until memory runs out)."""
    file = _file(models["olmoe"], root / "olmoe-F32.gguf", "F32")
    reader = gguf.GGUFReader(file)
    length = reader.fields["tokenizer.ggml.token_type"].parts[4]  # its u64 element count
    at = length.ctypes.data - reader.data.ctypes.data
    data = bytearray(file.read_bytes())
    data[at : at + 8] = count.to_bytes(8, "little")
    bad = tmp_path / "array.gguf"
    bad.write_bytes(data)
    _refused(bad, tmp_path, match)


def test_not_a_gguf_file(tmp_path):
    file = tmp_path / "x.gguf"
    file.write_bytes(b"GGML" + bytes(100))
    _refused(file, tmp_path, r"not a readable GGUF file \(ValueError: GGUF magic invalid\)")
    with pytest.raises(ExportError, match="no such GGUF file"):
        gguf_file.export_gguf(tmp_path / "none.gguf", tmp_path / "o.clb", max_seq_len=4)


# ---------------------------------------------------------------------------
# Tokenizer metadata, for the image's tokenizer section


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_metadata_is_what_the_gguf_package_reads(models, tmp_path, kind):
    file = write_gguf(models["olmoe"], tmp_path / f"{kind}.gguf", tokenizer=kind,
                      metadata=_with("tokenizer.chat_template", "{{ messages }}", "string"))
    tok = gguf_file.tokenizer_metadata(file)
    fields = gguf.GGUFReader(file).fields
    assert tok.model == kind
    assert [t.decode() for t in tok.tokens] == fields["tokenizer.ggml.tokens"].contents()
    assert tok.token_types == fields["tokenizer.ggml.token_type"].contents()
    assert tok.special == ({"unknown": 0, "bos": 1, "eos": 2} if kind == "llama" else {"bos": 0, "eos": 1})
    assert tok.chat_template == "{{ messages }}"
    if kind == "llama":
        assert tok.scores == fields["tokenizer.ggml.scores"].contents() and tok.merges is None
    else:
        assert [m.decode() for m in tok.merges] == fields["tokenizer.ggml.merges"].contents()
        assert tok.pre == "default" and tok.scores is None


def test_tokenizer_metadata_refuses_what_does_not_fit(models, tmp_path):
    def short_scores(w):
        w.add_token_scores([0.0] * 5)
    bad = write_gguf(models["olmoe"], tmp_path / "s.gguf", tokenizer="gpt2", metadata=short_scores)
    with pytest.raises(ExportError, match=r"tokenizer\.ggml\.scores holds 5 entries for 96 tokens"):
        gguf_file.tokenizer_metadata(bad)
    eos = write_gguf(models["olmoe"], tmp_path / "e.gguf", metadata=_with("tokenizer.ggml.eos_token_id", 500))
    with pytest.raises(ExportError, match=r"eos_token_id=500 is past the 96 tokens"):
        gguf_file.tokenizer_metadata(eos)
    t = _tensors(models["olmoe"])

    def none(w):
        for key in [k for k in w.kv_data[0] if k.startswith("tokenizer.")]:
            w.kv_data[0].pop(key)
    bare = write_gguf(models["olmoe"], tmp_path / "n.gguf", tensors=t, metadata=none)
    assert gguf_file.tokenizer_metadata(bare) is None
    gguf_file.export_gguf(bare, tmp_path / "n.clb", max_seq_len=8)  # no vocabulary: nothing to disagree with



def test_without_the_gguf_package_the_extra_is_named(models, root, tmp_path):
    file = _file(models["olmoe"], root / "olmoe-F32.gguf", "F32")
    refuse_gguf = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "gguf":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Refuse())
sys.argv = ["colibri", *sys.argv[1:]]
from colibri.cli import main
main()
"""
    out = tmp_path / "o.clb"
    run = subprocess.run([sys.executable, "-c", refuse_gguf, "export", str(file), str(out), "--max-seq-len", "8"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "pip install 'colibri-moe[gguf]'" in run.stderr, run.stderr
    assert not out.exists()
