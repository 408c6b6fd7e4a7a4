"""Token-model accuracy against Hugging Face (issue 12): for each architecture's tiny random config
(the ones tests/test_hf_lm.py checks), the reference's f32 logits against the model's over an
8-token prefill and 40 single-token steps, and f16 / q8 exports' relative error and greedy
agreement with the f32 image. Deterministic (fixed seeds); prints one line per architecture.

    PYTHONPATH=host_tools python scripts/lm_accuracy.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import colibri  # noqa: E402
from colibri.frontends import hf_lm  # noqa: E402
from colibri.reference import LMState  # noqa: E402
from colibri.image import read as read_image  # noqa: E402
from test_hf_lm import ARCHS, MAX_SEQ_LEN  # noqa: E402

PROMPT = [3, 17, 42, 5, 9, 77]


def main() -> None:
    for name, build in ARCHS.items():
        model = build()
        f32 = colibri.export(model, max_seq_len=MAX_SEQ_LEN, max_batch=8).image
        ids = [int(t) for t in np.random.default_rng(5).integers(0, model.config.vocab_size, 48)]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        state = LMState(read_image(f32))
        got = np.concatenate([state.forward_tokens(ids[:8])] + [state.forward_tokens([t]) for t in ids[8:]])
        err = float(np.abs(got - want).max())
        bar = 1e-4 * (1 + float(np.abs(want).max()))
        greedy = LMState(read_image(f32)).generate(PROMPT, 24)
        with torch.no_grad():
            hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)[0, len(PROMPT):].tolist()
        parts = [f"{name}: f32 max|Δ| {err:.2e} (bar {bar:.2e}, 48 positions), greedy = HF {greedy == hf}"]
        for dtype, kv in (("f16", "f16"), ("q8", "f32")):
            r = colibri.export(model, max_seq_len=MAX_SEQ_LEN, max_batch=8, dtype=dtype, kv_dtype=kv)
            rel = r.checks[0].error / (r.checks[0].tolerance / hf_lm.LM_RTOL)
            same = sum(a == b for a, b in zip(LMState(read_image(r.image)).generate(PROMPT, 24), greedy))
            parts.append(f"{dtype}/{kv}-cache rel. error {rel:.1e}, greedy {same}/24")
        print("; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
