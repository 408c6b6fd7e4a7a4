"""`make bench-lm-gguf` (bench/lm_vs_llama_cpp.py --gguf-import): Colibri's GGUF import on llama.cpp's
own files (its converter's F32/F16, llama-quantize --pure Q8_0/Q4_0 of the bench's tiny random Mixtral)
against llama.cpp on the same file, and both against the exact answer. Runs where llama.cpp is built (make bench-lm-setup); the figures
for the bench's larger models are printed by the make target, never asserted here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import lm_vs_llama_cpp as bench  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(not bench.llama_built(), reason=bench.SETUP_HINT)
def test_colibri_on_llama_cpp_files_computes_what_llama_cpp_does(tmp_path):
    out = bench.main(["--gguf-import", "--quick", "--out", str(tmp_path), "--cache", str(tmp_path / "cache")])
    rows = {(r["file"], r["colibri_dtype"]): r for r in out["gguf_import"]}
    assert set(rows) == {(t, d) for t in bench.LLAMA_TYPES for d in ("f32", "own")}
    # The F32 file: the same weights and the same arithmetic up to its order.
    assert rows["F32", "f32"]["rel"] < 1e-5 and rows["F32", "own"]["rel"] < 1e-5, rows["F32", "f32"]
    # The others: Colibri's f32 holds the file's dequantised weights exactly; what is left is llama.cpp
    # rounding its activations (to f16 for F16, 8-bit blocks for Q8_0/Q4_0) and, at the file's own dtype,
    # Colibri's requantised tables (measured on this model: F16 2.9e-4, Q8_0 5.7e-3 and 8.6e-3, Q4_0 7.5e-3
    # and 7.9e-3 of max |logit|).
    assert rows["F16", "f32"]["rel"] < 2e-3 and rows["F16", "own"]["rel"] < 2e-3, rows["F16", "f32"]
    for ftype in ("Q8_0", "Q4_0"):
        for dtype in ("f32", "own"):
            row = rows[ftype, dtype]
            assert row["rel"] < 0.03 and row["argmax_agree"] >= 0.9, row
    # Beside the exact answer (bench/gguf_exact.py, float64 over the file's dequantised weights): Colibri's
    # f32 import is it to f32 arithmetic on every file, routing alike; llama.cpp made to route as it did
    # is no further from it than llama.cpp itself.
    for (ftype, dtype), row in rows.items():
        llama = row["llama_vs_exact"]
        assert llama["exact_on_its_routes"]["rel"] <= llama["exact"]["rel"] + 1e-9, row
        if dtype == "f32":
            assert row["colibri_vs_exact"]["rel"] < 1e-5 and row["colibri_vs_exact"]["route_flips_vs_exact"] == 0, row
    assert rows["F32", "f32"]["llama_vs_exact"]["exact"]["rel"] < 1e-5
    assert json.loads((tmp_path / "gguf_import.json").read_text())["gguf_import"] == out["gguf_import"]
