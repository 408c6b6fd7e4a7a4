"""`make bench-lm-gguf`'s exact answer (bench/gguf_exact.py): a float64 forward over a GGUF file's
dequantised weights, the yardstick both engines are measured against. It must compute the model the
file holds (checked against Hugging Face in float64 on the four architectures, llama's permuted q/k
rows included), its emulation of llama.cpp's activation rounding must be ggml's codec, and Colibri's
import of Q8_0/Q4_0 files at f32 must reproduce it, routing included (read through the bench's C
driver, as the bench reads it)."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gguf_exact  # noqa: E402
import lm_vs_llama_cpp as bench  # noqa: E402
from helpers.gguf_files import block_models, gguf_tensors, write_gguf  # noqa: E402

TOKENS = 12


@pytest.fixture(scope="module")
def models():
    return block_models()


def _ids(model, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, TOKENS).astype(np.int32)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_the_exact_forward_is_the_hugging_face_model(models, tmp_path, arch):
    model = models[arch]
    file = write_gguf(model, tmp_path / f"{arch}.gguf", "F32")
    ids = _ids(model)
    got = gguf_exact.exact_forward(file, ids)
    wide = type(model)(model.config).double().eval()
    wide.load_state_dict(model.state_dict())
    wide.set_experts_implementation("eager")
    with torch.no_grad():
        want = wide(torch.from_numpy(ids[None].astype(np.int64))).logits[0].numpy()
    # Hugging Face's eager attention takes its softmax in float32: that is the whole difference.
    assert np.abs(got.logits - want).max() < 1e-6 * np.abs(want).max()
    dense = set(getattr(model.config, "mlp_only_layers", None) or [])
    assert sorted(got.chosen) == [i for i in range(model.config.num_hidden_layers) if i not in dense]
    for layer, chosen in got.chosen.items():
        assert chosen.shape == (TOKENS, model.config.num_experts_per_tok)
        np.testing.assert_allclose(got.probs[layer].sum(axis=1), 1.0, rtol=1e-12)


def test_a_wrong_rope_order_is_seen(models, tmp_path):
    """The yardstick tells the file's RoPE order apart: Mixtral's q/k rows left in Hugging Face's
    order (not permuted as llama.cpp's converter permutes them) give another model."""
    model = models["mixtral"]
    ids = _ids(model)
    tensors = gguf_tensors(model)
    state = model.state_dict()
    for i in range(model.config.num_hidden_layers):
        for gguf_name, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"model.layers.{i}.self_attn.{hf_name}.weight"].numpy()
    right = gguf_exact.exact_forward(write_gguf(model, tmp_path / "right.gguf", "F32"), ids).logits
    wrong = gguf_exact.exact_forward(write_gguf(model, tmp_path / "wrong.gguf", "F32", tensors=tensors), ids).logits
    assert np.abs(right - wrong).max() > 1e-3 * np.abs(right).max()


def test_the_emulated_rounding_is_ggmls_codec():
    x = np.random.default_rng(3).normal(size=(5, 96))
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(x.astype(np.float32), q8_0)
    np.testing.assert_array_equal(gguf_exact.q8_0_round(x, gguf), gguf.quants.dequantize(blocks, q8_0))
    # Per block of 32: within half a step d = max|x| / 127, plus 127 codes times the f16 scale's rounding
    # (d·2^-11), and not exact: it is a rounding.
    step = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    err = np.abs(gguf_exact.q8_0_round(x, gguf) - x).reshape(-1, 32)
    assert (err <= (0.5 + 127 * 2.0**-11) * step).all() and err.max() > 0.1 * step.min()
    with pytest.raises(ValueError, match="act_rounding"):
        gguf_exact.Forward(None, "fp8")


def test_emulated_rounding_moves_a_quantised_file_and_not_an_f32_one(models, tmp_path):
    model = models["olmoe"]
    ids = _ids(model)
    f32 = write_gguf(model, tmp_path / "f32.gguf", "F32")
    q8 = write_gguf(model, tmp_path / "q8.gguf", "Q8_0")
    for file, moved in ((f32, False), (q8, True)):
        exact = gguf_exact.exact_forward(file, ids).logits
        rounded = gguf_exact.exact_forward(file, ids, act_rounding="ggml").logits
        assert (np.abs(exact - rounded).max() > 1e-4 * np.abs(exact).max()) == moved


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_colibris_f32_import_is_the_exact_answer(models, tmp_path, arch, qtype):
    """Colibri's engine on the import at f32 holds the file's dequantised weights: its logits are the
    float64 forward's to f32 arithmetic, and every token goes to the same experts."""
    model = models[arch]
    layers = model.config.num_hidden_layers
    # The routers quantised too (llama-quantize --pure keeps ffn_gate_inp F32): every product is of blocks.
    pure = {f"blk.{i}.ffn_gate_inp.weight": qtype for i in range(layers)}
    file = write_gguf(model, tmp_path / f"{arch}.gguf", qtype, types=pure)
    image = tmp_path / f"{arch}.clb"
    import colibri

    colibri.export(file, image, max_seq_len=32, max_batch=TOKENS, dtype="f32", check=False)
    bench.OUT = tmp_path
    driver = bench.colibri_driver()
    ids = _ids(model, 5)
    exact = gguf_exact.exact_forward(file, ids)
    got, routes = bench.colibri_logits(driver, image, ids, TOKENS, model.config.vocab_size, routes=True)
    assert bench.against_exact(got, exact.logits)["rel"] < 1e-5
    assert not bench.route_flips(routes, exact.chosen).any()
    for layer in set(routes) - set(exact.chosen):  # a dense layer: Colibri's one expert behind a zero router
        assert (routes[layer] == 0).all() and routes[layer].shape == (TOKENS, 1)


def test_forced_routes_are_followed(models, tmp_path):
    """Forcing the forward's own choice changes nothing; forcing another choice is what that costs."""
    model = models["mixtral"]
    ids = _ids(model)
    file = write_gguf(model, tmp_path / "m.gguf", "F32")
    own = gguf_exact.exact_forward(file, ids)
    assert np.array_equal(gguf_exact.exact_forward(file, ids, routes=own.chosen).logits, own.logits)
    other = {layer: (chosen + 1) % model.config.num_local_experts for layer, chosen in own.chosen.items()}
    moved = gguf_exact.exact_forward(file, ids, routes=other)
    assert all(np.array_equal(np.sort(moved.chosen[i], axis=1), np.sort(other[i], axis=1)) for i in other)
    assert np.abs(moved.logits - own.logits).max() > 1e-3 * np.abs(own.logits).max()
    with pytest.raises(ValueError, match="forced routes of layer 0"):
        gguf_exact.exact_forward(file, ids, routes={i: c[:, :1] for i, c in own.chosen.items()})
