"""The layer graph: what the exporter produces, the image holds and the reference runs.

Weights are shaped as in the image: matrices `[out_features, in_features]`,
vectors `[n]`. Vectors are float32 arrays; weight matrices are float32
arrays, or `F16Weight` / `Q8Weight` after `colibri.quant.quantize`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .format import Act, DType, ExpertKind, Routing


@dataclass
class F16Weight:
    """IEEE half storage; computed in f32."""

    data: np.ndarray  # float16 [rows, cols]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape


@dataclass
class Q8Weight:
    """W ≈ Q·S + E: int8 per output channel plus a sparse f16 compensation term (CSR).

    `scale` (and `bias`, when the layer's bias travels with its scales, format v2) are
    float32 or float16 arrays, both of one dtype; y = (Q·x)·s + E·x + bias."""

    q: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 or float16 [rows]
    row_ptr: np.ndarray  # unsigned [rows + 1]
    col: np.ndarray  # uint16 [nnz], increasing within a row
    val: np.ndarray  # float16 [nnz]
    bias: np.ndarray | None = None  # [rows], the dtype of scale, or None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nnz(self) -> int:
        return int(self.col.size)

    def compensation(self) -> np.ndarray:
        """E as a dense float32 [rows, cols] matrix."""
        e = np.zeros(self.q.shape, dtype=np.float32)
        rows = np.repeat(np.arange(self.q.shape[0]), np.diff(self.row_ptr.astype(np.int64)))
        e[rows, self.col.astype(np.int64)] = self.val.astype(np.float32)
        return e


@dataclass
class Q4Weight:
    """W ≈ Q·S + E with Q signed int4 (-8..7) and one f16 scale per `group` columns of a row
    (format v5, docs/model-format.md "Quantised weights: I4 with Q4_PARAMS").

    `q` holds the int4 values unpacked, one per int8 (the image packs two per byte); `scale` is
    float16 [rows, G] with G = ceil(cols / group); `bias` (f16 [rows]) is the layer's bias when it
    travels in the companion; E is a CSR term exactly as Q8Weight's.
    y = Σ_g (Σ_{c in g} q·x)·s_g + E·x + bias."""

    q: np.ndarray  # int8 [rows, cols], each in -8..7
    scale: np.ndarray  # float16 [rows, G]
    group: int  # columns per scale: a power of two, 8..256
    row_ptr: np.ndarray  # unsigned [rows + 1]
    col: np.ndarray  # uint16 [nnz], increasing within a row
    val: np.ndarray  # float16 [nnz]
    bias: np.ndarray | None = None  # float16 [rows] or None
    # The image's packed nibbles [rows, ceil(cols/2)] (a view) when read from an image: where the
    # engine's kernels and an expert hook see this weight.
    packed: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nnz(self) -> int:
        return int(self.col.size)

    @property
    def group_log2(self) -> int:
        return int(self.group).bit_length() - 1

    @property
    def groups(self) -> int:
        return -(-self.q.shape[1] // self.group)

    def scale_per_column(self) -> np.ndarray:
        """The scale of every weight, float32 [rows, cols] (each group's scale repeated)."""
        return np.repeat(self.scale.astype(np.float32), self.group, axis=1)[:, : self.q.shape[1]]

    def compensation(self) -> np.ndarray:
        """E as a dense float32 [rows, cols] matrix."""
        e = np.zeros(self.q.shape, dtype=np.float32)
        rows = np.repeat(np.arange(self.q.shape[0]), np.diff(self.row_ptr.astype(np.int64)))
        e[rows, self.col.astype(np.int64)] = self.val.astype(np.float32)
        return e


Weight = np.ndarray | F16Weight | Q8Weight | Q4Weight
QuantWeight = (Q8Weight, Q4Weight)  # the integer weights: a companion, INT8_ACT allowed


def dense(w: Weight) -> np.ndarray:
    """The float32 matrix a weight stands for (Q·S + E for int8 and int4)."""
    if isinstance(w, F16Weight):
        return w.data.astype(np.float32)
    if isinstance(w, Q4Weight):
        return (w.q.astype(np.float32) * w.scale_per_column() + w.compensation()).astype(np.float32)
    if isinstance(w, Q8Weight):
        return (w.q.astype(np.float32) * w.scale.astype(np.float32)[:, None] + w.compensation()).astype(np.float32)
    return w


@dataclass
class Linear:
    weight: Weight  # [out, in]
    bias: np.ndarray | None = None  # [out]
    int8_act: bool = False  # int8 activations (I8 weight only)
    int8_blocks: bool = False  # int8 activations with a scale per 32 columns (I8 or I4 weight; not with int8_act)

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
    w1: Weight  # [hidden, d]
    w2: Weight  # [d, hidden]
    b1: np.ndarray | None = None  # [hidden]
    b2: np.ndarray | None = None  # [d]
    w3: Weight | None = None  # [hidden, d], GLU only
    b3: np.ndarray | None = None  # [hidden], GLU only
    int8_act: bool = False  # int8 activations (all weights I8 only)
    int8_blocks: bool = False  # int8 activations with a scale per 32 columns (not with int8_act)

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
    router_weight: Weight  # [R, d]
    experts: list[Expert]  # N kept routed experts
    expert_map: np.ndarray  # [R] int32
    router_bias: np.ndarray | None = None  # [R]
    renormalize: bool = False
    shared: list[Expert] = field(default_factory=list)
    shared_gate: Weight | None = None  # [1, d]

    @property
    def d_model(self) -> int:
        return int(self.router_weight.shape[1])

    @property
    def route_count(self) -> int:
        return int(self.router_weight.shape[0])


@dataclass
class Embedding:
    """Token ids -> rows of `table [vocab, d_model]` (layer 0 of a token model, docs/lm.md).

    A tied LM head is the final Linear whose `weight` is this very `table` object."""

    table: Weight  # [vocab, d_model]

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.table.shape[1])


@dataclass
class Attention:
    """Causal self-attention with rotary positions and a KV cache (docs/lm.md "Attention record").

    Projections are `[out, in]` like Linear weights; `q_norm` / `k_norm` are RMSNorm weights over
    each head (`[head_dim]`) or over the whole projection (`[n_heads·head_dim]`, `[n_kv_heads·head_dim]`)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_w: Weight  # [H·hd, d]
    k_w: Weight  # [KVH·hd, d]
    v_w: Weight  # [KVH·hd, d]
    o_w: Weight  # [d, H·hd]
    rope_theta: float
    max_seq_len: int
    q_b: np.ndarray | None = None
    k_b: np.ndarray | None = None
    v_b: np.ndarray | None = None
    o_b: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    qk_norm_eps: float = 0.0  # > 0 with a norm, 0 without
    kv_dtype: DType = DType.F32
    int8_blocks: bool = False  # q, k, v and o with int8 activations, a scale per 32 columns (all I8 or I4)

    @property
    def d_model(self) -> int:
        return int(self.o_w.shape[0])

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim


Layer = Linear | Activation | LayerNorm | RMSNorm | ResidualPush | ResidualAdd | MoE | Embedding | Attention


@dataclass
class Graph:
    layers: list[Layer]
    input_size: int
    output_size: int
    max_batch: int = 1
    # The module path each layer came from (`model.2.body.0`), parallel to `layers`,
    # so errors found after conversion can still name the module; empty for graphs
    # read back from an image.
    paths: list[str] = field(default_factory=list)
    # A token model's tokenizer section (format v6, docs/lm.md "Tokenizer section"), packed:
    # written as the image's TOKENIZER tensor; None for an image without one.
    tokenizer: bytes | None = None

    def where(self, index: int) -> str:
        """`model.2.body.0 (layers.5)`, or just `layers.5` without a recorded path."""
        name = f"layers.{index}"
        return f"{self.paths[index]} ({name})" if index < len(self.paths) else name

    def moe_layers(self) -> list[MoE]:
        return [layer for layer in self.layers if isinstance(layer, MoE)]

    @property
    def is_token_model(self) -> bool:
        """Token ids in, logits out: layer 0 is an Embedding (docs/lm.md)."""
        return bool(self.layers) and isinstance(self.layers[0], Embedding)

    @property
    def vocab_size(self) -> int:
        """The embedding table's rows; 0 for a feature model."""
        return self.layers[0].vocab_size if self.is_token_model else 0

    @property
    def max_seq_len(self) -> int:
        """Positions the KV cache holds (every attention layer has the same); 0 without attention."""
        return max((layer.max_seq_len for layer in self.layers if isinstance(layer, Attention)), default=0)

    def attention_layers(self) -> list[Attention]:
        return [layer for layer in self.layers if isinstance(layer, Attention)]
