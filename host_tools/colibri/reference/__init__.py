"""The numpy reference executor: what the C engine computes, op for op (layers, MoE routing, token
models, sampling), as the oracle the engine, the MicroPython module and the boards are tested against.
It runs a colibri.model.ir.Graph: colibri.image.read(data) gives an image's. Layer: imports colibri.model only."""
from ..model.sampler import check_sampler, integer_arg
from .executor import (
    LMState, Rng, activation, apply_rope, attention_forward, embedding_rows, engine_expf, expert_forward, f32, linear,
    moe_forward, quantize_blocks, quantize_rows, rope_tables, route, run, sample,
)

__all__ = [
    "LMState", "Rng", "activation", "apply_rope", "attention_forward", "check_sampler", "embedding_rows",
    "engine_expf", "expert_forward", "f32", "integer_arg", "linear", "moe_forward", "quantize_blocks", "quantize_rows", "rope_tables", "route", "run",
    "sample",
]
