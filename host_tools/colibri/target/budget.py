"""Per-layer weight dtypes that fit a board: `colibri quantize --target BOARD`.

A board's budget is what its support states (never a number of this module's own):
- flash: one model slot's capacity (colibri.target.slots.LAYOUTS, boards/*/README.md), the image the runner
  boots in place;
- RAM: the runner's arena, RUNNER_ARENA_CAPACITY in boards/<board>/board.mk (the C build's value).

The arena is checked with colibri_model_size on the 64-bit host (engine.arena_size), which is at least
the 32-bit target's (pointers are narrower there: tests/target/test_target_hil_lm.py). It depends on the graph's
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
    image: bytes  # the image planned (b"" when it was streamed to `path`)
    arena: int
    f32_bytes: int
    path: object = None  # where a streamed plan's image was written
    image_size: int = 0  # its bytes

    def __post_init__(self) -> None:
        if self.image:
            self.image_size = len(self.image)

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
        out.append(f"footprint: image {self.image_size:,} B of {self.board.flash:,} "
                   f"({100 * self.image_size / self.board.flash:.1f}%, f32 {self.f32_bytes:,} B), "
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


def _options(name: str, w: np.ndarray, bias: np.ndarray | None, ladder: Sequence[str], *, compensation: float,
             clip: bool, importance: np.ndarray | None, group: int,
             stored_as: dict[str, object] | None = None) -> list[Choice]:
    """The matrix `w` in each dtype of `ladder` it can take: its bytes and error (smallest first).
    `stored_as` gives a dtype's stored weight where the source already has it (a GGUF's Q4_0 blocks)."""
    options = []
    for dtype in ladder:
        try:
            if stored_as and dtype in stored_as:
                stored = stored_as[dtype]
            elif dtype == "f32":
                stored = w
            elif dtype == "f16":
                stored = quantize_f16(w)
            elif dtype == "q4":
                stored = quantize_q4(w, compensation, group=group, bias=bias)
            else:
                stored = quantize_q8(w, compensation, bias=bias, compact=True, clip=clip, importance=importance)
        except ExportError:
            continue  # beyond f16's range: quantize() would refuse it too
        approx = w if dtype == "f32" else dense(stored)
        options.append(Choice(name, dtype, stored_bytes(stored, bias), _rel_error(w, approx, importance)))
    return options


def _choose(units: list[tuple[str, list[Choice]]], f32_bytes: int, b: Board) -> list[int]:
    """Each unit's option (an index, 0 the smallest): the greedy upgrades of the module docstring, from
    the smallest dtypes, within the flash. `f32_bytes`: the image's size with every matrix in f32."""
    level = [0] * len(units)
    fixed = f32_bytes - sum(options[-1].bytes for _, options in units)  # tables, norms, biases of f32 rows
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
            return level
        options = units[best][1]
        used += options[level[best] + 1].bytes - options[level[best]].bytes
        level[best] += 1


def _undo_one(units: list[tuple[str, list[Choice]]], level: list[int], size: int, b: Board) -> None:
    """The byte estimate missed some table or padding bytes: undo the upgrade that saves most per error."""
    undo = [i for i in range(len(units)) if level[i] > 0]
    if not undo:
        raise BudgetError(f"the smallest dtypes give a {size:,}-byte image, {b.name}'s model slot holds {b.flash:,} B")
    i = max(undo, key=lambda i: (units[i][1][level[i]].bytes - units[i][1][level[i] - 1].bytes)
            / max(units[i][1][level[i] - 1].error - units[i][1][level[i]].error, 1e-30))
    level[i] -= 1


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
        units.append((name, _options(name, w, bias, ladder, compensation=compensation, clip=clip,
                                     importance=moments.get(name), group=group)))
    level = _choose(units, len(f32_image), b)
    while True:
        choices = [options[level[i]] for i, (_, options) in enumerate(units)]
        quantised = quantize(graph, "f32", compensation=compensation, clip=clip, calibration=calibration,
                             dtypes={c.name: c.dtype for c in choices}, quantize_routers=True, group=group)
        data = image.write(quantised)
        if len(data) <= b.flash:
            break
        _undo_one(units, level, len(data), b)
    final_arena = engine.arena_size(data)
    if final_arena > b.arena:  # not expected (see the module docstring), but never print a plan that does not run
        raise BudgetError(f"the planned model's arena needs {final_arena:,} B, {b.name}'s runner has {b.arena:,} B")
    return Plan(b, choices, quantised, data, final_arena, len(f32_image))


