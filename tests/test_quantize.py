"""Accuracy, size and engine agreement of quantised weights (colibri.quant.quantize).

Weights stored as f16, or as int8 per output channel with a sparse f16
compensation term E (W ≈ Q·S + E), change a model's answers; these tests
bound by how much, on the models the bounds are meant for:

- f16 and q8 on random-weight models: end-to-end relative L2 error
  ‖y_q − y‖ / ‖y‖ of the numpy reference on the quantised graph against the
  f32 graph, over a batch of inputs. q8 error in a random router flips a few
  tokens to another expert set, and a flipped token's output row moves by
  O(1): the q8 bound is held by models where that is cheap (dense routing, or
  a MoE adding a modest update to a residual stream); see Q8_MODELS. Deeper
  random models (tests/randmodels.py) reach 1–6 %, mostly from flips, and are
  not used for the bound.
- q8 on a model trained on real data (tests/trained.py): test accuracy and
  the share of tokens whose expert set is unchanged, which is what a user
  notices.
- E earns its bytes on heavy-tailed weights (as trained weights are): error
  with and without it.
- Image size against f32, and the C engine against the reference for every
  weight storage, since the reference is the specification the engine follows.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import image, reference
from colibri import nn as cnn
from colibri.model.errors import ExportError
from colibri.frontends.exporter import build_graph
from colibri.model.format import Act, ExpertKind, Routing
from colibri.model.ir import Expert, F16Weight, Graph, Linear, MoE, Q8Weight, dense
from colibri.model.walks import weight_slots
from colibri.quant.quantize import DEFAULT_COMPENSATION, quantize, quantize_q8

import hfblocks
from randmodels import random_model
from trained import TrainedClassifier, digits_classifier

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 256  # inputs per error measurement
F16_BOUND = 1e-3  # end-to-end relative L2, f16 weights
Q8_BOUND = 1e-2  # end-to-end relative L2, q8 weights (the random-weight models of Q8_MODELS)
ACCURACY_DROP = 0.003  # q8 vs f32 test accuracy on the trained model (0.3 percentage points)
ROUTING_AGREEMENT = 0.99  # share of test tokens whose expert set q8 leaves unchanged
HEAVY_TAIL_GAIN = 1.5  # error without E / error with E, Student-t weights
Q8_SIZE, F16_SIZE = 0.262, 0.51  # image bytes / f32 image bytes, weight-dominated model (q8: format v2)
Q8_V1_SIZE = 0.27  # the same in format version 1's layout (f32 scales, 4-byte row pointers)


# --- helpers -------------------------------------------------------------------------------------


def rel_l2(graph: Graph, quantised: Graph, x: np.ndarray) -> float:
    """‖y_q − y‖ / ‖y‖ over the whole batch, both through the numpy reference."""
    y = reference.run(graph, x)
    return float(np.linalg.norm(reference.run(quantised, x) - y) / np.linalg.norm(y))


def expert_sets(graph: Graph, x: np.ndarray) -> list[frozenset[int]]:
    """Per MoE layer and token, the set of routed-expert slots the reference selects."""
    sets: list[frozenset[int]] = []
    reference.run(graph, x, on_route=lambda _moe, sel: sets.extend(frozenset(s for s, _ in t) for t in sel))
    return sets


def inputs(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def graph_of(module: torch.nn.Module, max_batch: int = 16) -> Graph:
    with torch.no_grad():
        graph, _ = build_graph(module.eval(), max_batch=max_batch)
    return graph


def storage(graph: Graph) -> set[type]:
    """The storage types of the graph's weight matrices, to prove quantisation happened; routers and
    shared gates stay f32 unless quantize_routers (colibri.quant.quantize), so they are left out."""
    return {type(getattr(owner, attr)) for name, owner, attr in weight_slots(graph)
            if not name.endswith((".router", ".shared_gate"))}


def assert_engine_matches(img: bytes, x: np.ndarray) -> None:
    """The C engine's tolerance: max|Δ| ≤ 1e-5 · (1 + max|y|) against the reference on the same image."""
    want = reference.run(image.read(img), x)
    got = colibri.Model(img).forward(x)
    err, tol = float(np.abs(got - want).max()), 1e-5 * (1 + float(np.abs(want).max()))
    assert err <= tol, f"engine vs reference: max|Δ| {err:.3g} > {tol:.3g}"


