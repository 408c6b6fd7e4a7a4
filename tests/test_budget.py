"""`colibri quantize --target BOARD` (colibri.target.budget): per-weight dtypes that fit a board's model slot and
the runner's arena with the least error, or a clear refusal.

The budgets are the board support's own: the slot capacity of colibri.target.slots.LAYOUTS and
RUNNER_ARENA_CAPACITY of boards/<board>/board.mk (what the runner is built with)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from colibri.target import budget, slots
from colibri.runtime import engine
from colibri import image
from colibri.target.budget import Board, BudgetError
from colibri.model.ir import F16Weight, Q8Weight
from colibri.model.walks import weight_slots
from colibri.quant.quantize import quantize

from conftest import ROOT
from test_quantize import graph_of, inputs

sys.path[:0] = [str(ROOT / "examples" / "tiny_lm"), str(ROOT / "examples" / "smart_meter")]


def test_the_nucleo_budget_is_the_board_supports() -> None:
    b = budget.board("nucleo_h743zi")
    mk = (ROOT / "boards" / "nucleo_h743zi" / "board.mk").read_text()
    assert b.arena == int(re.search(r"RUNNER_ARENA_CAPACITY=(\d+)", mk).group(1)) == 224 * 1024
    assert b.flash == slots.LAYOUTS["nucleo_h743zi"].capacity == 512 * 1024 - slots.SLOT_HEADER_SIZE
    with pytest.raises(Exception, match="unknown board 'esp32'; boards: mps2_an500, nucleo_h743zi"):
        budget.board("esp32")


@pytest.fixture(scope="module")
def tiny_lm() -> bytes:
    import evaluate

    return evaluate.image_path("f32").read_bytes()  # exported once, cached under build/tiny_lm


def test_the_trained_tiny_lm_fits_the_nucleo_with_f16_where_q8_leaves_room(tiny_lm: bytes) -> None:
    """f32 is 1.55 MB, q8 (routers f32) 424 KB: the plan spends the slot's remaining ~100 KB on f16
    matrices, with less summed error than all-q8 and held-out perplexity no worse than q8's."""
    import corpus
    import evaluate

    import colibri

    graph = image.read(tiny_lm)
    p = budget.plan(graph, "nucleo_h743zi")
    q8 = image.write(quantize(graph, "q8"))
    assert len(q8) < len(p.image) <= p.board.flash < len(tiny_lm)
    assert p.arena == engine.arena_size(p.image) <= p.board.arena
    dtypes = {c.dtype for c in p.choices}
    assert dtypes == {"f32", "f16", "q8"}
    routers = [c for c in p.choices if c.name.endswith(".router")]
    assert routers and all(c.dtype == "f32" and c.error == 0 for c in routers)
    all_q8 = sum(c.error for c in budget.plan(graph, Board("q8-sized", len(q8), p.board.arena)).choices)
    assert p.error < 0.8 * all_q8
    text = corpus.load().held_out
    nll = {name: evaluate.held_out_nll(colibri.LM(data), text, windows=8)[0]
           for name, data in (("f32", tiny_lm), ("plan", p.image), ("q8", q8))}
    assert nll["f32"] <= nll["plan"] + 1e-4 and nll["plan"] <= nll["q8"]


def test_the_trained_smart_meter_fits_a_tight_board_with_calibration() -> None:
    """The smart meter fits a NUCLEO slot whole in f32 (the plan keeps f32: least error); on a board
    with room for a little more than its q8 image, the calibration-weighted plan mixes dtypes and the
    forecast stays within 1% of the f32 MAE."""
    import forecaster as FC

    from colibri import reference
    from colibri.frontends.exporter import build_graph

    torch.set_num_threads(1)
    data = FC.dataset()
    moe = FC.train(FC.build_moe(), data, steps=1500)
    graph, _ = build_graph(moe, max_batch=7)
    whole = budget.plan(graph, "nucleo_h743zi", calibration=data.x_train[:512])
    assert {c.dtype for c in whole.choices} == {"f32"} and whole.image == image.write(graph)
    q8 = image.write(quantize(graph, "q8"))
    tight = Board("tight", len(q8) + 4096, whole.board.arena)
    p = budget.plan(graph, tight, calibration=data.x_train[:512])
    assert len(q8) < len(p.image) <= tight.flash
    assert {"f16", "q8"} <= {c.dtype for c in p.choices} or {"f32", "q8"} <= {c.dtype for c in p.choices}
    f32 = FC.mae_mw(reference.run(graph, data.x_test), data)
    assert abs(FC.mae_mw(reference.run(image.read(p.image), data.x_test), data) - f32) < 0.01 * f32


