"""The layer graph: what the exporter produces, the image holds and the reference runs.

Weights are float32 numpy arrays shaped as in the image: matrices
`[out_features, in_features]`, vectors `[n]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .format import Act, ExpertKind, Routing


@dataclass
class Linear:
    weight: np.ndarray  # [out, in]
    bias: np.ndarray | None = None  # [out]

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


@dataclass
class Activation:
    act: Act


@dataclass
class LayerNorm:
    size: int
    eps: float
    weight: np.ndarray | None = None  # [size]
    bias: np.ndarray | None = None  # [size]


@dataclass
class RMSNorm:
    size: int
    eps: float
    weight: np.ndarray | None = None  # [size]


@dataclass
class ResidualPush:
    """Saves the current activation; the matching ResidualAdd adds it back."""


@dataclass
class ResidualAdd:
    pass


@dataclass
class Expert:
    kind: ExpertKind
    act: Act
    w1: np.ndarray  # [hidden, d]
    w2: np.ndarray  # [d, hidden]
    b1: np.ndarray | None = None  # [hidden]
    b2: np.ndarray | None = None  # [d]
    w3: np.ndarray | None = None  # [hidden, d], GLU only
    b3: np.ndarray | None = None  # [hidden], GLU only

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[0])


@dataclass
class MoE:
    """Routed experts (after pruning) plus shared experts.

    `expert_map[r]` is the routed-expert slot of router output r, or -1 where
    that expert was pruned at export.
    """

    routing: Routing
    top_k: int
    router_weight: np.ndarray  # [R, d]
    experts: list[Expert]  # N kept routed experts
    expert_map: np.ndarray  # [R] int32
    router_bias: np.ndarray | None = None  # [R]
    renormalize: bool = False
    shared: list[Expert] = field(default_factory=list)
    shared_gate: np.ndarray | None = None  # [1, d]

    @property
    def d_model(self) -> int:
        return int(self.router_weight.shape[1])

    @property
    def route_count(self) -> int:
        return int(self.router_weight.shape[0])


Layer = Linear | Activation | LayerNorm | RMSNorm | ResidualPush | ResidualAdd | MoE


@dataclass
class Graph:
    layers: list[Layer]
    input_size: int
    output_size: int
    max_batch: int = 1

    def moe_layers(self) -> list[MoE]:
        return [layer for layer in self.layers if isinstance(layer, MoE)]
