"""The Rust bindings (bindings/rust): exports feature and token models, runs them through the Python
engine, and runs `cargo test --offline` on the workspace with COLIBRI_RUST_FIXTURES naming the files,
so the Rust crates are held to the Python engine's outputs (colibri/tests/engine.rs) and colibri-sys
to colibri.h (colibri-sys/tests/drift.rs). Cargo's target directory is build/rust."""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import image
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.quant.quantize import quantize

from helpers import lmmodels
from helpers.build import CORE, make
from helpers.randmodels import random_model
from helpers.hook_models import BATCH as HOOK_BATCH, DTYPES as HOOK_DTYPES, TOLERANCE as HOOK_TOLERANCE, hook_net

ROOT = Path(__file__).resolve().parents[2]
WORKSPACE = ROOT / "bindings" / "rust"
CARGO = shutil.which("cargo") or next(
    (str(p) for p in [Path.home() / ".cargo" / "bin" / "cargo"] if p.exists()), None)

pytestmark = [pytest.mark.rust, pytest.mark.skipif(
    CARGO is None, reason="cargo is not installed (scripts/setup.sh says how: rustup, https://rustup.rs)")]

# (name, random_model seed, weight dtype)
FEATURE_MODELS = [("feat0-f32", 0, "f32"), ("feat1-f16", 1, "f16"), ("feat2-q8", 2, "q8")]
# (name, token_model seed and options, temperature, top_k, top_p, seed, new tokens)
LM_MODELS = [("lm-greedy", 3, {}, 0.0, 0, 1.0, 0, 10),
             ("lm-sampled", 4, dict(kv_dtype=colibri.model.format.DType.F16), 0.8, 12, 0.9, 1234, 12),
             # experts large enough for colibri_lm_forward_ex to run one token's in row blocks
             ("lm-wide", 5, dict(vocab=300, d=128, heads=4, kv_heads=2, hd=32, hidden=200, max_seq_len=40),
              0.7, 20, 1.0, 77, 10)]


def _write_feature(out: Path, name: str, seed: int, dtype: str) -> str:
    model, d_in, max_batch = random_model(seed)
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, max_batch + 1))
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    calibration = rng.standard_normal((64, d_in)).astype(np.float32) if dtype == "q8" else None
    data = export(model, None, max_batch=max_batch, dtype=dtype, calibration=calibration).image
    (out / f"{name}.bin").write_bytes(data)
    (out / f"{name}.in.f32").write_bytes(x.tobytes())
    (out / f"{name}.ref.f32").write_bytes(colibri.Model(data, reference_kernels=True).forward(x).tobytes())
    (out / f"{name}.opt.f32").write_bytes(colibri.Model(data).forward(x).tobytes())
    return f"feature {name} {batch}"


def _write_lm(out: Path, name: str, seed: int, options: dict, temperature: float, top_k: int, top_p: float,
              sample_seed: int, new: int) -> str:
    data = image.write(lmmodels.token_model(seed, **options))
    lm = colibri.LM(data, reference_kernels=True)
    prompt = np.random.default_rng(seed).integers(0, lm.vocab_size, 5).astype(np.int32)
    lm.reset()
    logits = lm.forward_tokens(prompt)
    tokens = lm.generate(prompt, new, temperature, top_k, top_p, sample_seed)
    (out / f"{name}.bin").write_bytes(data)
    (out / f"{name}.prompt.i32").write_bytes(prompt.tobytes())
    (out / f"{name}.logits.f32").write_bytes(np.ascontiguousarray(logits, np.float32).tobytes())
    (out / f"{name}.gen.i32").write_bytes(np.array(tokens, np.int32).tobytes())
    return f"lm {name} {temperature!r} {top_k} {top_p!r} {sample_seed} {new}"


# Text (colibri/tests/text.rs): token models carrying a tokenizer section trained here.
TEXT_PROMPTS = ["Hello, world!", "Grüße aus Köln — 日本語のテキスト 🎉👍🏽", "  spaces\tand\nlines 12345 it's"]
TEXT_NEW = 10


