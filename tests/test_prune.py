"""Expert pruning at export: by list and by calibration, with the routing table remapped."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import colibri
from colibri import nn as cnn
from colibri import reference
from colibri.model.errors import ExportError
from colibri.frontends.exporter import export


def _model(routing: str, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12),
        cnn.MoE(12, 8, 20, top_k=2 if routing not in ("top1",) else 1, routing=routing,
                renormalize=routing == "softmax_topk", router_bias=True),
        torch.nn.Linear(12, 3),
    ).eval()


@pytest.mark.parametrize("routing", cnn.ROUTINGS)
def test_prune_by_list_drops_experts_and_remaps(routing: str) -> None:
    model = _model(routing)
    result = export(model, None, max_batch=4, prune=[1, 5, 6])
    moe = result.graph.moe_layers()[0]
    assert len(moe.experts) == 5
    assert moe.expert_map.tolist() == [0, -1, 1, 2, 3, -1, -1, 4]
    assert result.pruned.dropped == {0: [1, 5, 6]}
    assert "dropped experts [1, 5, 6]" in result.pruned.lines()[0]
    full = export(model, None, max_batch=4)
    assert len(result.image) < len(full.image)
    # The C engine runs the pruned image exactly as the reference defines it.
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(colibri.Model(result.image).forward(x), reference.run(colibri.image.read(result.image), x),
                               rtol=1e-5, atol=1e-5)
    # Pruned experts are never selected.
    h = reference.run(colibri.model.ir.Graph(result.graph.layers[:1], 6, 12), x)
    for sel in reference.route(moe, h):
        assert all(0 <= slot < 5 for slot, _ in sel)


@pytest.mark.parametrize("routing", ["top1", "topk_softmax", "softmax_topk"])
def test_calibration_pruning_keeps_answers_on_calibration_data(routing: str) -> None:
    model = _model(routing, seed=3)
    # Inputs that exercise only some experts: a narrow cloud.
    rng = np.random.default_rng(3)
    calib = (rng.standard_normal((64, 6)) * 0.05 + rng.standard_normal(6)).astype(np.float32)
    result = export(model, None, max_batch=64, calibration=calib)
    dropped = result.pruned.dropped[0]
    assert dropped, "the narrow calibration set should leave some experts unused"
    with torch.no_grad():
        want = model(torch.from_numpy(calib)).numpy()
    got = colibri.Model(result.image).forward(calib)
    assert np.abs(got - want).max() <= 1e-5 * (1 + np.abs(want).max())


def test_prune_refuses_too_many_or_unknown() -> None:
    model = _model("topk_softmax")
    with pytest.raises(ExportError, match="top_k=2"):
        export(model, None, prune=list(range(7)))
    with pytest.raises(ExportError, match="cannot prune experts \\[9\\]"):
        export(model, None, prune=[9])
    with pytest.raises(ExportError, match="no MoE layer 3"):
        export(model, None, prune={3: [0]})


@pytest.mark.parametrize("routing", cnn.ROUTINGS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_export_check_after_pruning_uses_the_unaffected_tokens(routing: str, dtype: str) -> None:
    """A pruned image differs from PyTorch by design on tokens that chose a dropped expert; the
    check compares the others, and with none left holds the C engine to the reference."""
    model = _model(routing, seed=2)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(3))
    result = export(model, None, max_batch=8, example_input=x, prune=[1, 5], dtype=dtype)
    assert result.checks and all(c.ok for c in result.checks)
    if routing == "dense":  # every token uses every expert: nothing to compare with PyTorch
        assert [c.what for c in result.checks] == [f"C engine vs numpy reference ({dtype} image)"]
    else:
        # the PyTorch comparisons name the tokens they used (an f16 image also holds its f32 router to
        # the reference, over every token)
        used = [int(t.split(" of ")[0].split(" on ")[-1]) for t in (c.what for c in result.checks) if "PyTorch" in t]
        assert used
        assert all(0 < n < 64 for n in used), [c.what for c in result.checks]
    assert result.max_abs_error > 1e-3  # the affected tokens changed: reported, not checked


def test_export_check_after_pruning_still_catches_a_wrong_conversion() -> None:
    class Doubled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = _model("topk_softmax", seed=2)
    model[2] = Doubled(12, 3)
    with pytest.raises(colibri.model.errors.ExportCheckError, match=r"on \d+ of 64 tokens"):
        export(model, None, max_batch=8, example_input=torch.randn(64, 6), prune=[1, 5])
