"""PyTorch module -> layer graph -> model image.

`export()` walks the module tree and maps every module onto image layers. An
unsupported module is refused with its path and type; nothing is skipped
silently. So is a graph the engine would refuse or run wrongly (residual
width or depth, NaN/Inf parameters, q8 compensation beyond f16), before
anything is written. Experts can be pruned by hand (`prune=`) or by a
calibration set (`calibration=`: experts that no calibration token selects
are dropped). With `example_input` the image is checked against PyTorch.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.progress import track
from torch import nn

from ..model import format as F
from .. import image
from ..image.writer import linux_layout
from ..quant import quantize
from ..reference import executor as reference
from . import nn as cnn
from ..model.errors import ColibriError, ExportCheckError, ExportError
from ..model.format import Act, ExpertKind, Routing
from ..model.walks import weight_slots
from ..model.ir import (
    Activation, Attention, Embedding, Expert, Graph, Layer, LayerNorm, Linear, MoE, ResidualAdd, ResidualPush, RMSNorm,
)

_ACT_NAMES = {
    "relu": Act.RELU, "gelu": Act.GELU_ERF, "gelu_tanh": Act.GELU_TANH, "gelu_new": Act.GELU_TANH,
    "gelu_pytorch_tanh": Act.GELU_TANH, "silu": Act.SILU, "swish": Act.SILU, "tanh": Act.TANH,
    "sigmoid": Act.SIGMOID,
}
_ROUTINGS = {
    "top1": Routing.TOP1, "topk_softmax": Routing.TOPK_SOFTMAX,
    "softmax_topk": Routing.SOFTMAX_TOPK, "dense": Routing.DENSE,
}

# Converters for third-party modules, keyed by class name: fn(module, path) -> layers.
# colibri.frontends.hf registers the Hugging Face MoE blocks here.
CONVERTERS: dict[str, Callable[[nn.Module, str], list[Layer]]] = {}


def np32(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float32).cpu().numpy().copy()


def activation_of(module: nn.Module, path: str) -> Act:
    """The image activation for a PyTorch activation module (or an HF ACT2FN entry)."""
    if isinstance(module, nn.GELU):
        return Act.GELU_TANH if module.approximate == "tanh" else Act.GELU_ERF
    for cls, act in ((nn.ReLU, Act.RELU), (nn.SiLU, Act.SILU), (nn.Tanh, Act.TANH), (nn.Sigmoid, Act.SIGMOID)):
        if isinstance(module, cls):
            return act
    name = type(module).__name__
    hf = {"GELUActivation": Act.GELU_ERF, "NewGELUActivation": Act.GELU_TANH,
          "PytorchGELUTanh": Act.GELU_TANH, "GELUTanh": Act.GELU_TANH, "SiLUActivation": Act.SILU}
    if name in hf:
        return hf[name]
    raise ExportError(f"{path} ({type(module).__module__}.{name}): activation not supported by Colibri")


def _expert(m: cnn.Expert) -> Expert:
    return Expert(
        kind=ExpertKind.GLU if m.gated else ExpertKind.MLP,
        act=_ACT_NAMES[m.activation_name],
        w1=np32(m.w1.weight), b1=np32(m.w1.bias),
        w2=np32(m.w2.weight), b2=np32(m.w2.bias),
        w3=np32(m.w3.weight) if m.w3 is not None else None,
        b3=np32(m.w3.bias) if m.w3 is not None else None,
    )


def colibri_moe(m: cnn.MoE) -> MoE:
    """The graph's MoE layer of a colibri.nn.MoE (also the sparse block of a colibri.nn.MoETransformer)."""
    n = len(m.experts)
    return MoE(
        routing=_ROUTINGS[m.routing], top_k=m.top_k,
        router_weight=np32(m.router.weight), router_bias=np32(m.router.bias),
        experts=[_expert(e) for e in m.experts], expert_map=np.arange(n, dtype=np.int32),
        renormalize=m.renormalize, shared=[_expert(e) for e in m.shared_experts],
        shared_gate=np32(m.shared_gate.weight) if m.shared_gate is not None else None,
    )


