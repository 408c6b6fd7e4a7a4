"""Walks over a layer graph: its weight matrices by name, the bias of each, the matrices that feed a
router. The writer, the quantiser, the report and the board budget all name weights this way:
`layers.3` for a Linear, `layers.5.router`, `layers.5.shared_gate`, `layers.5.experts.2.w1`,
`layers.5.shared.0.w3`, `layers.1.q` for an attention block's query projection.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence

from .ir import Attention, Embedding, Expert, Graph, Linear, MoE


def weight_slots(graph: Graph) -> Iterator[tuple[str, object, str]]:
    """(name, owner, attribute) of every weight matrix in the graph."""
    for i, layer in enumerate(graph.layers):
        if isinstance(layer, Linear):
            yield f"layers.{i}", layer, "weight"
        elif isinstance(layer, Embedding):
            yield f"layers.{i}", layer, "table"
        elif isinstance(layer, Attention):
            for attr in ("q_w", "k_w", "v_w", "o_w"):
                yield f"layers.{i}.{attr[0]}", layer, attr
        elif isinstance(layer, MoE):
            yield f"layers.{i}.router", layer, "router_weight"
            if layer.shared_gate is not None:
                yield f"layers.{i}.shared_gate", layer, "shared_gate"
            for group, experts in (("experts", layer.experts), ("shared", layer.shared)):
                for j, e in enumerate(experts):
                    for attr in ("w1", "w2", "w3"):
                        if getattr(e, attr) is not None:
                            yield f"layers.{i}.{group}.{j}.{attr}", e, attr


# The bias that goes with each weight matrix (compact q8 moves it into the weight's Q8_PARAMS).
BIAS_OF = {"weight": "bias", "router_weight": "router_bias", "w1": "b1", "w2": "b2", "w3": "b3",
            "q_w": "q_b", "k_w": "k_b", "v_w": "v_b", "o_w": "o_b"}  # an embedding table has none


def router_feeders(graph: Graph) -> list[str]:
    """The weight matrices that write what a router reads: per MoE layer, the nearest weight-bearing layer
    before it (its weight, an attention block's output projection, or a MoE's expert and shared w2),
    past the norms and residual bookkeeping in between. Their rounding error moves router logits as much
    as the router's own would: near-tied expert scores swap (a routing flip)."""
    names: list[str] = []
    for i, layer in enumerate(graph.layers):
        if not isinstance(layer, MoE):
            continue
        for j in range(i - 1, -1, -1):
            before = graph.layers[j]
            if isinstance(before, Linear):
                names.append(f"layers.{j}")
            elif isinstance(before, Attention):
                names.append(f"layers.{j}.o")
            elif isinstance(before, MoE):
                names += [f"layers.{j}.{group}.{k}.w2" for group, experts in (("experts", before.experts),
                          ("shared", before.shared)) for k in range(len(experts))]
            else:
                continue
            break
    return names


def name_matches(name: str, patterns: Sequence[str]) -> bool:
    """`name` matches an fnmatch pattern, or a pattern names a module it belongs to (`layers.5` matches
    `layers.5.experts.2.w1`)."""
    return any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


def act_targets(graph: Graph) -> Iterator[tuple[str, Linear | Expert | Attention]]:
    """(name, layer, expert or attention block) that int8_act / int8_blocks patterns choose among: `layers.N`
    for a Linear or an Attention (its four projections together), `layers.N.experts.E` and `layers.N.shared.S`
    inside a MoE."""
    for i, layer in enumerate(graph.layers):
        if isinstance(layer, (Linear, Attention)):
            yield f"layers.{i}", layer
        elif isinstance(layer, MoE):
            for group, experts in (("experts", layer.experts), ("shared", layer.shared)):
                for j, e in enumerate(experts):
                    yield f"layers.{i}.{group}.{j}", e


def act_weights(target: Linear | Expert | Attention) -> list:
    """The weight matrices an activation flag on `target` runs: all of them must be int8 or int4."""
    if isinstance(target, Linear):
        return [target.weight]
    if isinstance(target, Attention):
        return [target.q_w, target.k_w, target.v_w, target.o_w]
    return [w for w in (target.w1, target.w2, target.w3) if w is not None]


def act_forms(graph: Graph, int8_act: Sequence[str],
              int8_blocks: Sequence[str]) -> Iterator[tuple[str, Linear | Expert | Attention, bool, bool]]:
    """(name, target, int8_act, int8_blocks) for each target a pattern chooses. An attention block has only
    the block form (docs/model-format.md "INT8_BLOCKS"), so int8_act patterns pass over it: `layers.*`
    keeps meaning the linear layers and experts there. Both forms on one target is an ExportError."""
    from .errors import ExportError

    for name, target in act_targets(graph):
        rows = not isinstance(target, Attention) and name_matches(name, int8_act)
        blocks = name_matches(name, int8_blocks)
        if rows and blocks:
            raise ExportError(f"{name}: int8_act and int8_blocks both match it; choose one activation form")
        if rows or blocks:
            yield name, target, rows, blocks


def where(graph: Graph, name: str) -> str:
    """`model.3.experts (layers.5.experts.2.w1)`: the module path too when the graph records it."""
    index = int(name.split(".")[1])
    return f"{graph.paths[index]} ({name})" if index < len(graph.paths) else name