def _write_text(out: Path) -> list[str]:
    """Per tokenizer kind: the image, then each prompt with the host library's ids, colibri.LM.decode of
    them and colibri.LM.generate_text(prompt, TEXT_NEW) (greedy, reference kernels), all hex or
    comma-separated, for the crate's Tokenizer and TextDecoder to match."""
    from colibri.image import tokenizer_section as TS
    from colibri.runtime import tokenizer_build
    from helpers import tokenizers_trained as trained

    kinds = {"text-bpe": trained.byte_bpe, "text-sp-bpe": trained.sentencepiece_model,
             "text-sp-unigram": lambda d: trained.sentencepiece_model(d, model_type="unigram")}
    lines = []
    for name, make_tokenizer in kinds.items():
        make_tokenizer(out / name)
        section = tokenizer_build.from_folder(out / name)
        g = lmmodels.token_model(7, vocab=section.vocab_size + 2, max_seq_len=96)
        g.tokenizer = TS.pack(section.padded(g.vocab_size))
        data = image.write(g)
        (out / f"{name}.bin").write_bytes(data)
        lm = colibri.LM(data, reference_kernels=True)
        lines.append(f"text {name} {TEXT_NEW} {lm.eos}")
        for prompt in TEXT_PROMPTS:
            ids = lm.encode(prompt)
            lines.append(" ".join(["case", name, prompt.encode().hex(), ",".join(map(str, ids)),
                                   lm.decode(ids).encode().hex() or "-",
                                   lm.generate_text(prompt, TEXT_NEW).encode().hex() or "-"]))
    return lines


def _write_hook(out: Path, name: str, data: bytes, d_in: int) -> str:
    """A model for the accelerator hook tests (colibri/tests/hook.rs): the Rust device must match the
    engine within the tolerance tests/engine/test_engine_hook.py holds the numpy and C devices to."""
    x = (np.random.default_rng(len(name)).standard_normal((HOOK_BATCH, d_in)) * 2).astype(np.float32)
    (out / f"{name}.bin").write_bytes(data)
    (out / f"{name}.in.f32").write_bytes(x.tobytes())
    (out / f"{name}.ref.f32").write_bytes(colibri.Model(data, reference_kernels=True).forward(x).tobytes())
    (out / f"{name}.opt.f32").write_bytes(colibri.Model(data).forward(x).tobytes())
    return f"hook {name} {HOOK_BATCH} {HOOK_TOLERANCE!r}"


def _hook_models(out: Path) -> list[str]:
    # The hook test's network (GLU and MLP experts, a gated shared expert) in every weight dtype, then
    # MLP experts with each activation the exporter writes.
    cases = [_write_hook(out, f"hook-{dtype}", export(hook_net(), None, max_batch=HOOK_BATCH, **options).image, 10)
             for dtype, options in HOOK_DTYPES.items()]
    # Format version 1's int8 companions (f32 scales, 4-byte row pointers, biases as tensors).
    f32_graph = export(hook_net(), None, max_batch=HOOK_BATCH).graph
    v1 = image.write(quantize(f32_graph, "q8", compact=False), version=1)
    cases.append(_write_hook(out, "hook-q8-v1", v1, 10))
    torch.manual_seed(3)
    for act in cnn.ACTIVATIONS:
        net = torch.nn.Sequential(cnn.MoE(10, 3, 17, top_k=2, routing="softmax_topk", activation=act)).eval()
        cases.append(_write_hook(out, f"hook-mlp-{act}", export(net, None, max_batch=HOOK_BATCH).image, 10))
    return cases