def to_layers(module: nn.Module, path: str = "model") -> list[Layer]:
    """Map a module (recursively) onto image layers, or raise ExportError naming it."""
    return [layer for _, layer in located_layers(module, path)]


def located_layers(module: nn.Module, path: str = "model") -> list[tuple[str, Layer]]:
    """(module path, layer) for every image layer of `module`, or raise ExportError naming it."""
    name = type(module).__name__
    if name in CONVERTERS:
        return [(path, layer) for layer in CONVERTERS[name](module, path)]
    if isinstance(module, nn.Sequential):
        return [item for key, child in module.named_children() for item in located_layers(child, f"{path}.{key}")]
    if isinstance(module, (nn.Identity, nn.Dropout)):
        return []  # identity at inference
    if isinstance(module, cnn.Residual):
        return [(path, ResidualPush()), *located_layers(module.body, f"{path}.body"), (path, ResidualAdd())]
    if isinstance(module, cnn.MoE):
        return [(path, colibri_moe(module))]
    if isinstance(module, nn.Linear):
        return [(path, Linear(np32(module.weight), np32(module.bias)))]
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise ExportError(f"{path} (LayerNorm): only normalisation over the last dimension is supported")
        return [(path, LayerNorm(module.normalized_shape[0], float(module.eps), np32(module.weight),
                                 np32(module.bias)))]
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1:
            raise ExportError(f"{path} (RMSNorm): only normalisation over the last dimension is supported")
        eps = module.eps if module.eps is not None else float(torch.finfo(torch.float32).eps)
        return [(path, RMSNorm(module.normalized_shape[0], float(eps), np32(module.weight)))]
    try:
        return [(path, Activation(activation_of(module, path)))]
    except ExportError:
        pass
    raise ExportError(f"{path} ({type(module).__module__}.{name}) is not supported by Colibri")


def _widths(layers: list[Layer], input_size: int | None, paths: Sequence[str] = ()) -> tuple[int, int]:
    """Input and output width of a layer program, checked as the engine's validator checks it.

    The input comes from the first sized layer if not given. Every layer's
    input must match the running width, a residual's body must give back the
    width it was given, and residuals nest at most format.MAX_RESIDUAL_DEPTH
    deep; a violation names the module.
    """
    def where(i: int) -> str:
        return paths[i] if i < len(paths) else f"layers.{i}"

    width = input_size
    stack: list[tuple[int, int | None]] = []  # (index of the push, width pushed)
    for i, layer in enumerate(layers):
        if isinstance(layer, Linear):
            need = layer.in_features
        elif isinstance(layer, (LayerNorm, RMSNorm)):
            need = layer.size
        elif isinstance(layer, MoE):
            need = layer.d_model
        else:
            need = None
        if need is not None:
            if width is None:
                width = input_size = need
                # A residual opened before the first sized layer saved this same width.
                stack = [(j, need if w is None else w) for j, w in stack]
            elif width != need:
                raise ExportError(f"{where(i)} ({type(layer).__name__}): expects {need} features, gets {width}")
        if isinstance(layer, Linear):
            width = layer.out_features
        elif isinstance(layer, ResidualPush):
            if len(stack) == F.MAX_RESIDUAL_DEPTH:
                raise ExportError(f"{where(i)} (Residual): residuals nest {len(stack) + 1} deep, the engine "
                                  f"allows at most {F.MAX_RESIDUAL_DEPTH}")
            stack.append((i, width))
        elif isinstance(layer, ResidualAdd):
            if not stack:
                raise ExportError(f"{where(i)}: residual add without a matching push")
            j, saved = stack.pop()
            if saved is not None and saved != width:
                raise ExportError(f"{where(j)} (Residual): the body maps {saved} features to {width}; a residual "
                                  "needs its body to keep the width")
    if stack:
        raise ExportError(f"{where(stack[-1][0])}: residual push without a matching add")
    if input_size is None or width is None:
        raise ExportError("cannot infer the input size from the layers: pass example_input")
    return input_size, width


