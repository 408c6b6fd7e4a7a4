"""Per-layer weight dtypes that fit a board: `colibri quantize --target BOARD`.

A board's budget is what its support states (never a number of this module's own):
- flash: one model slot's capacity (colibri.target.slots.LAYOUTS, boards/*/README.md), the image the runner
  boots in place;
- RAM: the runner's arena, RUNNER_ARENA_CAPACITY in boards/<board>/board.mk (the C build's value).

The arena is checked with colibri_model_size on the 64-bit host (engine.arena_size), which is at least
the 32-bit target's (pointers are narrower there: tests/test_target_lm.py). It depends on the graph's
shapes, max_batch and KV cache, not on weight dtypes (the planner sets no int8 activations), so a
model whose arena does not fit is refused whatever the dtypes.

The plan: every weight matrix starts at the smallest dtype it may take (routers and shared gates
stay f32, see colibri.quant.quantize); then, greedily, the upgrade (to the next wider dtype of one
matrix) with the largest error reduction per added byte that still fits the flash is taken, until
none fits. A matrix's error is its relative squared output error,
Σ_c m_c ‖ΔW[:, c]‖² / Σ_c m_c ‖W[:, c]‖², with m_c the mean square of input feature c over the
calibration inputs (colibri.quant.calibrate), or 1 without them; the plan minimises their sum. Greedy by
error per byte is not the exact knapsack optimum, but each step is the best local trade.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..runtime import engine, sources
from .. import image
from . import slots
from ..model.errors import ColibriError, ExportError
from ..model.format import PAYLOAD_ALIGN, TENSOR, q4_layout, q4_row_bytes, q8_layout
from ..model.ir import Embedding, F16Weight, Graph, Q4Weight, Q8Weight, dense
from ..model.walks import BIAS_OF, name_matches, router_feeders, weight_slots
from ..quant.quantize import (DEFAULT_COMPENSATION, Q4_DEFAULT_GROUP, ROUTER_PATTERNS, quantize, quantize_f16, quantize_q4,
                              quantize_q8)


class BudgetError(ColibriError):
    """Nothing fits the board: the message says which budget and by how much."""


@dataclass(frozen=True)
class Board:
    name: str
    flash: int  # largest image a model slot holds
    arena: int  # the runner's arena capacity


def board(name: str) -> Board:
    """The budget of a board the runner supports, read from its slot layout and boards/<name>/board.mk."""
    if name not in slots.LAYOUTS:
        raise ColibriError(f"unknown board {name!r}; boards: {', '.join(sorted(slots.LAYOUTS))}")
    mk = sources.root() / "boards" / name / "board.mk"
    if not mk.exists():
        raise ColibriError(f"{mk} is missing: the board's arena capacity is stated there")
    found = re.search(r"-DRUNNER_ARENA_CAPACITY=(\d+)", mk.read_text())
    if not found:
        raise ColibriError(f"{mk} does not define RUNNER_ARENA_CAPACITY")
    return Board(name, slots.LAYOUTS[name].capacity, int(found.group(1)))


def _aligned(n: int) -> int:
    return (n + PAYLOAD_ALIGN - 1) // PAYLOAD_ALIGN * PAYLOAD_ALIGN


def stored_bytes(w, moved_bias: np.ndarray | None = None) -> int:
    """Image bytes of one weight matrix as stored: its payload(s) aligned, and the records they take.
    A q8 matrix's companion holds its bias (compact format), a q4 one's where f16 holds it: the f32
    bias tensor it replaces is counted otherwise, through `moved_bias`."""
    bias = 0 if moved_bias is None else _aligned(4 * moved_bias.size) + TENSOR.size
    if isinstance(w, Q4Weight):
        rows, cols = w.shape
        layout = q4_layout(rows, cols, w.nnz, w.group.bit_length() - 1, w.bias is not None)
        return (_aligned(rows * q4_row_bytes(cols)) + _aligned(layout["size"]) + 2 * TENSOR.size
                + (0 if w.bias is not None else bias))
    if isinstance(w, Q8Weight):
        rows = w.q.shape[0]
        layout = q8_layout(2, rows, w.nnz, w.scale.dtype.itemsize, w.bias is not None)
        return _aligned(w.q.nbytes) + _aligned(layout["size"]) + 2 * TENSOR.size
    if isinstance(w, F16Weight):
        return _aligned(w.data.nbytes) + TENSOR.size + bias
    return _aligned(4 * np.asarray(w).size) + TENSOR.size + bias


def _rel_error(w: np.ndarray, approx: np.ndarray, m: np.ndarray | None) -> float:
    col = np.ones(w.shape[1]) if m is None else m.astype(np.float64)
    den = float((w.astype(np.float64) ** 2).sum(axis=0) @ col)
    num = float(((w.astype(np.float64) - approx) ** 2).sum(axis=0) @ col)
    return num / den if den else 0.0


@dataclass
class Choice:
    name: str
    dtype: str
    bytes: int
    error: float


@dataclass
class Plan:
    board: Board
    choices: list[Choice]
    graph: Graph  # the quantised graph
    image: bytes
    arena: int
    f32_bytes: int

    @property
    def error(self) -> float:
        return sum(c.error for c in self.choices)

    def lines(self) -> list[str]:
        width = max(len(c.name) for c in self.choices)
        out = [f"plan for {self.board.name}: flash slot {self.board.flash:,} B, arena {self.board.arena:,} B",
               f"  {'weight':<{width}}  {'dtype':<5} {'bytes':>10}  {'rel. error':>10}"]
        for c in self.choices:
            out.append(f"  {c.name:<{width}}  {c.dtype:<5} {c.bytes:>10,}  {c.error:>10.2e}")
        counts = {d: sum(c.dtype == d for c in self.choices) for d in reversed(PLANNED)}
        out.append("  dtypes: " + ", ".join(f"{d} {n}" for d, n in counts.items() if n)
                   + f"; summed rel. error {self.error:.3e}")
        out.append(f"footprint: image {len(self.image):,} B of {self.board.flash:,} "
                   f"({100 * len(self.image) / self.board.flash:.1f}%, f32 {self.f32_bytes:,} B), "
                   f"arena {self.arena:,} B of {self.board.arena:,} ({100 * self.arena / self.board.arena:.1f}%)")
        return out


# The dtypes a plan chooses among, smallest first.
PLANNED = ("q4", "q8", "f16", "f32")


def _ladder(name: str, quantize_routers: bool, floor: str | None, table: bool) -> tuple[str, ...]:
    """The dtypes a matrix may take, smallest first: routers and shared gates only f32 by default; a
    matrix feeding a router (`floor`: router_inputs) nothing narrower than that; no int4 for an
    embedding table or a router (the format has none, docs/model-format.md)."""
    router = name_matches(name, ROUTER_PATTERNS)
    if not quantize_routers and router:
        return ("f32",)
    ladder = PLANNED[PLANNED.index(floor):] if floor else PLANNED
    return tuple(d for d in ladder if d != "q4") if table or router else ladder


def plan(graph: Graph, target: str | Board, *, calibration: np.ndarray | None = None,
         compensation: float = DEFAULT_COMPENSATION, quantize_routers: bool = False, clip: bool = False,
         keep: Sequence[str] = (), router_inputs: str | None = None, group: int = Q4_DEFAULT_GROUP) -> Plan:
    """The dtypes of `graph`'s weight matrices that fit `target` with the least summed error (module
    docstring); raises BudgetError when even the smallest dtypes do not fit. `router_inputs` (f16 or
    f32): the matrices feeding a router (colibri.model.walks.router_feeders) take at least that. `group`:
    the columns per scale of the q4 matrices."""
    if router_inputs not in (None, "f32", "f16"):
        raise ColibriError(f"router_inputs must be f32 or f16, got {router_inputs!r}")
    feeders = set(router_feeders(graph)) if router_inputs else set()
    names = [name for name, _, _ in weight_slots(graph)]
    for pattern in keep:
        if not any(name_matches(n, [pattern]) for n in names):
            raise ColibriError(f"pattern {pattern!r} matches no weight; names look like {names[:3]}")
    b = board(target) if isinstance(target, str) else target
    f32_image = image.write(graph)
    arena = engine.arena_size(f32_image)
    if arena > b.arena:
        raise BudgetError(f"the model's arena needs {arena:,} B, {b.name}'s runner has {b.arena:,} B: weight dtypes "
                          f"do not change it; lower max_batch (or max_seq_len for a token model)")
    moments = {}
    if calibration is not None:
        from ..quant.calibrate import input_moments

        moments = input_moments(graph, calibration)
    # One option list per distinct matrix: a tied head is its embedding table (one tensor in the image).
    units: list[tuple[str, list[Choice]]] = []
    seen: set[int] = set()
    tables = {id(layer.table) for layer in graph.layers if isinstance(layer, Embedding)}
    for name, owner, attr in weight_slots(graph):
        w = getattr(owner, attr)
        if id(w) in seen:
            continue
        seen.add(id(w))
        b_attr = BIAS_OF.get(attr)
        bias = getattr(owner, b_attr) if b_attr else None
        ladder = ("f32",) if name_matches(name, keep) else _ladder(name, quantize_routers,
                                                                 router_inputs if name in feeders else None,
                                                                 id(w) in tables)
        options = []
        for dtype in ladder:
            try:
                if dtype == "f32":
                    stored = w
                elif dtype == "f16":
                    stored = quantize_f16(w)
                elif dtype == "q4":
                    stored = quantize_q4(w, compensation, group=group, bias=bias)
                else:
                    stored = quantize_q8(w, compensation, bias=bias, compact=True, clip=clip,
                                         importance=moments.get(name))
            except ExportError:
                continue  # beyond f16's range: quantize() would refuse it too
            approx = w if dtype == "f32" else dense(stored)
            options.append(Choice(name, dtype, stored_bytes(stored, bias), _rel_error(w, approx, moments.get(name))))
        units.append((name, options))

    level = [0] * len(units)  # index into each unit's options: 0 the smallest
    fixed = len(f32_image) - sum(options[-1].bytes for _, options in units)  # tables, norms, biases of f32 rows
    used = fixed + sum(options[0].bytes for _, options in units)
    if used > b.flash:
        raise BudgetError(f"with every weight at its smallest dtype ({PLANNED[0]}; routers f32, embedding tables q8) "
                          f"the image needs about "
                          f"{used:,} B, {b.name}'s model slot holds {b.flash:,} B: the model is "
                          f"{used - b.flash:,} B too large for this board")
    while True:
        best, best_gain = None, 0.0
        for i, (_, options) in enumerate(units):
            if level[i] + 1 >= len(options):
                continue
            now, up = options[level[i]], options[level[i] + 1]
            extra = up.bytes - now.bytes
            if used + extra > b.flash:
                continue
            gain = (now.error - up.error) / max(extra, 1)
            if gain > best_gain:
                best, best_gain = i, gain
        if best is None:
            break
        options = units[best][1]
        used += options[level[best] + 1].bytes - options[level[best]].bytes
        level[best] += 1
    while True:
        choices = [options[level[i]] for i, (_, options) in enumerate(units)]
        quantised = quantize(graph, "f32", compensation=compensation, clip=clip, calibration=calibration,
                             dtypes={c.name: c.dtype for c in choices}, quantize_routers=True, group=group)
        data = image.write(quantised)
        if len(data) <= b.flash:
            break
        # The byte estimate missed some table or padding bytes: undo the upgrade that saves most per error.
        undo = [i for i in range(len(units)) if level[i] > 0]
        if not undo:
            raise BudgetError(f"the smallest dtypes give a {len(data):,}-byte image, {b.name}'s model slot holds "
                              f"{b.flash:,} B")
        i = max(undo, key=lambda i: (units[i][1][level[i]].bytes - units[i][1][level[i] - 1].bytes)
                / max(units[i][1][level[i] - 1].error - units[i][1][level[i]].error, 1e-30))
        level[i] -= 1
    final_arena = engine.arena_size(data)
    if final_arena > b.arena:  # not expected (see the module docstring), but never print a plan that does not run
        raise BudgetError(f"the planned model's arena needs {final_arena:,} B, {b.name}'s runner has {b.arena:,} B")
    return Plan(b, choices, quantised, data, final_arena, len(f32_image))
