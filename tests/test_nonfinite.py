"""NaN, ±inf, FLT_MAX-scale and subnormal inputs: the C engine, the numpy reference and PyTorch agree.

The semantics are docs/model-format.md "Numerics: non-finite values": values
propagate through every op as PyTorch propagates them, with NaN exactly where
PyTorch gives NaN. Comparisons are NaN-aware: NaN and ±inf positions must
match exactly, finite values within 1e-5·(1 + max|y|).

The PyTorch side is the exported model itself, with its weights replaced by
the image's stored weights for f16 and q8 (so only the arithmetic is
compared), and with the documented differences applied:
- GELU (erf) of +inf is +inf, its limit, where PyTorch's vectorised float32
  kernel returns NaN (its float64 and one-element paths return +inf);
- a LayerNorm row whose variance overflows f32 is NaN, where PyTorch returns
  NaN or the bias depending on where the large value sits in the row.
q8 sums Q·x before scaling (docs/model-format.md), so it overflows where the
float model does not: FLT_MAX-scale rows of q8 models are compared with the
numpy reference only.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import nn as cnn
from colibri import reference
from colibri.frontends.exporter import export
from colibri.model.ir import dense
from colibri.quant.quantize import quantize_f16, quantize_q8

D = 8
MAX_BATCH = 40
NAN, INF = float("nan"), float("inf")
SPECIALS = {"nan": NAN, "+inf": INF, "-inf": -INF, "1e38": 1e38, "-3e38": -3e38,
            "subnormal": 1e-40, "-subnormal": -2.5e-39}
# Routers quantised too (not the default): oracle() rounds every Linear, and the non-finite paths of
# f16 and int8 routers are covered.
DTYPES = {
    "f32": {},
    "f16": {"dtype": "f16", "quantize_routers": True},
    "q8": {"dtype": "q8", "quantize_routers": True},
    "q8-int8-act": {"dtype": "q8", "int8_act": ["layers.*"], "quantize_routers": True},
}


def special_inputs(d: int, seed: int = 0) -> np.ndarray:
    """One batch: a clean row; each special value alone at the first, middle and last position;
    a row of subnormals only, a FLT_MAX-scale row, +inf and -inf together, and a row of NaN."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(d)]
    for v in SPECIALS.values():
        for p in sorted({0, d // 2, d - 1}):
            r = rng.standard_normal(d)
            r[p] = v
            rows.append(r)
    rows.append(rng.standard_normal(d) * 1e-39)
    rows.append(rng.standard_normal(d) * 1e37)
    r = rng.standard_normal(d)
    r[0], r[-1] = INF, -INF
    rows.append(r)
    rows.append(np.full(d, NAN))
    x = np.array(rows, dtype=np.float32)
    assert len(x) <= MAX_BATCH
    return x


def assert_same(got: np.ndarray, want: np.ndarray, what: str, *, finite_tol: bool = True) -> None:
    """NaN and ±inf where `want` has them, nowhere else; finite values within 1e-5·(1+max|y|)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        bad = np.argwhere(test(got) != test(want))
        assert not len(bad), (f"{what}: {name} differs at (row, col) {bad[:6].tolist()}: "
                              f"got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}")
    finite = np.isfinite(want)
    if finite_tol and finite.any():
        err = float(np.abs(got[finite].astype(np.float64) - want[finite]).max())
        tol = 1e-5 * (1 + float(np.abs(want[finite]).max()))
        assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


# --------------------------------------------------------------------------- the PyTorch oracle


class LimitGELU(torch.nn.Module):
    """nn.GELU (erf) with GELU(+inf) = +inf, the engine's documented value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isposinf(x), x, torch.nn.functional.gelu(x))


class OverflowLayerNorm(torch.nn.Module):
    """nn.LayerNorm with NaN rows where the f32 variance overflows, the engine's documented value."""

    def __init__(self, inner: torch.nn.LayerNorm):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
        return torch.where(torch.isfinite(var), self.inner(x), torch.nan)


def oracle(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The model as PyTorch computes it on the weights the image stores."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.GELU) and child.approximate == "none":
                setattr(module, child_name, LimitGELU())
            elif isinstance(child, torch.nn.LayerNorm):
                setattr(module, child_name, OverflowLayerNorm(child))
    quant = DTYPES[dtype].get("dtype", "f32")
    if quant != "f32":
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    w = module.weight.numpy()
                    if quant == "q8":  # compact (format v2): the bias travels with the scales, maybe as f16
                        bias = None if module.bias is None else module.bias.numpy()
                        stored = quantize_q8(w, bias=bias, compact=True)
                        if bias is not None:
                            module.bias.copy_(torch.from_numpy(stored.bias.astype(np.float32)))
                    else:
                        stored = quantize_f16(w)
                    module.weight.copy_(torch.from_numpy(dense(stored)))
    return model.eval()


# --------------------------------------------------------------------------- models


def moe(routing: str, *, renormalize: bool = False, act: str = "gelu", gated: bool = False,
        shared: int = 0, gate: bool = False) -> torch.nn.Module:
    # A router bias keeps logits apart on rows of subnormals (exact ties would leave PyTorch's order open).
    return cnn.MoE(D, 4, 16, top_k=2, routing=routing, renormalize=renormalize, activation=act, gated=gated,
                   router_bias=True, num_shared=shared, shared_gate=gate)


ELEMENTWISE = {
    "relu": lambda: torch.nn.ReLU(),
    "gelu": lambda: torch.nn.GELU(),
    "gelu_tanh": lambda: torch.nn.GELU(approximate="tanh"),
    "silu": lambda: torch.nn.SiLU(),
    "tanh": lambda: torch.nn.Tanh(),
    "sigmoid": lambda: torch.nn.Sigmoid(),
    "layernorm": lambda: torch.nn.LayerNorm(D),
    "layernorm_plain": lambda: torch.nn.LayerNorm(D, elementwise_affine=False),
    "rmsnorm": lambda: torch.nn.RMSNorm(D, eps=1e-6),
    "rmsnorm_eps_none": lambda: torch.nn.RMSNorm(D, eps=None),
}

WEIGHTED = {
    "linear": lambda: torch.nn.Linear(D, 6),
    "linear_nobias": lambda: torch.nn.Linear(D, D, bias=False),
    "residual": lambda: cnn.Residual(torch.nn.Linear(D, D)),
    "linear_relu_linear": lambda: torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)),
    "moe_top1": lambda: moe("top1", act="relu"),
    "moe_topk_softmax": lambda: moe("topk_softmax", act="silu", gated=True),
    "moe_softmax_topk": lambda: moe("softmax_topk", act="gelu_tanh"),
    "moe_softmax_topk_renorm": lambda: moe("softmax_topk", renormalize=True, act="tanh"),
    "moe_dense": lambda: moe("dense", act="sigmoid"),
    "moe_shared_gate": lambda: moe("topk_softmax", act="gelu", shared=2, gate=True),
    "moe_residual_norm": lambda: cnn.Residual(torch.nn.LayerNorm(D), moe("softmax_topk", act="relu", shared=1)),
}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    factory = ELEMENTWISE.get(kind) or WEIGHTED[kind]
    return torch.nn.Sequential(factory()).eval()


def run_all(kind: str, dtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C engine, numpy reference, PyTorch) outputs for one model and batch."""
    model = build(kind)
    with torch.no_grad():
        if isinstance(model[0], (torch.nn.LayerNorm, torch.nn.RMSNorm)) and model[0].weight is not None:
            # Non-trivial affine parameters, so they take part in the comparison.
            model[0].weight.uniform_(0.5, 1.5)
            if getattr(model[0], "bias", None) is not None:
                model[0].bias.uniform_(-0.5, 0.5)
    result = export(model, None, max_batch=MAX_BATCH, example_input=torch.zeros(1, D), **DTYPES[dtype])
    got = colibri.Model(result.image).forward(x)
    ref = reference.run(colibri.image.read(result.image), x)
    with torch.no_grad():
        want = oracle(model, dtype)(torch.from_numpy(x)).numpy()
    return got, ref, want


# --------------------------------------------------------------------------- every op, every dtype


@pytest.mark.parametrize("kind", ELEMENTWISE)
def test_elementwise_ops(kind: str) -> None:
    x = special_inputs(D, seed=1)
    got, ref, want = run_all(kind, "f32", x)
    assert np.isnan(got).any(), "the batch holds NaN rows: some output must be NaN"
    assert_same(got, ref, f"{kind}: C vs reference")
    assert_same(got, want, f"{kind}: C vs PyTorch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", WEIGHTED)
def test_weighted_ops(kind: str, dtype: str) -> None:
    x = special_inputs(D, seed=2)
    got, ref, want = run_all(kind, dtype, x)
    assert np.isnan(got[-1]).all(), "a row of NaN must come out NaN"
    assert np.isfinite(got[0]).all(), "the clean row must stay finite"
    assert_same(got, ref, f"{kind} {dtype}: C vs reference")
    if dtype.startswith("q8"):
        ordinary = ~(np.abs(np.nan_to_num(x, posinf=0, neginf=0)) > 1e30).any(axis=1)
        got, want = got[ordinary], want[ordinary]
    if dtype == "q8-int8-act":
        # A row with NaN or ±inf has no int8 form: the engine's NaN scale makes every output of that
        # layer NaN where PyTorch's float Linear may give ±inf. Non-finite where PyTorch is non-finite;
        # finite values carry the int8 rounding, which the q8 tests bound, not this one.
        assert (np.isfinite(got) == np.isfinite(want)).all(), f"{kind}: finite pattern differs from PyTorch"
        assert (np.isnan(want) <= np.isnan(got)).all(), f"{kind}: PyTorch NaN not NaN in the engine"
    else:
        assert_same(got, want, f"{kind} {dtype}: C vs PyTorch")


# --------------------------------------------------------------------------- the semantics, one by one


def test_relu_keeps_nan() -> None:
    """ReLU(NaN) is NaN: a sensor dropout must not become a plausible 0."""
    got, ref, want = run_all("relu", "f32", np.array([[NAN, -NAN, INF, -INF, -1.0, 0.0, 1e-40, 2.0]], np.float32))
    assert np.isnan(got[0, :2]).all() and got[0, 2] == INF and (got[0, 3:6] == 0).all()
    assert got[0, 6] == np.float32(1e-40) and got[0, 7] == 2.0
    assert_same(got, want, "relu")


def test_linear_nan_reaches_every_output_through_a_relu() -> None:
    """The issue's case: NaN in, ReLU between two layers, NaN out (not a forecast)."""
    x = np.zeros((1, D), np.float32)
    x[0, 3] = NAN
    got, ref, want = run_all("linear_relu_linear", "f32", x)
    assert np.isnan(got).all() and np.isnan(ref).all() and np.isnan(want).all()


def test_layernorm_statistics_beyond_f32_give_nan() -> None:
    """A row whose variance overflows f32 is NaN, not (x - mean) / inf = 0 (or beta)."""
    x = np.array([[1e20, -1e20, 0, 0, 0, 0, 0, 0], [1e19, -1e19, 0, 0, 0, 0, 0, 0]], np.float32)
    for kind in ("layernorm", "layernorm_plain"):
        got, ref, _ = run_all(kind, "f32", x)
        assert np.isnan(got[0]).all() and np.isnan(ref[0]).all(), kind
        assert np.isfinite(got[1]).all(), kind  # (1e19)² still fits
        assert_same(got, ref, kind)


def test_rmsnorm_overflow_as_pytorch() -> None:
    """RMSNorm is x / sqrt(mean(x²) + eps) in f32, as PyTorch: an overflowed mean square gives 0 for
    finite entries and NaN for an infinite one."""
    x = np.array([[1e38, 1e38, -1e38, 1, 2, 3, 4, 5], [1.0, INF, 2, 3, 4, 5, 6, 7]], np.float32)
    got, ref, want = run_all("rmsnorm", "f32", x)
    assert (got[0] == 0).all() and np.isnan(got[1, 1]) and (got[1, [0, 2, 3]] == 0).all()
    assert_same(got, want, "rmsnorm")
    assert_same(ref, want, "rmsnorm reference")


def test_int8_activation_rows() -> None:
    """INT8_ACT: a row with NaN or ±inf gets the scale NaN and int8 zeros; a row of subnormals keeps
    its shape (127 / m would overflow: the quantiser scales by 2^100 first); all zeros give a = 0."""
    tiny = 2.0 ** -149  # the smallest subnormal: multiples of it are exact
    x = np.array([[1.0, NAN, 2.0, 0.5], [INF, 1.0, 2.0, 0.5], [-INF, 0, 0, 0], [0, 0, 0, 0],
                  [1000 * tiny, -2000 * tiny, 500 * tiny, 0], [3e38, -1e38, 1.0, 0.4999999701976776]], np.float32)
    xq, a = reference.quantize_rows(x)
    assert np.isnan(a[:3]).all() and (xq[:3] == 0).all()
    assert a[3] == 0 and (xq[3] == 0).all()
    assert xq[4].tolist() == [64, -127, 32, 0] and a[4] == np.float32(np.float32(2000 * tiny) / np.float32(127))
    assert xq[5].tolist() == [127, -42, 0, 0]  # 0.49999997 · 127/3e38 rounds to 0, as roundf does


def test_int8_activation_engine_rows() -> None:
    """The engine's quantiser on the same rows: NaN outputs for non-finite rows, the reference's
    numbers for the others (a Linear with INT8_ACT after them shows the quantised rows)."""
    x = np.array([[1.0, NAN, 2.0, 0.5, 0, 0, 0, 0], [INF, 1.0, 2.0, 0.5, 0, 0, 0, 0],
                  [0.0] * 8, [1e-40, -2e-40, 5e-41, 0, 0, 0, 0, 0], [3e38, -1e38, 1.0, 0.25, 0, 0, 0, 0]],
                 np.float32)
    got, ref, _ = run_all("linear_nobias", "q8-int8-act", x)
    assert np.isnan(got[:2]).all()
    assert (got[2] == 0).all()
    assert np.isfinite(got[3:]).all() and np.abs(got[3]).max() > 0
    np.testing.assert_array_equal(got, ref)  # one int8 dot product per output: the same bits


def nan_logit_moe(routing: str) -> torch.nn.Module:
    """A 2-in MoE whose router turns [3e38, -3e38] into one NaN logit (inf - inf) among finite ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(cnn.MoE(2, 4, 8, top_k=2, routing=routing, activation="relu", router_bias=False))
    with torch.no_grad():
        model[0].router.weight.copy_(torch.tensor([[0.5, 0.25], [0.1, 0.2], [2.0, 2.0], [0.3, 0.1]]))
    return model.eval()


@pytest.mark.parametrize("routing", cnn.ROUTINGS)
def test_nan_logit_is_selected(routing: str) -> None:
    """A NaN router logit ranks above every number, as in torch.topk: the token's output is NaN, never
    the finite mixture of the other experts."""
    model = nan_logit_moe(routing)
    x = np.array([[3e38, -3e38], [1.0, -0.5]], np.float32)
    logits = model[0].router(torch.from_numpy(x)).detach().numpy()
    assert np.isnan(logits[0, 2]) and np.isfinite(logits[0, [0, 1, 3]]).all()
    data = export(model, None, max_batch=2).image
    got = colibri.Model(data).forward(x)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    graph = colibri.image.read(data)
    chosen = [slot for slot, _ in reference.route(graph.layers[0], x[:1])[0]]
    if routing in ("topk_softmax",):
        assert chosen[0] == 2, chosen  # the NaN logit first, then the largest number
    assert np.isnan(got[0]).all() and np.isnan(want[0]).all()
    assert_same(got, want, routing)
    assert_same(reference.run(colibri.image.read(data), x), want, f"{routing} reference")


def test_exact_ties_go_to_the_lower_router_index() -> None:
    """Equal router logits: the lower index is selected (PyTorch leaves the order open, so only the engine
    and the reference are compared)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(cnn.MoE(D, 4, 8, top_k=2, routing="topk_softmax", activation="relu"))
    with torch.no_grad():
        w = model[0].router.weight
        w[3] = w[1]
        w[2] = w[1]  # outputs 1, 2, 3 tie on every input
        w[0] = -w[1].abs()
    data = export(model, None, max_batch=4).image
    x = np.abs(np.random.default_rng(0).standard_normal((4, D))).astype(np.float32)
    graph = colibri.image.read(data)
    for sel in reference.route(graph.layers[0], x):
        assert [slot for slot, _ in sel] == [1, 2], sel
    np.testing.assert_allclose(colibri.Model(data).forward(x), reference.run(colibri.image.read(data), x), rtol=1e-6, atol=1e-6)
    # Switching the tied expert 1 for 3 changes the answer: the choice matters and is the lower index.
    with torch.no_grad():
        model[0].experts[1].w2.weight.mul_(-1)
    flipped = export(model, None, max_batch=4).image
    assert not np.allclose(colibri.Model(flipped).forward(x), colibri.Model(data).forward(x))


def test_zero_gate_weight_does_not_run_the_expert() -> None:
    """An expert selected with gate weight exactly 0 contributes nothing, even where its output
    overflows (0 · inf would be NaN): as colibri.nn.MoE, which skips zero gates."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(cnn.MoE(D, 4, 16, top_k=2, routing="softmax_topk", activation="relu"))
    x = (np.random.default_rng(5).standard_normal((12, D)) * 3e37).astype(np.float32)
    with torch.no_grad():
        top = torch.topk(torch.softmax(model[0].router(torch.from_numpy(x)), -1), 2)
        first = top.indices[0, 0].item()
        x = x[(top.indices[:, 0] == first).numpy()]  # tokens with one first choice; the others tie at 0
        assert len(x) >= 3 and (top.values[:, 1] == 0).all(), "second choices must have weight exactly 0"
        for e, expert in enumerate(model[0].experts):  # every expert but the first choice overflows
            if e != first:
                expert.w2.weight.mul_(1e6)
                assert not torch.isfinite(expert(torch.from_numpy(x))).all()
        want = model(torch.from_numpy(x)).numpy()
    assert np.isfinite(want).all()
    data = export(model, None, max_batch=8).image
    got = colibri.Model(data).forward(x)
    assert_same(got, want, "C vs PyTorch")
    assert_same(reference.run(colibri.image.read(data), x), want, "reference vs PyTorch")


def test_subnormals_are_not_flushed() -> None:
    """Subnormal inputs keep their values through element-wise ops (no flush to zero)."""
    x = np.array([[1e-40, -1e-40, 1e-45, -1e-45, 1e-39, 0, 0, 0]], np.float32)
    got, _, want = run_all("relu", "f32", x)
    assert got[0, 0] == np.float32(1e-40) and got[0, 2] == np.float32(1e-45)
    got, _, want = run_all("tanh", "f32", x)
    np.testing.assert_array_equal(got, want)
    assert math.isclose(float(got[0, 0]), 1e-40, rel_tol=1e-3)


# --------------------------------------------------------------------------- the engine's own exp, erf, tanh

SWEEP_C = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "colibri_math.h"

/* |got - want| in units in the last place of the float nearest to want. */
static double ulps(float got, double want)
{
    const float w = (float)want;
    if (isnan(want) || isinf(w) || isinf(got))
        return (isnan(got) && isnan(want)) || got == w ? 0.0 : INFINITY;
    int e;
    frexpf(w == 0.0f ? 0x1p-149f : w, &e);
    return fabs((double)got - want) / ldexp(1.0, e - 24 < -149 ? -149 : e - 24);
}

int main(int argc, char **argv)
{
    const uint64_t step = strtoull(argv[1], NULL, 10);
    double worst[3] = {0, 0, 0};
    for (uint64_t b = 0; b < (1ull << 32); b += step) {
        const uint32_t bits = (uint32_t)b;
        float x;
        memcpy(&x, &bits, sizeof x);
        const double e[3] = {ulps(colibri_expf(x), exp((double)x)), ulps(colibri_erff(x), erf((double)x)),
                             ulps(colibri_tanhf(x), tanh((double)x))};
        for (int i = 0; i < 3; i++)
            worst[i] = e[i] > worst[i] ? e[i] : worst[i];
    }
    printf("%.6f %.6f %.6f\n", worst[0], worst[1], worst[2]);
    return 0;
}
"""


@pytest.mark.parametrize("variant, bound", [("double", 0.5001), ("float-only", 1.6)])
def test_engine_math_accuracy(tmp_path, variant: str, bound: float) -> None:
    """colibri_expf/erff/tanhf over every 257th float (NaN, ±inf and subnormals included) against
    glibc's double functions: correctly rounded where the FPU has double precision (host, Cortex-M7),
    within 1.6 ulp in the float-only variant (single-precision FPUs)."""
    import subprocess

    src = tmp_path / "sweep.c"
    src.write_text(SWEEP_C)
    core = Path(__file__).resolve().parents[1] / "firmware" / "colibri_core" / "src"
    flags = ["-DCOLIBRI_MATH_FLOAT_ONLY"] if variant == "float-only" else []
    exe = tmp_path / "sweep"
    subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Werror", "-ffp-contract=off", "-fno-math-errno", *flags,
                    f"-I{core}", str(src), "-lm", "-o", str(exe)], check=True)
    worst = [float(v) for v in subprocess.run([str(exe), "257"], capture_output=True, text=True,
                                              check=True, timeout=300).stdout.split()]
    assert max(worst) <= bound, dict(zip(("exp", "erf", "tanh"), worst))