def _arrays(layer: Layer) -> Iterator[tuple[str, np.ndarray | None]]:
    """(name within the layer, array) of every tensor a layer stores, experts included."""
    if isinstance(layer, Linear):
        yield "weight", layer.weight
        yield "bias", layer.bias
    elif isinstance(layer, (LayerNorm, RMSNorm)):
        yield "weight", layer.weight
        yield "bias", getattr(layer, "bias", None)
        yield "eps", np.float32(layer.eps)
    elif isinstance(layer, Embedding):
        yield "table", layer.table
    elif isinstance(layer, Attention):
        for name in ("q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b", "q_norm", "k_norm"):
            yield name, getattr(layer, name)
    elif isinstance(layer, MoE):
        yield "router", layer.router_weight
        yield "router_bias", layer.router_bias
        yield "shared_gate", layer.shared_gate
        for group, experts in (("experts", layer.experts), ("shared", layer.shared)):
            for j, e in enumerate(experts):
                for attr in ("w1", "b1", "w2", "b2", "w3", "b3"):
                    yield f"{group}.{j}.{attr}", getattr(e, attr)


def check_finite(graph: Graph) -> None:
    """Refuse NaN/Inf parameters, naming the module and the tensor.

    Such a model exports fine and loads fine, then answers NaN (or a
    plausible-looking number after a ReLU) for every input. The usual cause is
    a block built without loading weights: transformers 5 leaves those
    `torch.empty`, i.e. whatever was in memory.
    """
    for i, layer in enumerate(graph.layers):
        for name, a in _arrays(layer):
            if a is None or not isinstance(a, (np.ndarray, np.floating)):
                continue
            bad = ~np.isfinite(a)
            if bad.any():
                kinds = [kind for kind, found in (("NaN", np.isnan(a).any()), ("Inf", np.isinf(a).any())) if found]
                raise ExportError(f"{graph.where(i)}: {int(bad.sum())} of {a.size} values of {name} are "
                                  f"{'/'.join(kinds)} (uninitialised weights? load or initialise them first)")


def check_limits(graph: Graph) -> None:
    """Refuse, naming the module, what the engine's validator would refuse without saying where."""
    for i, layer in enumerate(graph.layers):
        if isinstance(layer, (LayerNorm, RMSNorm)) and not layer.eps > 0:
            raise ExportError(f"{graph.where(i)} ({type(layer).__name__}): eps={layer.eps:g}, the engine needs "
                              "eps > 0")
        if isinstance(layer, MoE):
            if len(layer.shared) > F.MAX_SHARED:
                raise ExportError(f"{graph.where(i)}: {len(layer.shared)} shared experts, the engine allows at "
                                  f"most {F.MAX_SHARED}")
            if layer.route_count > F.MAX_ROUTES:
                raise ExportError(f"{graph.where(i)}: {layer.route_count} router outputs, the engine allows at "
                                  f"most {F.MAX_ROUTES}")