class _PastFlash(Exception):
    """The streamed image came out larger than the slot: undo an upgrade and write it again."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def plan_checkpoint(source, target: str | Board, output, *, max_seq_len: int, max_batch: int = 1,
                    kv_dtype: str = "f32", compensation: float = DEFAULT_COMPENSATION, quantize_routers: bool = False,
                    keep: Sequence[str] = (), router_inputs: str | None = None, group: int = Q4_DEFAULT_GROUP,
                    tokenizer: bool = True, on_weight=None, on_tensor=None) -> Plan:
    """`plan` for a Hugging Face folder or a GGUF file, streamed: the model is never in memory whole.

    Each weight matrix is read once (`on_weight(index, count)` after each) and its error and bytes in
    every dtype it may take are kept, as numbers; the plan is chosen from those (the same greedy
    upgrades as `plan`, no calibration: a token model's errors are unweighted there too), and the
    image is then streamed to `output` by the checkpoint path's writer (`hf_folder.export_graph`,
    each matrix read again when its turn comes). The written file is checked against the slot and
    the arena before it is renamed into place; past the slot (the byte estimate missed padding), the
    upgrade that saves most per error is undone and the image written again. A GGUF's Q4_0 matrices
    count as carried, exact, in q4. `tokenizer`: the source's own goes in, as `colibri export` does."""
    from ..checkpoints import gguf_file, hf_folder
    from ..image import writer

    if router_inputs not in (None, "f32", "f16"):
        raise ColibriError(f"router_inputs must be f32 or f16, got {router_inputs!r}")
    b = board(target) if isinstance(target, str) else target
    gguf = gguf_file.is_gguf(source)
    ck = gguf_file.GGUFCheckpoint(source) if gguf else hf_folder.Checkpoint(source)
    graph = hf_folder.build_folder_graph(ck, max_seq_len=max_seq_len, max_batch=max_batch, kv_dtype=kv_dtype)
    if tokenizer:
        from ..runtime import tokenizer_build

        if gguf:
            from ..checkpoints.gguf_tokenizer import section_from_gguf

            section = section_from_gguf(ck.path)
        else:
            section = tokenizer_build.from_folder(ck.folder)
        if section is not None:
            graph.tokenizer = tokenizer_build.packed_for(section, graph.vocab_size, str(source))
    names = [name for name, _, _ in weight_slots(graph)]
    for pattern in keep:
        if not any(name_matches(n, [pattern]) for n in names):
            raise ColibriError(f"pattern {pattern!r} matches no weight; names look like {names[:3]}")
    feeders = set(router_feeders(graph)) if router_inputs else set()
    tables = {id(layer.table) for layer in graph.layers if isinstance(layer, Embedding)}
    slots_ = [(name, owner, attr) for name, owner, attr in weight_slots(graph)]
    units: list[tuple[str, list[Choice]]] = []
    seen: set[int] = set()
    for index, (name, owner, attr) in enumerate(slots_):
        w = getattr(owner, attr)
        if id(w) in seen:
            continue
        seen.add(id(w))
        b_attr = BIAS_OF.get(attr)
        bias = getattr(owner, b_attr) if b_attr else None
        ladder = ("f32",) if name_matches(name, keep) else _ladder(name, quantize_routers,
                                                                 router_inputs if name in feeders else None,
                                                                 id(w) in tables)
        values = w.load() if isinstance(w, hf_folder.PlannedWeight) else np.asarray(w)
        carried = {}
        if isinstance(w, gguf_file.GGUFWeight) and "q4" in ladder and ck.type_name(w.entry) == "Q4_0":
            blocks = gguf_file.q4_from_q4_0(ck.raw_rows(w.entry), w.shape[1], group, bias, ck.gguf)
            if blocks is not None:
                carried["q4"] = blocks
        units.append((name, _options(name, values, bias, ladder, compensation=compensation, clip=False,
                                     importance=None, group=group, stored_as=carried)))
        del values, carried
        if on_weight is not None:
            on_weight(index, len(slots_))
    f32_bytes = writer.least_size(writer.layout(graph))  # every PlannedWeight is f32 until planned
    level = _choose(units, f32_bytes, b)
    arena: dict[str, int] = {}

    def fits(tmp) -> None:
        import mmap

        size = tmp.stat().st_size
        if size > b.flash:
            raise _PastFlash(size)
        with open(tmp, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            arena["bytes"] = engine.arena_size(mapped)
        if arena["bytes"] > b.arena:
            raise BudgetError(f"the model's arena needs {arena['bytes']:,} B, {b.name}'s runner has {b.arena:,} B: "
                              "weight dtypes do not change it; lower max_batch or max_seq_len")

    while True:
        choices = [options[level[i]] for i, (_, options) in enumerate(units)]
        try:
            result = hf_folder.export_graph(ck, graph, output, dtype="f32", compensation=compensation, keep=(),
                                            int8_act=(), int8_blocks=(), group=group, q8=(), check=True,
                                            on_tensor=on_tensor, page_aligned=False,
                                            dtypes={c.name: c.dtype for c in choices}, finish=fits)
        except _PastFlash as past:
            _undo_one(units, level, past.size, b)
            for _, owner, attr in slots_:  # planned again from f32: the biases the companions took go back
                w = getattr(owner, attr)
                if isinstance(w, hf_folder.PlannedWeight) and w.bias is not None and BIAS_OF.get(attr):
                    setattr(owner, BIAS_OF[attr], w.bias)
                    w.bias = None
            continue
        return Plan(b, choices, graph, b"", arena["bytes"], f32_bytes, path=result.path,
                    image_size=result.bytes_written)