# --- models --------------------------------------------------------------------------------------


def quickstart_model() -> torch.nn.Module:
    """examples/quickstart.py's build_model(), loaded by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model()


def nn_model(routing: str, gated: bool, seed: int = 1, branch_scale: float = 1.0) -> torch.nn.Module:
    """Linear → Residual(LayerNorm → MoE(6 experts, top-2)) → Linear, default (training-like) init.

    `branch_scale` multiplies the experts' output projections, so the MoE adds
    a smaller update to the residual stream, as in a transformer block (GPT-2
    scales residual output projections down at init for the same reason). That
    decides what one routing flip costs: at 1.0 a flipped token moves the
    output row by about as much as the whole row, at 0.3 by a third of it.
    """
    torch.manual_seed(seed)
    moe = cnn.MoE(32, 6, 48, top_k=2, routing=routing, gated=gated, activation="silu" if gated else "gelu",
                  renormalize=routing == "softmax_topk")
    with torch.no_grad():
        for expert in moe.experts:
            expert.w2.weight.mul_(branch_scale)
            expert.w2.bias.mul_(branch_scale)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), cnn.Residual(torch.nn.LayerNorm(32), moe),
                               torch.nn.Linear(32, 16))


def hf_block(kind: str, hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    """A Hugging Face MoE block from a small random config (8 experts, top-2)."""
    return {
        "mixtral": lambda: hfblocks.mixtral(hidden, 64, 8, 2, "silu", seed),
        "qwen2_moe": lambda: hfblocks.qwen2_moe(hidden, 32, 48, 8, 2, True, "silu", seed),
        "switch": lambda: hfblocks.switch(hidden, 64, 8, True, "relu", capacity=TOKENS, seed=seed),
    }[kind]()


NN_MODELS = {f"nn-{r}-{'glu' if g else 'mlp'}": (lambda r=r, g=g: nn_model(r, g))
             for r in cnn.ROUTINGS for g in (False, True)}
F16_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "quickstart": quickstart_model,
    **NN_MODELS,
    **{f"hf-{k}": (lambda k=k: hf_block(k)) for k in ("mixtral", "qwen2_moe", "switch")},
}
# q8 moves a random router's logits enough to flip 0–2 % of tokens to another expert set
# (0–5 of 256 over model and input seeds, whatever the router's scale: its error scales
# with its weights). The floor without flips is ~0.5 %; at branch_scale 1 the top-1 and
# top-k nn models measured 0.5–2.4 % (median ~1 %), the excess all from flips. At
# branch_scale 0.3 they measured ≤ 0.9 %, so the sparse-routing models carry the bound
# there; dense routing cannot flip and runs at full scale, as does the quickstart model
# (0.52–0.68 % over 8 input seeds despite 0–2 flips).
Q8_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "quickstart": quickstart_model,
    "nn-dense-glu": NN_MODELS["nn-dense-glu"],
    "nn-topk_softmax-mlp-0.3": lambda: nn_model("topk_softmax", False, branch_scale=0.3),
    "nn-top1-glu-0.3": lambda: nn_model("top1", True, branch_scale=0.3),
}


# --- 1. f16 and 3. q8 on random-weight models ----------------------------------------------------


@pytest.mark.parametrize("name", F16_MODELS)
def test_f16_end_to_end_error(name: str) -> None:
    graph = graph_of(F16_MODELS[name]())
    quantised = quantize(graph, "f16")
    assert storage(quantised) == {F16Weight}
    err = rel_l2(graph, quantised, inputs(TOKENS, graph.input_size, seed=1))
    print(f"f16 {name}: relative L2 {err:.3g}")
    assert err <= F16_BOUND, f"{name}: f16 relative L2 {err:.3g} > {F16_BOUND}"


@pytest.mark.parametrize("name", Q8_MODELS)
def test_q8_end_to_end_error(name: str) -> None:
    graph = graph_of(Q8_MODELS[name]())
    quantised = quantize(graph, "q8")
    assert storage(quantised) == {Q8Weight}
    err = rel_l2(graph, quantised, inputs(TOKENS, graph.input_size, seed=2))
    print(f"q8 {name}: relative L2 {err:.3g}")
    assert err <= Q8_BOUND, f"{name}: q8 relative L2 {err:.3g} > {Q8_BOUND}"


# --- 2. q8 on a trained model --------------------------------------------------------------------


@pytest.fixture(scope="session")
def trained() -> TrainedClassifier:
    return digits_classifier(seed=0)


@pytest.fixture(scope="session")
def trained_q8(trained: TrainedClassifier) -> Graph:
    return quantize(trained.graph, "q8")


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(axis=1) == labels).mean())


def test_trained_model_learned(trained: TrainedClassifier) -> None:
    """Guards the other trained-model tests: a model that learned nothing would pass them trivially."""
    acc = accuracy(reference.run(trained.graph, trained.x_test), trained.y_test)
    print(f"digits: train accuracy {trained.train_accuracy:.4f}, f32 test accuracy {acc:.4f}")
    assert acc >= 0.93


@pytest.mark.parametrize("runner", ["reference", "engine"])
def test_trained_q8_accuracy(trained: TrainedClassifier, trained_q8: Graph, runner: str) -> None:
    """q8 (default E) keeps test accuracy within 0.3 points, through the reference and the C engine alike."""
    forward = (lambda img, x: reference.run(image.read(img), x)) if runner == "reference" else \
        (lambda img, x: colibri.Model(img).forward(x))
    f32, q8 = (accuracy(forward(image.write(g), trained.x_test), trained.y_test) for g in (trained.graph, trained_q8))
    print(f"digits ({runner}): f32 {f32:.4f}, q8 {q8:.4f} over {len(trained.y_test)} test images")
    assert abs(f32 - q8) <= ACCURACY_DROP, f"q8 accuracy {q8:.4f} vs f32 {f32:.4f}"


def test_trained_q8_routing_agreement(trained: TrainedClassifier, trained_q8: Graph) -> None:
    before, after = (expert_sets(g, trained.x_test) for g in (trained.graph, trained_q8))
    agreement = float(np.mean([a == b for a, b in zip(before, after, strict=True)]))
    print(f"digits: routing agreement {agreement:.4f} ({sum(a != b for a, b in zip(before, after))} flips)")
    assert agreement >= ROUTING_AGREEMENT


# --- 4. the compensation term --------------------------------------------------------------------


def student_t(rng: np.random.Generator, rows: int, cols: int, dof: float = 2.5) -> np.ndarray:
    """Heavy-tailed weights, scaled to unit-variance outputs for unit-variance inputs."""
    return (rng.standard_t(dof, (rows, cols)) / np.sqrt(dof / (dof - 2) * cols)).astype(np.float32)


def heavy_tailed_graph(kind: str, seed: int = 0) -> Graph:
    """A Linear, or one SwiGLU expert (a dense MoE with a single expert, so routing cannot flip)."""
    rng = np.random.default_rng(seed)
    d, hidden = 128, 256
    if kind == "linear":
        return Graph([Linear(student_t(rng, hidden, d))], d, hidden)
    expert = Expert(ExpertKind.GLU, Act.SILU, w1=student_t(rng, hidden, d), w2=student_t(rng, d, hidden),
                    w3=student_t(rng, hidden, d))
    moe = MoE(Routing.DENSE, 1, np.zeros((1, d), np.float32), [expert], np.zeros(1, np.int32))
    return Graph([moe], d, d)


@pytest.mark.parametrize("kind", ["linear", "glu_expert"])
def test_compensation_helps_heavy_tailed(kind: str) -> None:
    graph = heavy_tailed_graph(kind)
    x = inputs(TOKENS, graph.input_size, seed=3)
    without, with_e = (rel_l2(graph, quantize(graph, "q8", compensation=c), x) for c in (0.0, DEFAULT_COMPENSATION))
    print(f"heavy-tailed {kind}: relative L2 {without:.3g} without E, {with_e:.3g} with E ({without / with_e:.2f}×)")
    assert without >= HEAVY_TAIL_GAIN * with_e


def assert_csr_valid(q: Q8Weight) -> None:
    rows, cols = q.shape
    ptr = q.row_ptr.astype(np.int64)
    assert ptr.shape == (rows + 1,) and ptr[0] == 0 and ptr[-1] == q.nnz and np.all(np.diff(ptr) >= 0)
    assert q.col.shape == q.val.shape == (q.nnz,) and np.all(q.col < cols) and np.all(np.isfinite(q.val))
    for r in range(rows):
        assert np.all(np.diff(q.col[ptr[r]:ptr[r + 1]].astype(np.int64)) > 0), f"row {r}: columns not increasing"


@pytest.mark.parametrize("fraction", [0.0, DEFAULT_COMPENSATION, 0.03])
def test_quantize_q8_structure(fraction: float) -> None:
    """Q·S + E rebuilds W; E holds the largest residuals W − Q·S, row-sorted, fraction × size of them."""
    w = student_t(np.random.default_rng(4), 96, 200)
    w[5] = 0  # a zero row must give a zero scale, not a NaN
    q = quantize_q8(w, fraction)
    assert_csr_valid(q)
    assert q.q.dtype == np.int8 and q.scale.dtype == np.float32 and q.val.dtype == np.float16
    assert q.scale[5] == 0 and not q.q[5].any()
    assert np.all(np.abs(q.q[q.scale > 0]).max(axis=1) == 127)  # each row's scale is used to its full range
    assert q.nnz == round(fraction * w.size)

    residual = w - q.q.astype(np.float32) * q.scale[:, None]
    in_e = q.compensation() != 0
    np.testing.assert_array_equal(q.compensation()[in_e], residual[in_e].astype(np.float16).astype(np.float32))
    if q.nnz:
        assert np.abs(residual[in_e]).min() >= np.abs(residual[~in_e]).max(), "E misses a larger residual"
    # Outside E only the rounding error is left, inside E only the f16 rounding of the
    # residual (each plus the f32 rounding of Q·S + E itself, a few ulp of |w|).
    err = np.abs(dense(q) - w) - 1e-6 * np.abs(w)
    half_step = np.broadcast_to(q.scale[:, None] / 2, w.shape)
    assert np.all(err[~in_e] <= half_step[~in_e])
    assert np.all(err[in_e] <= np.abs(residual[in_e]) * 2.0**-11)


# --- 5. image size -------------------------------------------------------------------------------


def test_image_size_ratios() -> None:
    """A weight-dominated MoE (d=128, 8 SwiGLU experts of 512, no biases) shrinks ~4× as q8 (E included), ~2× as f16.

    The bound is close to what the format allows at d=128: per int8 row, a scale
    and a row pointer (8 bytes) against 128 bytes of weights, plus E.
    """
    torch.manual_seed(5)
    graph = graph_of(cnn.MoE(128, 8, 512, top_k=2, gated=True, activation="silu", expert_bias=False))
    f32 = len(image.write(graph))
    ratio = {name: len(image.write(quantize(graph, dtype, **kw))) / f32
             for name, dtype, kw in (("f16", "f16", {}), ("q8", "q8", {}), ("q8 no E", "q8", {"compensation": 0.0}))}
    ratio["q8 v1"] = len(image.write(quantize(graph, "q8", compact=False), version=1)) / f32
    print("image size / f32: " + ", ".join(f"{k} {v:.4f}" for k, v in ratio.items()))
    assert ratio["q8"] <= Q8_SIZE and ratio["f16"] <= F16_SIZE and ratio["q8"] < ratio["q8 v1"] <= Q8_V1_SIZE
    assert ratio["q8 no E"] < ratio["q8"]  # E is in the image


# --- 5b. compact q8 metadata (format v2) and version 1 ---------------------------------------------


def test_compact_scales_are_the_nearest_f16_within_budget() -> None:
    """f16 scales are the nearest f16 to the f32 ones and the int8 weights those of the f32 scales
    (version 1's rounding): a per-row gain error of at most 2^-12; each row still reaches ±127;
    the bias moves into the companion as f16 within F16_BIAS_SHARE of the row's step."""
    from colibri.quant.quantize import F16_BIAS_SHARE

    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 40)).astype(np.float32) * 0.1
    b = rng.standard_normal(24).astype(np.float32) * 0.05
    wide, compact = quantize_q8(w), quantize_q8(w, bias=b, compact=True)
    assert compact.scale.dtype == compact.bias.dtype == np.float16
    s16, s32 = compact.scale.astype(np.float32), wide.scale
    assert np.array_equal(compact.q, wide.q) and np.all(np.abs(compact.q).max(axis=1) == 127)
    assert np.all(np.abs(s16 - s32) <= s32 * 2.0**-11) and np.array_equal(s16, s32.astype(np.float16))
    assert np.all(np.abs(compact.bias.astype(np.float32) - b) <= s16 * F16_BIAS_SHARE)
    err = np.abs(dense(compact) - w)
    assert err.max() <= s16.max() * (0.5 + 127 * 2.0**-11) + 1e-7


