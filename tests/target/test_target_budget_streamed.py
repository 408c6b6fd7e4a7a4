"""`colibri quantize FOLDER|FILE.gguf OUT --target BOARD` (colibri.target.budget.plan_checkpoint; issue 26):
the planner on the streamed path. Each matrix is read once for its error and bytes in every dtype, the
plan chosen from those numbers, and the image streamed: the same plan and the same image as the
in-memory planner on the folder's f32 export, with never more than a couple of matrices alive."""
from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from colibri import image
from colibri.checkpoints import gguf_file, hf_folder
from colibri.cli import main
from colibri.model.ir import Q4Weight, dense
from colibri.model.walks import weight_slots
from colibri.target import budget
from colibri.target.budget import Board, BudgetError
from helpers import tokenizers_trained as trained
from helpers.gguf_files import block_models, dequantised, write_gguf
from helpers.hf_lm_models import mixtral


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "mixtral"
    mixtral(400).save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    trained.byte_bpe(path, added=False)
    return path


def _f32_image(folder: Path, tmp: Path) -> bytes:
    out = tmp / "f32.clb"
    hf_folder.export_folder(folder, out, max_seq_len=16, page_aligned=False)
    return out.read_bytes()


def test_the_streamed_plan_is_the_in_memory_plan(folder, tmp_path):
    f32 = _f32_image(folder, tmp_path)
    board = Board("tight", len(f32) * 2 // 5, 4 << 20)  # room for q4/q8 with some f16 and f32
    want = budget.plan(image.read(f32), board)
    out = tmp_path / "planned.clb"
    got = budget.plan_checkpoint(folder, board, out, max_seq_len=16)
    assert [(c.name, c.dtype, c.bytes) for c in got.choices] == [(c.name, c.dtype, c.bytes) for c in want.choices]
    assert [c.error for c in got.choices] == pytest.approx([c.error for c in want.choices], rel=1e-12)
    assert len({c.dtype for c in got.choices}) >= 3  # a real trade, not one dtype throughout
    assert out.read_bytes() == want.image and got.image_size == len(want.image) <= board.flash
    assert got.arena == want.arena and got.f32_bytes == len(f32)
    assert got.lines()[1:] == want.lines()[1:]


def test_the_streamed_planner_holds_a_few_matrices_at_most(folder, tmp_path, monkeypatch):
    """Every matrix the checkpoint hands out is tracked: when the next one is read, at most one
    earlier one may still be alive (no garbage collection is forced: what only a collection would
    free holds its memory until then)."""
    alive: list[weakref.ref] = []
    most = {"matrices": 0}
    read = hf_folder.Checkpoint.read

    def tracked(self, name, index=None):
        most["matrices"] = max(most["matrices"], sum(r() is not None for r in alive))
        out = read(self, name, index)
        if out.ndim == 2:
            alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(hf_folder.Checkpoint, "read", tracked)
    f32 = len(_f32_image(folder, tmp_path))
    count = len(alive)
    alive.clear()
    budget.plan_checkpoint(folder, Board("tight", f32 * 2 // 5, 4 << 20), tmp_path / "p.clb", max_seq_len=16)
    assert len(alive) >= 2 * count - 2  # each matrix read twice: measured, then written
    assert most["matrices"] <= 1, most


def test_a_gguf_plan_carries_q4_0_blocks_exactly(tmp_path):
    model = block_models()["mixtral"]
    file = write_gguf(model, tmp_path / "m.gguf", "Q4_0")
    f32 = tmp_path / "f32.clb"
    gguf_file.export_gguf(file, f32, max_seq_len=16, dtype="f32", page_aligned=False)
    size = f32.stat().st_size
    out = tmp_path / "planned.clb"
    plan = budget.plan_checkpoint(file, Board("tight", size // 3, 4 << 20), out, max_seq_len=16)
    q4 = [c for c in plan.choices if c.dtype == "q4"]
    assert q4 and all(c.error == 0.0 for c in q4)  # the file's own blocks: no error against its weights
    values = dequantised(file)
    graph = image.read(out.read_bytes())
    weights = {n: getattr(o, a) for n, o, a in weight_slots(graph)}
    w = weights["layers.7.experts.0.w1"]  # blk.0.ffn_gate_exps[0]
    assert isinstance(w, Q4Weight) and np.array_equal(dense(w), values["blk.0.ffn_gate_exps.weight"][0])


def test_refusals(folder, tmp_path):
    out = tmp_path / "x.clb"
    with pytest.raises(BudgetError, match=r"the image needs about [\d,]+ B, small's model slot holds 1,000 B"):
        budget.plan_checkpoint(folder, Board("small", 1000, 4 << 20), out, max_seq_len=16)
    with pytest.raises(BudgetError, match=r"the model's arena needs [\d,]+ B, cramped's runner has 1,000 B"):
        budget.plan_checkpoint(folder, Board("cramped", 10 << 20, 1000), out, max_seq_len=16)
    assert not out.exists() and not list(tmp_path.glob(".x.clb*"))


def test_cli_plans_a_folder_for_a_board(folder, tmp_path):
    runner = CliRunner()
    out = tmp_path / "board.clb"
    res = runner.invoke(main, ["quantize", str(folder), str(out), "--target", "nucleo_h743zi", "--max-seq-len", "16"])
    assert res.exit_code == 0, res.output
    assert "plan for nucleo_h743zi: flash slot 524,256 B" in res.output and "peak RSS" in res.output
    assert out.stat().st_size <= 524_256
    want = budget.plan(image.read(_f32_image(folder, tmp_path)), "nucleo_h743zi")
    assert out.read_bytes() == want.image
    res = runner.invoke(main, ["quantize", str(folder), str(out), "--dtype", "q8"])
    assert res.exit_code != 0 and "colibri export mixtral OUT --dtype q8" in res.output
    res = runner.invoke(main, ["quantize", str(folder), str(out), "--target", "nucleo_h743zi"])
    assert res.exit_code != 0 and "needs --max-seq-len" in res.output
