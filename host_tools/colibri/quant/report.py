"""How much quantisation costs: per-layer and end-to-end error against the f32
model over calibration inputs, the routing agreement of every MoE layer, and
where an image's bytes go (`image_bytes`)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.progress import Progress

from ..model import format as F
from .. import image as _image
from ..image.codecs import total_size
from ..reference import executor as reference
from ..model.ir import Graph, dense
from .quantize import weight_slots

# ---------------------------------------------------------------------------
# Where an image's bytes go

BYTE_PARTS = {
    "weights": "weights (weight matrices: int4, int8, f16 or f32)",
    "scales": "int8 scales, int4 group scales",
    "e_row_ptr": "compensation E: row pointers",
    "e_col": "compensation E: columns",
    "e_val": "compensation E: values",
    "biases": "biases",
    "other": "norm parameters, expert maps",
    "tables": "header, records, companion headers, alignment padding",
}


@dataclass
class ImageBytes:
    """Bytes of an image by what they hold (BYTE_PARTS); they sum to the image size."""

    total: int
    parts: dict[str, int]
    version: int = F.VERSION
    companion_biases: int = 0  # of `biases`, those held in Q8_PARAMS companions (format v2)
    weight_dtypes: dict[str, int] = field(default_factory=dict)  # of `weights`, by storage dtype

    @property
    def compensation(self) -> int:
        return self.parts["e_row_ptr"] + self.parts["e_col"] + self.parts["e_val"]

    def lines(self) -> list[str]:
        out = [f"image bytes (format v{self.version}): {self.total:,}"]
        for key, what in BYTE_PARTS.items():
            n = self.parts[key]
            extra = ""
            if key == "weights" and self.weight_dtypes:
                extra = " (" + ", ".join(f"{k} {v:,}" for k, v in self.weight_dtypes.items()) + ")"
            elif key == "biases" and self.companion_biases:
                extra = f" ({self.companion_biases:,} in Q8_PARAMS/Q4_PARAMS)"
            out.append(f"  {what:<56} {n:>10,} {100 * n / self.total:6.2f}%{extra}")
        return out


def image_bytes(data: bytes | bytearray | memoryview) -> ImageBytes:
    """Where the bytes of a valid image go: weights, scales, E (row pointers, columns, values),
    biases, norm parameters and expert maps, and the rest (header, tables, padding)."""
    _image.read(data)  # validated: every field below is in range
    buf = bytes(data)
    h = F.HEADER.unpack_from(buf, 0)
    version, size = h[1], total_size(buf)
    n_t, t_off, n_l, l_off, n_m, m_off, n_e, e_off = h[9:17]
    rec = F.tensor_record(version)
    recs = [rec.unpack_from(buf, t_off + i * rec.size) for i in range(n_t)]
    role: dict[int, str] = {}

    def mark(index: int, what: str) -> None:
        if index != F.NONE:
            role[index] = what

    for i in range(n_l):
        op, _, _, _, _, t0, t1, *_ = F.LAYER.unpack_from(buf, l_off + i * F.LAYER.size)
        if op == F.Op.LINEAR:
            mark(t0, "weights")
            mark(t1, "biases")
        elif op in (F.Op.LAYERNORM, F.Op.RMSNORM):
            mark(t0, "other")
            mark(t1, "other")
    for i in range(n_m):
        rec = F.MOE.unpack_from(buf, m_off + i * F.MOE.size)
        mark(rec[7], "weights")
        mark(rec[8], "biases")
        mark(rec[9], "other")
        mark(rec[11], "weights")
    for i in range(n_e):
        _, _, _, _, w1, b1, w2, b2, w3, b3 = F.EXPERT.unpack_from(buf, e_off + i * F.EXPERT.size)
        for w in (w1, w2, w3):
            mark(w, "weights")
        for b in (b1, b2, b3):
            mark(b, "biases")

    parts = dict.fromkeys(BYTE_PARTS, 0)
    dtypes: dict[str, int] = {}
    in_companions = 0
    for i, (off, nbytes, rows, _, dtype, *_) in enumerate(recs):
        if dtype == F.DType.Q8_PARAMS:
            nnz, p_dtype, flags = struct.unpack_from("<IBB", buf, off)
            param = 2 if version >= 2 and p_dtype == F.DType.F16 else 4
            bias = version >= 2 and bool(flags & F.Q8Flag.BIAS)
            parts["scales"] += param * rows
            if bias:
                parts["biases"] += param * rows
                in_companions += param * rows
            if nnz:
                parts["e_row_ptr"] += F.q8_row_ptr_bytes(version, nnz) * (rows + 1)
                parts["e_col"] += 2 * nnz
                parts["e_val"] += 2 * nnz
            continue
        if dtype == F.DType.Q4_PARAMS:  # f16 group scales, f16 bias, E (v5)
            nnz, g_log2, flags = struct.unpack_from("<IBB", buf, off)
            parts["scales"] += 2 * rows * F.q4_groups(recs[i][3], g_log2)
            if flags & F.Q4Flag.BIAS:
                parts["biases"] += 2 * rows
                in_companions += 2 * rows
            if nnz:
                parts["e_row_ptr"] += F.q8_row_ptr_bytes(2, nnz) * (rows + 1)
                parts["e_col"] += 2 * nnz
                parts["e_val"] += 2 * nnz
            continue
        what = role.get(i, "other")
        parts[what] += nbytes
        if what == "weights":
            name = F.DType(dtype).name.lower()
            dtypes[name] = dtypes.get(name, 0) + nbytes
    parts["tables"] = size - sum(parts.values())
    return ImageBytes(total=size, parts=parts, version=version, companion_biases=in_companions,
                      weight_dtypes=dtypes)



# What routing-safe quantisation aims for (issue 14): a token keeps its expert set, and the model's output
# moves by at most this share.
ROUTING_TARGET = 0.99
ERROR_TARGET = 0.01


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    den = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want)) / den if den else float(np.linalg.norm(got))


@dataclass
class LayerError:
    index: int
    op: str
    rel_l2: float  # of this layer's output, quantised model vs f32 model (errors accumulate)
    abs_errors: np.ndarray  # |Δ| of every output element, for the plot


@dataclass
class QuantReport:
    layers: list[LayerError]
    weights: dict[str, float]  # relative L2 error of every quantised weight matrix
    routing_agreement: dict[int, float]  # MoE layer index -> share of tokens with the same expert set
    outputs_f32: np.ndarray
    outputs_quantised: np.ndarray
    tokens: int = 0
    routing_flips: dict[int, int] = field(default_factory=dict)  # MoE layer index -> tokens with another expert set

    @property
    def targets_met(self) -> bool:
        """Issue 14's quantisation targets: every MoE layer's routing agreement and the end-to-end error."""
        return (all(a >= ROUTING_TARGET for a in self.routing_agreement.values())
                and self.end_to_end_rel_l2 <= ERROR_TARGET)

    @property
    def end_to_end_rel_l2(self) -> float:
        return rel_l2(self.outputs_quantised, self.outputs_f32)

    @property
    def max_abs_error(self) -> float:
        return float(np.abs(self.outputs_quantised - self.outputs_f32).max())

    def lines(self) -> list[str]:
        out = [f"{'layer':>5}  {'op':<12} {'rel L2 (cumulative)':>20}"]
        for e in self.layers:
            out.append(f"{e.index:>5}  {e.op:<12} {e.rel_l2:>20.3e}")
        by_layer: dict[str, list[float]] = {}
        for name, err in self.weights.items():
            by_layer.setdefault(".".join(name.split(".")[:2]), []).append(err)
        for layer, errs in by_layer.items():
            out.append(f"weights of {layer}: {len(errs)} quantised, rel L2 mean {np.mean(errs):.3e} max {max(errs):.3e}")
        for i, share in self.routing_agreement.items():
            flips = self.routing_flips.get(i)
            flipped = "" if flips is None else f", {flips} flipped to another expert set"
            out.append(f"routing agreement, MoE at layer {i}: {share * 100:.2f}% of {self.tokens} tokens{flipped}")
        out.append(f"end to end over {self.tokens} tokens: rel L2 {self.end_to_end_rel_l2:.3e}, max |Δ| {self.max_abs_error:.3e}")
        if self.routing_agreement:
            out.append(f"targets (routing agreement >= {ROUTING_TARGET:.0%} per MoE layer, end-to-end rel L2 <= "
                       f"{ERROR_TARGET:.0%}): {'met' if self.targets_met else 'NOT met'}")
        return out

    def figure(self):
        """The error picture as a matplotlib Figure (see `plot`)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # A ResidualPush outputs its input unchanged: its column would repeat the previous one.
        shown = [e for e in self.layers if e.op != "ResidualPush"]
        n = len(shown)
        fig, (ax, az) = plt.subplots(2, 1, sharex=True, figsize=(max(6.4, 0.85 * n + 1.5), 5.6),
                                     height_ratios=(3, 1), layout="constrained")
        # Exact zeros (e.g. where a ReLU gives 0 in both models) have no logarithm: they
        # are counted in the lower panel, and only the nonzero errors are drawn.
        nonzero = [e.abs_errors[e.abs_errors > 0].ravel() for e in shown]
        zero_share = [100.0 * float(np.mean(e.abs_errors == 0)) if e.abs_errors.size else 0.0 for e in shown]
        positions = [i + 1 for i, v in enumerate(nonzero) if v.size]
        if positions:
            ax.boxplot([nonzero[p - 1] for p in positions], positions=positions, whis=(1, 99), showfliers=False,
                       widths=0.6, medianprops={"color": "tab:orange", "linewidth": 2})
            ax.set_yscale("log")
        for i, v in enumerate(nonzero):
            if not v.size:
                ax.text(i + 1, 0.5, "no error", transform=ax.get_xaxis_transform(), ha="center", va="center",
                        rotation=90, fontsize=9, color="0.4")
        ax.set_ylabel("|quantised − f32|")
        ax.grid(axis="y", which="major", alpha=0.3)
        ax.set_title("nonzero errors; box: quartiles, orange: median, whiskers: 1st–99th percentile",
                     fontsize=9, color="0.3")
        bars = az.bar(range(1, n + 1), zero_share, width=0.6, color="tab:gray")
        az.bar_label(bars, labels=[f"{z:.3g}%" for z in zero_share], fontsize=8, padding=2)
        az.set_ylim(0, 119)
        az.set_yticks([0, 50, 100])
        az.set_ylabel("exactly 0 (%)")
        az.set_xticks(range(1, n + 1), [f"{e.index} {e.op}" for e in shown], rotation=30, ha="right", fontsize=9)
        az.set_xlim(0.4, n + 0.6)
        fig.suptitle(f"Quantisation error per layer, {self.tokens} tokens\n"
                     f"end-to-end relative L2 {self.end_to_end_rel_l2:.2e}, max |Δ| {self.max_abs_error:.2e}",
                     fontsize=11)
        return fig

    def plot(self, path: str | Path) -> None:
        """Box plot of the nonzero |Δ| per layer on a log axis, and the share of exact zeros below it."""
        import matplotlib.pyplot as plt

        fig = self.figure()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _trace(graph: Graph, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[list[list[frozenset]]]]:
    outputs: list[np.ndarray] = []
    routes: list[list[frozenset]] = []
    y = reference.run(
        graph, x,
        on_layer=lambda i, layer, out: outputs.append(out.copy()),
        on_route=lambda moe, sel: routes.append([frozenset(s for s, _ in token) for token in sel]),
    )
    return y, outputs, routes


