"""`colibri.Model`: the C engine from CPython."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import _engine, sources
from .errors import error_for
from .sources import StaleEngineError  # noqa: F401  (raised on import in a checkout whose C changed)

# Tests run through this binding: in a checkout, a binary built from older C sources must not pass them.
sources.check_binding(_engine)


def _call(fn, *args):
    try:
        return fn(*args)
    except _engine.EngineError as exc:
        status, _ = exc.args
        raise error_for(status) from None


class Model:
    """A model image run by the C engine.

    `Model(path_or_bytes)` validates the image and allocates the arena once;
    `forward(x)` maps `[batch, input_size]` float32 to `[batch, output_size]`.
    Batches larger than the image's `max_batch` are run in chunks.

    `reference_kernels=True` runs the reference kernels (the specification,
    the same bits on every target and as `colibri.reference`) instead of the
    build's optimised backend; `kernels` names the ones in use.
    """

    def __init__(self, source: str | os.PathLike | bytes | bytearray | memoryview,
                 reference_kernels: bool = False):
        if isinstance(source, (str, os.PathLike)):
            source = Path(source).read_bytes()
        self.image = bytes(source)
        self._ctx = _call(_engine.Context, self.image, reference_kernels)
        self.kernels: str = self._ctx.kernels()
        info = self._ctx.info()
        self.info: dict[str, int] = info
        self.input_size: int = info["input_size"]
        self.output_size: int = info["output_size"]
        self.max_batch: int = info["max_batch"]
        self.num_experts: int = info["num_experts"]
        self.num_parameters: int = info["num_parameters"]
        self.arena_size: int = info["arena_size"]
        self.image_size: int = info["image_size"]

    def forward(self, x: np.ndarray, on_route: Callable[[int, list[int], list[int]], object] | None = None
                ) -> np.ndarray:
        """Runs the rows of x ([batch, input_size] or one row). on_route, if given, is called for each
        MoE layer after routing and before its experts run (colibri_forward_ex): on_route(layer,
        experts, tokens) with the expert records about to run (routed ones that got tokens, then the
        shared ones) and each one's token count; an exception it raises stops the pass and propagates.
        Batches beyond max_batch run in chunks, each calling on_route again."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        single = x.ndim == 1
        if single:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] != self.input_size:
            raise ValueError(f"input must be [batch, {self.input_size}], got shape {x.shape}")
        out = np.empty((x.shape[0], self.output_size), dtype=np.float32)
        for start in range(0, x.shape[0], self.max_batch):
            chunk = x[start : start + self.max_batch]
            if on_route is None:
                _call(self._ctx.forward, chunk, out[start : start + len(chunk)], len(chunk))
            else:
                _call(self._ctx.forward_ex, chunk, out[start : start + len(chunk)], len(chunk), on_route)
        return out[0] if single else out

    __call__ = forward

    def __repr__(self) -> str:
        return (
            f"colibri.Model(in={self.input_size}, out={self.output_size}, experts={self.num_experts}, "
            f"max_batch={self.max_batch}, image={self.image_size} B, arena={self.arena_size} B)"
        )


def validate(image: bytes | bytearray | memoryview) -> None:
    """Full validation by the C engine; raises the engine's ImageError on failure."""
    status = _engine.validate(image)
    if status != 0:
        raise error_for(status)


def arena_size(image: bytes | bytearray | memoryview) -> int:
    status, size = _engine.model_size(image)
    if status != 0:
        raise error_for(status)
    return size


def version() -> str:
    return _engine.version()