# The image records the Rust hook view reads (colibri::layout), field names as docs/model-format.md.
RECORD_FIELDS = {
    "header": (colibri.model.format.HEADER, ["magic", "version", "header_size", "crc32", "image_size", "flags", "input_size",
                                       "output_size", "max_batch", "tensor_count", "tensor_table_offset",
                                       "layer_count", "layer_table_offset", "moe_count", "moe_table_offset",
                                       "expert_count", "expert_table_offset"]),
    "tensor": (colibri.model.format.TENSOR, ["offset", "nbytes", "rows", "cols", "dtype", "ndim", "reserved", "aux"]),
    "expert": (colibri.model.format.EXPERT, ["kind", "activation", "flags", "hidden", "w1", "b1", "w2", "b2", "w3", "b3"]),
    "q4_params": (colibri.model.format.Q4_PARAMS_FIELDS, ["nnz", "group_log2", "flags", "reserved"]),
}

# (rows, cols, nnz, group_log2, bias) of the Q4_PARAMS payloads whose layout the Rust view must place as
# format.q4_layout does: odd and even columns, partial last groups, each row pointer width, with and
# without the bias and E.
Q4_LAYOUTS = [(rows, cols, nnz, g, bias)
              for rows, cols in [(1, 1), (3, 10), (40, 24), (7, 257)]
              for nnz in [0, 1, 255, 256, 65535, 65536]
              for g in [3, 5, 8]
              for bias in [False, True]]


def _field_offsets(record: struct.Struct) -> list[int]:
    """Byte offset of each field of a little-endian, unpadded struct format (pad bytes `Nx` skipped)."""
    offsets, at = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", record.format.lstrip("<")):
        size = struct.calcsize("<" + code) * int(count or 1)
        if code != "x":
            offsets.append(at)
        at += size
    assert at == record.size
    return offsets


def _write_layout(out: Path) -> None:
    lines = []
    for name, (record, fields) in RECORD_FIELDS.items():
        offsets = _field_offsets(record)
        assert len(offsets) == len(fields), name
        lines += [f"{name} {field} {offset}" for field, offset in zip(fields, offsets)]
    (out / "layout.txt").write_text("\n".join(lines) + "\n")
    # q4_layout.txt: rows cols nnz group_log2 bias(0/1) scale bias row_ptr col val size (-1: no such field).
    q4 = []
    for rows, cols, nnz, g, bias in Q4_LAYOUTS:
        at = colibri.model.format.q4_layout(rows, cols, nnz, g, bias)
        fields = [at.get(f, -1) for f in ("scale", "bias", "row_ptr", "col", "val", "size")]
        q4.append(" ".join(map(str, [rows, cols, nnz, g, int(bias), *fields])))
    (out / "q4_layout.txt").write_text("\n".join(q4) + "\n")


def test_cargo_test_against_the_python_engine(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cases = [_write_feature(tmp_path, *m) for m in FEATURE_MODELS]
    cases += [_write_lm(tmp_path, *m) for m in LM_MODELS]
    cases += _hook_models(tmp_path)
    _write_layout(tmp_path)
    (tmp_path / "cases.txt").write_text("\n".join(cases) + "\n")
    (tmp_path / "text.txt").write_text("\n".join(_write_text(tmp_path)) + "\n")
    # colibri-sys's build.rs links the Makefile's libcolibri.a; building it here, under the lock the
    # other pytest workers take, leaves build.rs's own `make` nothing to write.
    built = make("-C", str(CORE), "host")
    assert built.returncode == 0, built.stdout + built.stderr
    env = dict(os.environ, COLIBRI_RUST_FIXTURES=str(tmp_path))
    env["PATH"] = f"{Path(CARGO).parent}{os.pathsep}{env['PATH']}"
    result = subprocess.run([CARGO, "test", "--offline", "--workspace"], cwd=WORKSPACE, env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    passed = sum(int(line.split()[3]) for line in result.stdout.splitlines() if line.startswith("test result: ok."))
    # The drift checks (2), the engine comparisons and error paths (8), the accelerator hook, the
    # image layouts it reads and token models on a pool (15), text (3): none filtered out or missing.
    assert passed >= 28, result.stdout