@dataclass
class PruneReport:
    """What pruning dropped: MoE layer index -> original expert indices."""

    dropped: dict[int, list[int]] = field(default_factory=dict)
    kept: dict[int, list[int]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = []
        for i, dropped in self.dropped.items():
            if dropped:
                out.append(f"MoE {i}: dropped experts {dropped}, kept {self.kept[i]}")
        return out


@dataclass
class Comparison:
    """One output comparison made by the export check."""

    what: str  # e.g. "C engine vs PyTorch (f32)"
    error: float  # max |Δ| over outputs finite on both sides
    tolerance: float
    nonfinite_mismatches: int = 0  # outputs NaN/±Inf on one side only, or Infs that differ

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance and not self.nonfinite_mismatches

    def line(self) -> str:
        return f"{self.what}: max |Δ| {self.error:.3g} (tolerance {self.tolerance:.3g})"


@dataclass
class ExportResult:
    image: bytes
    graph: Graph
    pruned: PruneReport
    max_abs_error: float | None = None  # numpy reference of the image vs the f32 PyTorch module on example_input
    checks: list[Comparison] = field(default_factory=list)  # what the export check compared, if it ran


def _selection_counts(graph: Graph, calibration: np.ndarray) -> list[np.ndarray]:
    moes = graph.moe_layers()
    counts = [np.zeros(m.route_count, dtype=np.int64) for m in moes]
    index = {id(m): i for i, m in enumerate(moes)}

    def on_route(moe: MoE, selection: list) -> None:
        inv = {int(slot): r for r, slot in enumerate(moe.expert_map) if slot >= 0}
        for sel in selection:
            for slot, _ in sel:
                counts[index[id(moe)]][inv[slot]] += 1

    starts = range(0, len(calibration), 256)
    for start in track(starts, description="calibrating routing", disable=len(starts) < 8, transient=True):
        reference.run(graph, calibration[start : start + 256], on_route=on_route)
    return counts


def prune_experts(graph: Graph, drop: Mapping[int, Sequence[int]]) -> PruneReport:
    """Remove routed experts (original router indices) from MoE layers, remapping the routing table."""
    report = PruneReport()
    moes = graph.moe_layers()
    for i, moe in enumerate(moes):
        wanted = sorted(set(int(e) for e in drop.get(i, ())))
        bad = [e for e in wanted if not 0 <= e < moe.route_count]
        if bad:
            raise ExportError(f"MoE {i}: cannot prune experts {bad}, it has {moe.route_count}")
        slot_of = {r: int(s) for r, s in enumerate(moe.expert_map) if s >= 0}
        keep = [r for r in sorted(slot_of) if r not in wanted]
        if moe.routing != Routing.DENSE and len(keep) < moe.top_k:
            raise ExportError(f"MoE {i}: pruning would leave {len(keep)} experts for top_k={moe.top_k}")
        if not keep:
            raise ExportError(f"MoE {i}: pruning would leave no experts")
        moe.experts = [moe.experts[slot_of[r]] for r in keep]
        new_map = np.full(moe.route_count, -1, dtype=np.int32)
        new_map[keep] = np.arange(len(keep), dtype=np.int32)
        moe.expert_map = new_map
        report.dropped[i] = [r for r in sorted(slot_of) if r in wanted]
        report.kept[i] = keep
    return report


def build_graph(
    module: nn.Module,
    *,
    max_batch: int = 1,
    example_input: torch.Tensor | np.ndarray | None = None,
    prune: Mapping[int, Sequence[int]] | Sequence[int] | None = None,
    calibration: torch.Tensor | np.ndarray | None = None,
) -> tuple[Graph, PruneReport]:
    located = located_layers(module)
    layers, paths = [layer for _, layer in located], [p for p, _ in located]
    input_size = None if example_input is None else int(np.asarray(example_input).shape[-1])
    n_in, n_out = _widths(layers, input_size, paths)
    graph = Graph(layers=layers, input_size=n_in, output_size=n_out, max_batch=max_batch, paths=paths)
    n_moe = len(graph.moe_layers())
    drop: dict[int, set[int]] = {i: set() for i in range(n_moe)}
    if prune is not None:
        if isinstance(prune, Mapping):
            items = dict(prune)
        elif n_moe == 1:
            items = {0: list(prune)}
        else:
            raise ExportError(f"the model has {n_moe} MoE layers: pass prune as {{moe_index: [experts]}}")
        for i, experts in items.items():
            if not 0 <= int(i) < n_moe:
                raise ExportError(f"prune: no MoE layer {i} (the model has {n_moe})")
            drop[int(i)].update(int(e) for e in experts)
    if calibration is not None:
        calib = np.asarray(calibration, dtype=np.float32).reshape(-1, n_in)
        for i, count in enumerate(_selection_counts(graph, calib)):
            drop[i].update(int(e) for e in np.flatnonzero(count == 0))
    report = prune_experts(graph, drop) if (prune is not None or calibration is not None) else PruneReport()
    return graph, report


# The check's bound: max |Δ| ≤ CHECK_RTOL · (1 + max|y|). Float32 evaluation orders
# differ (PyTorch, numpy, the C kernels) by a few ulps per sum; 1e-5 leaves room
# for that and is far below any conversion mistake.
CHECK_RTOL = 1e-5


def compare(what: str, got: np.ndarray, want: np.ndarray, rtol: float = CHECK_RTOL) -> Comparison:
    """max |got − want| against rtol · (1 + max|want|), over finite outputs; NaN/Inf must agree in place."""
    got = np.asarray(got, dtype=np.float32).reshape(want.shape)
    finite_g, finite_w = np.isfinite(got), np.isfinite(want)
    both = finite_g & finite_w
    # NaN only where the other side has NaN; an Inf only where the other side has the same Inf.
    mismatch = (finite_g != finite_w) | (np.isnan(got) != np.isnan(want))
    inf = ~finite_g & ~finite_w & ~np.isnan(got) & ~np.isnan(want)
    mismatch |= inf & (got != want)
    diff = np.abs(got[both].astype(np.float64) - want[both])
    scale = float(np.abs(want[finite_w]).max(initial=0.0))
    return Comparison(what, float(diff.max(initial=0.0)), rtol * (1.0 + scale), int(mismatch.sum()))


@contextmanager
def _blocks_take_2d(module: nn.Module) -> Iterator[None]:
    """Let converted third-party blocks (Hugging Face MoE) take [tokens, features] inside any model.

    They unpack `batch, seq, hidden = x.shape`. A 2-D activation becomes
    [tokens, 1, features] for the call — one token per sequence, so no
    per-sequence capacity can drop a token, as in the image — and the output
    is flattened back.
    """
    lifted: list[bool] = []  # per call in progress: did `pre` add the axis (a 3-D input is left alone)

    def pre(_mod: nn.Module, args: tuple) -> tuple | None:
        lift = bool(args) and isinstance(args[0], torch.Tensor) and args[0].ndim == 2
        lifted.append(lift)
        return (args[0][:, None, :], *args[1:]) if lift else None

    def post(_mod: nn.Module, _args: tuple, out: object) -> object:
        if not lifted.pop():
            return None
        first = out[0] if isinstance(out, tuple) else out
        flat = first[:, 0, :] if isinstance(first, torch.Tensor) and first.ndim == 3 else first
        return (flat, *out[1:]) if isinstance(out, tuple) else flat

    handles = []
    for sub in module.modules():
        if type(sub).__name__ in CONVERTERS:
            handles.append(sub.register_forward_pre_hook(pre))
            handles.append(sub.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _torch_forward(module: nn.Module, x: torch.Tensor, n_out: int) -> np.ndarray:
    """The module's own output as [tokens, n_out] (a block's tuple output: its first element)."""
    with _blocks_take_2d(module):
        y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    return y.detach().to(torch.float32).reshape(-1, n_out).numpy()


def _f16_rounded(module: nn.Module) -> nn.Module:
    """A copy whose weight matrices (every ≥2-D parameter: what the image stores as f16) are rounded to f16."""
    rounded = copy.deepcopy(module)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.ndim >= 2 and p.is_floating_point():
                p.copy_(p.to(torch.float16).to(p.dtype))
    return rounded


def _engine_output(data: bytes, x: np.ndarray) -> np.ndarray:
    from ..runtime.engine import Model

    try:
        return Model(data).forward(x)
    except ColibriError as exc:
        raise ExportError(f"the C engine refuses the exported image: {exc}") from None


def _rows_unaffected_by_pruning(full: Graph, x: np.ndarray, report: PruneReport) -> np.ndarray:
    """Tokens whose routing in the unpruned model selects no dropped expert.

    On those the pruned image must still equal PyTorch (the router normalises
    over all outputs); on the others it differs by design.
    """
    ok = np.ones(len(x), dtype=bool)
    index = {id(m): i for i, m in enumerate(full.moe_layers())}

    def on_route(moe: MoE, selection: list) -> None:
        dropped = set(report.dropped.get(index[id(moe)], ()))
        for t, sel in enumerate(selection):
            if any(slot in dropped for slot, _ in sel):  # unpruned: slot == router output
                ok[t] = False

    reference.run(full, x, on_route=on_route)
    return ok


def _check(module: nn.Module, x: torch.Tensor, graph: Graph, data: bytes, dtype: str,
           f32_graph: Graph, int8_act: Sequence[str], want: np.ndarray, got_ref: np.ndarray,
           rows: np.ndarray | None = None) -> list[Comparison]:
    """Compare the image with what it must equal; raise ExportCheckError at the first comparison that fails.

    f32: the numpy reference and the C engine vs PyTorch. f16: both vs PyTorch
    with its weight matrices rounded to f16 (with `keep`, that comparison uses
    the all-f16 image, and the written image's engine run is held to its
    reference). q8 and q4: the C engine vs the numpy reference of the same image (the
    kernels' stated tolerance, CHECK_RTOL); the error against f32 is only
    reported. `rows` (after pruning) selects the tokens PyTorch comparisons
    use; with none left, the engine is held to the reference instead.
    """
    flat = x.reshape(-1, graph.input_size).numpy()
    rows = np.ones(len(flat), dtype=bool) if rows is None else rows
    some = "" if rows.all() else f" on {int(rows.sum())} of {len(rows)} tokens (the others chose a pruned expert)"
    checks: list[Comparison] = []
    engine = _engine_output(data, flat)
    if dtype in ("q8", "q4") or not rows.any():
        checks.append(compare(f"C engine vs numpy reference ({dtype} image)", engine, got_ref))
    elif dtype == "f16":
        rounded_want = _torch_forward(_f16_rounded(module), x, graph.output_size)[rows]
        kept_f32 = any(isinstance(getattr(o, a), np.ndarray) for _, o, a in weight_slots(graph))
        ref16, engine16 = got_ref, engine
        if kept_f32:
            checks.append(compare("C engine vs numpy reference (f16 image with f32 weights kept)", engine, got_ref))
            # Every matrix in f16, routers too, as _f16_rounded rounds every Linear.
            all16 = image.write(quantize.quantize(f32_graph, "f16", int8_act=int8_act, quantize_routers=True))
            ref16, engine16 = reference.run(image.read(all16), flat), _engine_output(all16, flat)
        checks.append(compare(f"numpy reference vs PyTorch (weights rounded to f16){some}", ref16[rows],
                              rounded_want))
        checks.append(compare(f"C engine vs PyTorch (weights rounded to f16){some}", engine16[rows], rounded_want))
    else:
        checks.append(compare(f"numpy reference vs PyTorch (f32){some}", got_ref[rows], want[rows]))
        checks.append(compare(f"C engine vs PyTorch (f32){some}", engine[rows], want[rows]))
    for c in checks:
        if not c.ok:
            raise ExportCheckError(c.what, c.error, c.tolerance, c.nonfinite_mismatches,
                                   "; nothing written (check=False / --no-check exports anyway)")
    return checks


def export(
    module: nn.Module,
    path: str | Path | None = None,
    *,
    max_batch: int = 1,
    example_input: torch.Tensor | np.ndarray | None = None,
    prune: Mapping[int, Sequence[int]] | Sequence[int] | None = None,
    calibration: torch.Tensor | np.ndarray | None = None,
    page_aligned: bool | None = None,
    dtype: str = "f32",
    compensation: float = quantize.DEFAULT_COMPENSATION,
    keep: Sequence[str] = (),
    int8_act: Sequence[str] = (),
    check: bool = True,
    group: int = quantize.Q4_DEFAULT_GROUP,
    q8: Sequence[str] = (),
    quantize_routers: bool = False,
    int8_blocks: Sequence[str] = (),
) -> ExportResult:
    """Export a PyTorch model to a Colibri model image (written to `path` if given).

    `dtype` stores the weight matrices as f32, f16, q8 (int8 per output
    channel plus a sparse f16 compensation of `compensation` share of the
    weights) or q4 (int4 in groups of `group` columns, the same E; format v5);
    `keep`, `int8_act`, `int8_blocks` and `q8` (weights kept int8 in a q4 model) are colibri.quant.quantize
    patterns. `page_aligned` puts each expert on pages of its own with one CRC per tensor (format v3), so
    a mapped file opens without reading its weights; None (the default) does so when the model has experts
    and its compact image would be at least image.writer.LINUX_LAYOUT_MIN_BYTES (16 MiB: no
    microcontroller slot holds it), False keeps the compact layout. Routers and shared gates stay f32 unless `quantize_routers` (colibri.quant.quantize).

    The graph is validated before anything is written (widths, residual
    nesting, finite weights, q8 compensation within f16); a refusal is an
    ExportError naming the module. The image must pass the C engine's own
    validation. With `example_input` ([batch, features], or [batch, seq,
    features] for a bare Hugging Face block) and `check` (the default), the
    image is run by the numpy reference and the C engine and compared with the
    module's forward (see `_check`); a mismatch raises ExportCheckError and
    nothing is written. `max_abs_error` is the reference's error against the
    f32 module, reported for every dtype.
    """
    module = module.eval()
    with torch.no_grad():
        f32_graph, report = build_graph(
            module, max_batch=max_batch, example_input=example_input, prune=prune, calibration=calibration
        )
        check_finite(f32_graph)
        check_limits(f32_graph)
        graph = quantize.quantize(f32_graph, dtype, compensation=compensation, keep=keep, int8_act=int8_act,
                                  int8_blocks=int8_blocks, group=group, q8=q8, quantize_routers=quantize_routers)
        if page_aligned is None:  # docs/linux-edge.md "Export defaults"
            page_aligned = linux_layout(graph)
        data = image.write(graph, page_aligned=page_aligned)
        _engine_validate(data)
        err, checks = None, []
        if example_input is not None:
            x = torch.as_tensor(np.asarray(example_input, dtype=np.float32))
            want = _torch_forward(module, x, graph.output_size)
            flat = x.reshape(-1, graph.input_size).numpy()
            got = reference.run(image.read(data), flat)
            full = compare("", got, want)
            err = float("nan") if full.nonfinite_mismatches else full.error
            if check:
                rows = None
                if any(report.dropped.values()):
                    unpruned, _ = build_graph(module, max_batch=max_batch, example_input=example_input)
                    rows = _rows_unaffected_by_pruning(unpruned, flat, report)
                checks = _check(module, x, graph, data, dtype, f32_graph, int8_act, want, got, rows)
    if path is not None:
        image.write_atomically(Path(path), data)
    return ExportResult(image=data, graph=graph, pruned=report, max_abs_error=err, checks=checks)


def _engine_validate(data: bytes) -> None:
    """Last gate: the C engine's validator must accept what the exporter wrote."""
    from ..runtime.engine import validate

    try:
        validate(data)
    except ColibriError as exc:
        raise ExportError(f"the exporter produced an image the C engine refuses ({exc}); please report this "
                          "model") from None
