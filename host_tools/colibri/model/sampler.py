"""The sampler's contract: the temperature, top-k and top-p settings colibri_lm_sample accepts.
Both the engine's LM and the reference's LMState check them here first, with the same status."""
from __future__ import annotations

import operator

import numpy as np

from .errors import error_for
from .format import Status


def integer_arg(name: str, value) -> int:
    """value as an int, refusing what Python's own integer parameters refuse (a float such as 2.7 or
    1.0, a string): TypeError, never a silent truncation."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def check_sampler(temperature: float, top_k: int, top_p: float) -> None:
    """BAD_SAMPLER for settings colibri_lm_sample refuses; TypeError for a top_k that is not an integer."""
    top_k = integer_arg("top_k", top_k)
    t, p = np.float32(temperature), np.float32(top_p)
    if not (np.isfinite(t) and t >= 0):
        raise error_for(Status.BAD_SAMPLER, f"temperature {temperature} (0 for greedy, or finite > 0)")
    if not 0 <= int(top_k) <= 0xFFFFFFFF:
        raise error_for(Status.BAD_SAMPLER, f"top_k {top_k} (0 for no limit, or up to 2^32-1)")
    if not (p > 0 and p <= 1):
        raise error_for(Status.BAD_SAMPLER, f"top_p {top_p} (in (0, 1])")
