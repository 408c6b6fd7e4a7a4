"""`make bench-lm`'s harness (bench/lm_vs_llama_cpp.py) does not rot: its Colibri half runs on the tiny
models every time (the C driver, the export, the check against Hugging Face, the speed rows, the King
James perplexity), and the CI-sized run beside llama.cpp runs wherever llama.cpp is built. Timings are
printed by the bench, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import lm_vs_llama_cpp as bench  # noqa: E402

RECORDED = json.loads((ROOT / "examples" / "tiny_lm" / "model" / "metrics.json").read_text())


def _rows(out: dict, key: str, **match) -> list[dict]:
    return [r for r in out[key] if all(r.get(k) == v for k, v in match.items())]


def _check_colibri(out: dict) -> None:
    f32 = _rows(out, "check", model="tiny", engine="colibri", dtype="f32")[0]
    assert f32["rel"] < 1e-5 and f32["rms_rel"] < 1e-5, f32  # the same model as Hugging Face's
    for dtype in ("f16", "q8", "q4", "q8b", "q4b"):  # each costs something, and not the model
        row = _rows(out, "check", model="tiny", engine="colibri", dtype=dtype)[0]
        assert f32["max_abs"] < row["max_abs"] and row["rel"] < 0.2, row
        assert f32["rms_rel"] < row["rms_rel"] < 0.2, row
    for dtype in bench.COLIBRI_DTYPES:
        for threads in (1, 2):
            (row,) = _rows(out, "speed", model="tiny", engine="colibri", dtype=dtype, threads=threads)
            assert row["decode_tps"] > 0 and row["prefill_tps"] > 0, row
            # The driver maps the image and holds the arena: its peak RSS is at least the file's bytes.
            assert row["max_rss_bytes"] > row["file_bytes"] > 0, row
    ppl = {r["dtype"]: r["perplexity"] for r in _rows(out, "perplexity", engine="colibri")}
    assert set(ppl) == {"f32", "f16", "q8", "q4"}
    # 64 windows (the bench's default) are the slice metrics.json records PyTorch's f32 perplexity for.
    assert abs(ppl["f32"] - RECORDED["test_slice"]["held_out_perplexity_per_byte"]) < 1e-3, ppl
    assert abs(ppl["q8"] - ppl["f32"]) < 0.02 * ppl["f32"], ppl


@pytest.mark.slow
def test_the_colibri_half_runs_on_the_tiny_models(tmp_path, capsys):
    out = bench.main(["--quick", "--colibri-only", "--out", str(tmp_path), "--cache", str(tmp_path / "cache")])
    _check_colibri(out)
    printed = capsys.readouterr().out
    assert "| tiny | q4b |" in printed
    assert json.loads((tmp_path / "results.json").read_text())["table"] == out["table"]


def test_the_driver_refuses_what_is_not_a_token_model(tmp_path):
    driver = bench.colibri_driver()
    junk = tmp_path / "junk.clb"
    junk.write_bytes(b"not a model" * 16)
    r = subprocess.run([str(driver), "speed", str(junk), "1", "4", "4", "4", "1"], capture_output=True, text=True)
    assert r.returncode == 1 and "lm_driver:" in r.stderr and "junk.clb" in r.stderr, r.stderr
    r = subprocess.run([str(driver), "speed", str(junk), "0", "4", "4", "4", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "WORKERS must be an integer in 1..256" in r.stderr, r.stderr
    r = subprocess.run([str(driver), "nonsense"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not bench.llama_built(), reason=bench.SETUP_HINT)
def test_the_ci_sized_run_beside_llama_cpp(tmp_path):
    out = bench.main(["--quick", "--out", str(tmp_path), "--cache", str(tmp_path / "cache")])
    _check_colibri(out)
    # Flash attention off and an f32 cache: llama.cpp's F32 file is the same model too.
    (f32,) = _rows(out, "check", model="tiny", engine="llama.cpp", dtype="F32")
    assert f32["rel"] < 1e-5, f32
    for ftype in bench.LLAMA_TYPES:
        for threads in (1, 2):
            (row,) = _rows(out, "speed", model="tiny", engine="llama.cpp", dtype=ftype, threads=threads)
            assert row["decode_tps"] > 0 and row["prefill_tps"] > 0 and row["max_rss_bytes"] > row["file_bytes"]
    # llama.cpp's Qwen3-MoE has no dense layers, and the King James model's first layer is one: only
    # Colibri's perplexity rows (the converter's refusal is printed).
    assert not _rows(out, "perplexity", engine="llama.cpp")
    assert "| tiny | q4 | Q4_0 |" in out["table"]
    assert (tmp_path / "bench_lm.png").stat().st_size > 1000
