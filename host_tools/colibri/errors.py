"""Exceptions carrying the engine's status code (see format.Status)."""
from __future__ import annotations

from .format import STATUS_TEXT, Status


class ColibriError(Exception):
    """Base class; `status` is the engine's negative status code."""

    status: Status | None = None

    def __init__(self, message: str | None = None, status: int | None = None):
        if status is not None:
            self.status = Status(status)
        if message is None:
            message = STATUS_TEXT[self.status] if self.status is not None else "colibri error"
        super().__init__(message)


class ImageError(ColibriError):
    """The model image is malformed (bad magic, CRC, table, tensor, layer...)."""


class ArenaError(ColibriError):
    """The arena is too small or misaligned."""


class InputError(ColibriError, ValueError):
    """Wrong batch or buffer size for forward()."""


class UnsupportedError(ColibriError):
    """The image uses a feature this engine build does not have."""


class ExportError(ColibriError):
    """A PyTorch module could not be exported (unsupported layer, bad option)."""


_IMAGE = {
    Status.TRUNCATED, Status.BAD_MAGIC, Status.BAD_VERSION, Status.UNSUPPORTED_VERSION, Status.BAD_HEADER, Status.BAD_CRC,
    Status.TABLE_BOUNDS, Status.TENSOR_BOUNDS, Status.BAD_TENSOR, Status.BAD_REF,
    Status.BAD_LAYER, Status.BAD_MOE, Status.IMAGE_ALIGN,
}


def error_for(status: int, detail: str | None = None) -> ColibriError:
    """The exception instance for an engine status code."""
    st = Status(status)
    if st in _IMAGE:
        cls: type[ColibriError] = ImageError
    elif st in (Status.ARENA_TOO_SMALL, Status.ARENA_ALIGN):
        cls = ArenaError
    elif st in (Status.BAD_BATCH, Status.BUFFER_SIZE):
        cls = InputError
    elif st == Status.UNSUPPORTED:
        cls = UnsupportedError
    else:
        cls = ColibriError
    text = STATUS_TEXT[st] if detail is None else f"{STATUS_TEXT[st]}: {detail}"
    return cls(text, status=st)