@pytest.mark.parametrize("case", ["tiny row", "bias far from its step", "huge bias"])
def test_compact_falls_back_to_f32_parameters(case: str) -> None:
    """Outside the budget a tensor keeps f32 scales and bias (still in its companion)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 16)).astype(np.float32) * 0.1
    b = np.full(6, 0.01, dtype=np.float32)
    if case == "tiny row":
        w[2] *= 1e-4  # max|w| / 127 below f16's normal range
    elif case == "bias far from its step":
        b[3] = 1000.3  # f16 spacing 0.5 at 1000: far more than a quarter of the row's step
    else:
        b[0] = 1e6
    q = quantize_q8(w, bias=b, compact=True)
    assert q.scale.dtype == q.bias.dtype == np.float32
    assert np.array_equal(q.bias, b) and np.array_equal(q.scale, quantize_q8(w).scale)


def test_compact_moves_biases_into_the_companions(quickstart_graph: Graph) -> None:
    """quantize(compact=True) leaves no bias tensor beside an int8 weight; compact=False leaves them."""
    def biases(g: Graph) -> int:
        n = 0
        for layer in g.layers:
            if isinstance(layer, Linear):
                n += layer.bias is not None
            elif isinstance(layer, MoE):
                n += layer.router_bias is not None
                n += sum(b is not None for e in layer.experts + layer.shared for b in (e.b1, e.b2, e.b3))
        return n

    compact, wide = quantize(quickstart_graph, "q8"), quantize(quickstart_graph, "q8", compact=False)
    assert biases(quickstart_graph) > 0 and biases(wide) == biases(quickstart_graph) and biases(compact) == 0
    kept = quantize(quickstart_graph, "q8", keep=["layers.0"])
    assert kept.layers[0].bias is not None  # an f32 weight keeps its f32 bias tensor
    with pytest.raises(ValueError, match="version 1 holds no bias"):
        image.write(compact, version=1)


@pytest.mark.parametrize("model", ["quickstart", "random-1", "random-3"])
def test_version_1_images_still_run(model: str) -> None:
    """A v1 image (f32 scales, u32 row pointers) and the v2 image of the same graph give the same
    bits; v1 images of compact graphs widen f16 scales exactly (no bias in them)."""
    graph = ENGINE_MODELS[model]()
    wide = quantize(graph, "q8", compact=False, compensation=0.02)
    v1, v2 = image.write(wide, version=1), image.write(wide, version=2)
    assert v1[4:6] == b"\x01\x00" and v2[4:6] == b"\x02\x00" and len(v2) < len(v1)
    x = inputs(graph.max_batch, graph.input_size, seed=9)
    for kernels in (True, False):
        a = colibri.Model(v1, reference_kernels=kernels).forward(x)
        b = colibri.Model(v2, reference_kernels=kernels).forward(x)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert_engine_matches(v1, x)
    back = image.read(v1)
    assert all(w.scale.dtype == np.float32 and w.row_ptr.dtype == np.dtype("<u4")
               for w in (getattr(o, a) for _, o, a in weight_slots(back)) if isinstance(w, Q8Weight))


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_compact_and_wide_parameters_agree_in_the_engine(quickstart_graph: Graph) -> None:
    """The compact image runs as its own reference says (biases after E), and within q8's error of
    the version-1 layout."""
    x = inputs(64, quickstart_graph.input_size, seed=10)
    compact = image.write(quantize(quickstart_graph, "q8", int8_act=["layers.3.experts.*"]))
    wide = image.write(quantize(quickstart_graph, "q8", compact=False, int8_act=["layers.3.experts.*"]), version=1)
    assert_engine_matches(compact, x)
    a, b, f = (reference.run(image.read(d), x) for d in (compact, wide, image.write(quickstart_graph)))
    # Same int8 weights, scales within 2^-12: the error of version 1's layout, within 2%.
    print(f"relative L2 vs f32: compact {rel(a, f):.4g}, version-1 layout {rel(b, f):.4g}")
    assert rel(a, f) <= 1.02 * rel(b, f)


# --- 6. the C engine against the reference -------------------------------------------------------

VARIANTS: dict[str, dict] = {
    "f32": {"dtype": "f32"},
    "f16": {"dtype": "f16"},
    "q8": {"dtype": "q8"},
    "q8-noE": {"dtype": "q8", "compensation": 0.0},
    "q8-int8act": {"dtype": "q8", "int8_act": ["layers.*"]},
}


def random_graph(seed: int) -> Graph:
    """tests/randmodels.random_model(seed) with its own max_batch."""
    model, _, max_batch = random_model(seed)
    return graph_of(model, max_batch=max_batch)


ENGINE_MODELS: dict[str, Callable[[], Graph]] = {
    "quickstart": lambda: graph_of(quickstart_model()),
    **{f"random-{s}": (lambda s=s: random_graph(s)) for s in range(5)},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model", ENGINE_MODELS)
def test_engine_matches_reference(model: str, variant: str) -> None:
    graph = ENGINE_MODELS[model]()
    img = image.write(quantize(graph, **VARIANTS[variant]))
    for batch in sorted({1, graph.max_batch}):
        assert_engine_matches(img, inputs(batch, graph.input_size, seed=6 + batch))


# --- 7. overrides and refusals -------------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart_graph() -> Graph:
    return graph_of(quickstart_model())


def stored(graph: Graph, **options) -> dict[str, type]:
    """Weight name → storage type, as read back from the written image."""
    back = image.read(image.write(quantize(graph, "q8", **options)))
    return {name: type(getattr(owner, attr)) for name, owner, attr in weight_slots(back)}


KEEP = {  # pattern -> which quickstart weights it names (layers.3 is the MoE)
    "*.router": lambda name: name.endswith(".router"),
    "layers.0": lambda name: name == "layers.0",
    "layers.3.experts.1": lambda name: name.startswith("layers.3.experts.1."),
}


@pytest.mark.parametrize("pattern", KEEP)
def test_keep_leaves_f32(quickstart_graph: Graph, pattern: str) -> None:
    kept = KEEP[pattern]
    types = stored(quickstart_graph, keep=[pattern], quantize_routers=True)  # keep alone decides
    assert any(map(kept, types)), f"{pattern} should name a weight of the quickstart model: {list(types)}"
    assert types == {name: np.ndarray if kept(name) else Q8Weight for name in types}


def test_routers_and_shared_gates_stay_f32_by_default(quickstart_graph: Graph) -> None:
    types = stored(quickstart_graph)
    routers = [n for n in types if n.endswith((".router", ".shared_gate"))]
    assert routers and all(types[n] is np.ndarray for n in routers)
    assert {types[n] for n in types if n not in routers} == {Q8Weight}
    assert stored(quickstart_graph, quantize_routers=True)[routers[0]] is Q8Weight


def test_int8_act_flags_in_image(quickstart_graph: Graph) -> None:
    back = image.read(image.write(quantize(quickstart_graph, "q8", int8_act=["layers.0", "layers.3.experts.*"])))
    linears = [layer for layer in back.layers if isinstance(layer, Linear)]
    (moe,) = back.moe_layers()
    assert [layer.int8_act for layer in linears] == [True, False]
    assert all(e.int8_act for e in moe.experts) and not any(e.int8_act for e in moe.shared)


@pytest.mark.parametrize("options,message", [
    ({"keep": ["layers.9"]}, "matches no weight"),
    ({"keep": ["*.routers"]}, "matches no weight"),
    ({"int8_act": ["layers.7.experts.*"]}, "matches no weight"),
    ({"keep": ["layers.0"], "int8_act": ["layers.0"]}, "int8 activations need int8 weights"),
    ({"keep": ["layers.3.experts.0.w2"], "int8_act": ["layers.3.experts.*"]}, "int8 activations need int8 weights"),
])
def test_bad_options_raise(quickstart_graph: Graph, options: dict, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        quantize(quickstart_graph, "q8", **options)


def test_int8_act_needs_q8(quickstart_graph: Graph) -> None:
    with pytest.raises(ExportError, match="int8 activations need int8 weights"):
        quantize(quickstart_graph, "f16", int8_act=["layers.0"])


@pytest.mark.parametrize("first", ["f16", "q8"])
@pytest.mark.parametrize("second", ["f32", "f16", "q8"])
def test_requantising_raises(quickstart_graph: Graph, first: str, second: str) -> None:
    """Quantising twice would compound the error silently: it must start from f32."""
    with pytest.raises(ExportError, match="already quantised"):
        quantize(quantize(quickstart_graph, first), second)