def quantisation_report(f32: Graph, quantised: Graph, calibration: np.ndarray, *, batch: int = 256,
                        progress: bool = False) -> QuantReport:
    """Runs both graphs through the numpy reference over the calibration inputs."""
    x = np.asarray(calibration, dtype=np.float32).reshape(-1, f32.input_size)
    moe_layers = [i for i, layer in enumerate(f32.layers) if type(layer).__name__ == "MoE"]
    per_layer: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in f32.layers]
    same = np.zeros(len(moe_layers))
    ys, yqs = [], []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("quantisation report", total=len(x))
        for start in range(0, len(x), batch):
            chunk = x[start : start + batch]
            y, outs, routes = _trace(f32, chunk)
            yq, outs_q, routes_q = _trace(quantised, chunk)
            ys.append(y)
            yqs.append(yq)
            for i, (a, b) in enumerate(zip(outs, outs_q)):
                per_layer[i].append((b, a))
            for j, (r, rq) in enumerate(zip(routes, routes_q)):
                same[j] += sum(a == b for a, b in zip(r, rq))
            bar.advance(task, len(chunk))
    layers = []
    for i, pairs in enumerate(per_layer):
        got = np.concatenate([b for b, _ in pairs])
        want = np.concatenate([a for _, a in pairs])
        layers.append(LayerError(i, type(f32.layers[i]).__name__, rel_l2(got, want), np.abs(got - want)))
    originals = {name: getattr(owner, attr) for name, owner, attr in weight_slots(f32)}
    weights = {
        name: rel_l2(dense(getattr(owner, attr)), originals[name])
        for name, owner, attr in weight_slots(quantised)
        if not isinstance(getattr(owner, attr), np.ndarray)
    }
    return QuantReport(
        layers=layers, weights=weights,
        routing_agreement={i: float(s / len(x)) for i, s in zip(moe_layers, same)},
        routing_flips={i: int(len(x) - s) for i, s in zip(moe_layers, same)},
        outputs_f32=np.concatenate(ys), outputs_quantised=np.concatenate(yqs), tokens=len(x),
    )
