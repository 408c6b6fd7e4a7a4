"""PyTorch module -> layer graph -> model image.

`export()` walks the module tree and maps every module onto image layers. An
unsupported module is refused with its path and type; nothing is skipped
silently. Experts can be pruned by hand (`prune=`) or by a calibration set
(`calibration=`: experts that no calibration token selects are dropped).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.progress import track
from torch import nn

from . import image, quantize, reference
from . import nn as cnn
from .errors import ExportError
from .format import Act, ExpertKind, Routing
from .ir import Activation, Expert, Graph, Layer, LayerNorm, Linear, MoE, ResidualAdd, ResidualPush, RMSNorm

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
# colibri.hf registers the Hugging Face MoE blocks here.
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


def activation_by_name(name: str, path: str) -> Act:
    if name not in _ACT_NAMES:
        raise ExportError(f"{path}: activation {name!r} not supported by Colibri")
    return _ACT_NAMES[name]


def _expert(m: cnn.Expert) -> Expert:
    return Expert(
        kind=ExpertKind.GLU if m.gated else ExpertKind.MLP,
        act=_ACT_NAMES[m.activation_name],
        w1=np32(m.w1.weight), b1=np32(m.w1.bias),
        w2=np32(m.w2.weight), b2=np32(m.w2.bias),
        w3=np32(m.w3.weight) if m.w3 is not None else None,
        b3=np32(m.w3.bias) if m.w3 is not None else None,
    )


def _colibri_moe(m: cnn.MoE) -> MoE:
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
    name = type(module).__name__
    if name in CONVERTERS:
        return CONVERTERS[name](module, path)
    if isinstance(module, nn.Sequential):
        return [layer for key, child in module.named_children() for layer in to_layers(child, f"{path}.{key}")]
    if isinstance(module, (nn.Identity, nn.Dropout)):
        return []  # identity at inference
    if isinstance(module, cnn.Residual):
        return [ResidualPush(), *to_layers(module.body, f"{path}.body"), ResidualAdd()]
    if isinstance(module, cnn.MoE):
        return [_colibri_moe(module)]
    if isinstance(module, nn.Linear):
        return [Linear(np32(module.weight), np32(module.bias))]
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise ExportError(f"{path} (LayerNorm): only normalisation over the last dimension is supported")
        return [LayerNorm(module.normalized_shape[0], float(module.eps), np32(module.weight), np32(module.bias))]
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1:
            raise ExportError(f"{path} (RMSNorm): only normalisation over the last dimension is supported")
        eps = module.eps if module.eps is not None else float(torch.finfo(torch.float32).eps)
        return [RMSNorm(module.normalized_shape[0], float(eps), np32(module.weight))]
    try:
        return [Activation(activation_of(module, path))]
    except ExportError:
        pass
    raise ExportError(f"{path} ({type(module).__module__}.{name}) is not supported by Colibri")


def _widths(layers: list[Layer], input_size: int | None) -> tuple[int, int]:
    """Input and output width of a layer list; the input from its first sized layer if not given."""
    width = input_size
    for layer in layers:
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
            elif width != need:
                raise ExportError(f"{type(layer).__name__} expects {need} features, gets {width}")
        if isinstance(layer, Linear):
            width = layer.out_features
    if input_size is None or width is None:
        raise ExportError("cannot infer the input size from the layers: pass example_input")
    return input_size, width


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
class ExportResult:
    image: bytes
    graph: Graph
    pruned: PruneReport
    max_abs_error: float | None = None  # vs PyTorch on example_input, if given


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
    layers = to_layers(module)
    input_size = None if example_input is None else int(np.asarray(example_input).shape[-1])
    n_in, n_out = _widths(layers, input_size)
    graph = Graph(layers=layers, input_size=n_in, output_size=n_out, max_batch=max_batch)
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


def export(
    module: nn.Module,
    path: str | Path | None = None,
    *,
    max_batch: int = 1,
    example_input: torch.Tensor | np.ndarray | None = None,
    prune: Mapping[int, Sequence[int]] | Sequence[int] | None = None,
    calibration: torch.Tensor | np.ndarray | None = None,
    page_aligned: bool = False,
    dtype: str = "f32",
    compensation: float = quantize.DEFAULT_COMPENSATION,
    keep: Sequence[str] = (),
    int8_act: Sequence[str] = (),
) -> ExportResult:
    """Export a PyTorch model to a Colibri model image (written to `path` if given).

    `dtype` stores the weight matrices as f32, f16 or q8 (int8 per output
    channel plus a sparse f16 compensation of `compensation` share of the
    weights); `keep` and `int8_act` are colibri.quantize patterns.
    With `example_input`, the image is run by the numpy reference and compared
    with the module's own forward; the largest absolute difference is reported.
    """
    module = module.eval()
    with torch.no_grad():
        graph, report = build_graph(
            module, max_batch=max_batch, example_input=example_input, prune=prune, calibration=calibration
        )
        graph = quantize.quantize(graph, dtype, compensation=compensation, keep=keep, int8_act=int8_act)
        data = image.write(graph, page_aligned=page_aligned)
        err = None
        if example_input is not None:
            x = torch.as_tensor(np.asarray(example_input, dtype=np.float32))
            # Hugging Face MoE blocks take [batch, seq, hidden] only.
            want = module(x[None] if x.ndim == 2 and type(module).__name__ in CONVERTERS else x)
            want = want[0] if isinstance(want, tuple) else want
            got = reference.run(data, x.reshape(-1, graph.input_size).numpy())
            err = float(np.max(np.abs(got - want.reshape(-1, graph.output_size).numpy()))) if got.size else 0.0
    if path is not None:
        Path(path).write_bytes(data)
    return ExportResult(image=data, graph=graph, pruned=report, max_abs_error=err)
