"""The numpy reference executor: what the C engine computes, op for op (layers, MoE routing, token
models, sampling), as the oracle the engine, the MicroPython module and the boards are tested against."""
from .executor import (
    LMState, Rng, activation, apply_rope, attention_forward, check_sampler, embedding_rows, engine_expf,
    expert_forward, f32, moe_forward, quantize_rows, rope_tables, route, run, sample,
)

__all__ = [
    "LMState", "Rng", "activation", "apply_rope", "attention_forward", "check_sampler", "embedding_rows",
    "engine_expf", "expert_forward", "f32", "moe_forward", "quantize_rows", "rope_tables", "route", "run", "sample",
]