def test_an_oversized_model_is_refused_with_what_does_not_fit() -> None:
    torch.manual_seed(0)
    big = graph_of(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 64)))
    with pytest.raises(BudgetError, match=r"with every weight at its smallest dtype \(q4; routers f32, embedding tables q8\) the image needs "
                                          r"about [\d,]+ B, nucleo_h743zi's model slot holds 524,256 B: the model is "
                                          r"[\d,]+ B too large"):
        budget.plan(big, "nucleo_h743zi")
    wide = graph_of(torch.nn.Sequential(torch.nn.Linear(16384, 4)), max_batch=16)
    with pytest.raises(BudgetError, match=r"the model's arena needs [\d,]+ B, nucleo_h743zi's runner has 229,376 B"):
        budget.plan(wide, "nucleo_h743zi")


def test_router_inputs_keep_the_matrices_feeding_routers_at_f16_or_finer() -> None:
    from test_routing_quant import many_experts

    graph = graph_of(many_experts(1, "topk_softmax"))
    f32 = image.write(graph)
    tight = Board("tight", len(image.write(quantize(graph, "q8", router_inputs="f16"))) + 64, 64 * 1024)
    p = budget.plan(graph, tight, router_inputs="f16")
    assert {c.name: c.dtype for c in p.choices}["layers.0"] in ("f16", "f32") and len(p.image) < len(f32)
    with pytest.raises(Exception, match="router_inputs must be f32 or f16"):
        budget.plan(graph, tight, router_inputs="q8")


def _quickstart() -> torch.nn.Module:
    from test_quantize import quickstart_model

    return quickstart_model()


def test_the_plan_is_stable_and_the_cli_prints_it(tmp_path) -> None:
    """Same model, same plan, line for line; the CLI prints it, the footprint, and writes the image."""
    graph = graph_of(_quickstart())
    f32 = image.write(graph)
    board = Board("half", len(f32) // 2, 64 * 1024)
    a, b = budget.plan(graph, board), budget.plan(graph, board)
    assert a.lines() == b.lines() and a.image == b.image
    assert {type(getattr(o, t)) for n, o, t in weight_slots(a.graph) if not n.endswith(".router")} <= {
        np.ndarray, F16Weight, Q8Weight}
    assert a.lines()[0] == "plan for half: flash slot 61,104 B, arena 65,536 B"
    assert a.lines()[-1].startswith(f"footprint: image {len(a.image):,} B of 61,104")
    src = tmp_path / "f32.clb"
    src.write_bytes(f32)
    x = tmp_path / "calib.npy"
    np.save(x, inputs(64, graph.input_size, seed=3))
    cmd = [sys.executable, "-c", "from colibri.cli import main; main()", "quantize", str(src), str(tmp_path / "out.clb"),
           "--target", "nucleo_h743zi", "--calibration", str(x), "--report"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "host_tools"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "plan for nucleo_h743zi: flash slot 524,256 B, arena 229,376 B" in r.stdout
    assert "footprint: image 122,208 B of 524,256" in r.stdout and "routing agreement, MoE at layer 3: 100.00%" in r.stdout
    both = subprocess.run(cmd[:-3] + ["--dtype", "q8"], capture_output=True, text=True, timeout=300, env=env)
    assert both.returncode == 1 and "give either --dtype or --target" in both.stderr
    aligned = subprocess.run(cmd + ["--page-aligned"], capture_output=True, text=True, timeout=300, env=env)
    assert aligned.returncode == 1 and "--page-aligned has no effect with --target" in aligned.stderr
    assert (tmp_path / "out.clb").read_bytes() == budget.plan(graph, "nucleo_h743zi", calibration=np.load(x)).image
