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


class ModelFileError(ColibriError, OSError):
    """A model file could not be opened, mapped or locked, or changed under its mapping
    (the POSIX file layer, firmware/colibri_core/posix/colibri_file.h)."""


class ExportError(ColibriError):
    """A PyTorch module could not be exported (unsupported layer, bad option)."""


class ExportCheckError(ExportError):
    """The exported image does not compute what the PyTorch module computes on `example_input`.

    `comparison` says what was compared with what (e.g. "C engine vs PyTorch
    (f32)"), `error` is the largest |difference| over the outputs both give as
    finite numbers, `tolerance` the bound it had to stay within, and
    `nonfinite_mismatches` the outputs where one side is NaN or ±Inf and the
    other is not (any such output fails the check).
    """

    def __init__(self, comparison: str, error: float, tolerance: float, nonfinite_mismatches: int = 0,
                 hint: str = ""):
        self.comparison, self.error, self.tolerance = comparison, error, tolerance
        self.nonfinite_mismatches = nonfinite_mismatches
        what = f"max |Δ| {error:.3g} > tolerance {tolerance:.3g}" if error > tolerance else \
            f"max |Δ| {error:.3g} (tolerance {tolerance:.3g})"
        if nonfinite_mismatches:
            what += f", {nonfinite_mismatches} outputs NaN/Inf on one side only"
        super().__init__(f"export check failed, {comparison}: {what}{hint}")


_IMAGE = {
    Status.TRUNCATED, Status.BAD_MAGIC, Status.BAD_VERSION, Status.UNSUPPORTED_VERSION, Status.BAD_HEADER, Status.BAD_CRC,
    Status.TABLE_BOUNDS, Status.TENSOR_BOUNDS, Status.BAD_TENSOR, Status.BAD_REF,
    Status.BAD_LAYER, Status.BAD_MOE, Status.IMAGE_ALIGN, Status.BAD_PAYLOAD_CRC, Status.BAD_ATTENTION,
    Status.IMAGE_TOO_LARGE,
    Status.BAD_TOKENIZER,
}
_FILE = {Status.FILE_NOT_FOUND, Status.FILE_OPEN, Status.MMAP_FAILED, Status.MLOCK_FAILED, Status.FILE_CHANGED}


def error_for(status: int, detail: str | None = None) -> ColibriError:
    """The exception instance for an engine status code."""
    st = Status(status)
    if st in _IMAGE:
        cls: type[ColibriError] = ImageError
    elif st in (Status.ARENA_TOO_SMALL, Status.ARENA_ALIGN):
        cls = ArenaError
    elif st in (Status.BAD_BATCH, Status.BUFFER_SIZE, Status.BAD_TOKEN, Status.CACHE_FULL, Status.BAD_SAMPLER,
                Status.NAN_LOGITS, Status.MODEL_KIND):
        cls = InputError
    elif st in (Status.UNSUPPORTED, Status.NO_TOKENIZER):
        cls = UnsupportedError
    elif st in _FILE:
        cls = ModelFileError
    else:
        cls = ColibriError
    text = STATUS_TEXT[st] if detail is None else f"{STATUS_TEXT[st]}: {detail}"
    return cls(text, status=st)


class BuildError(ColibriError):
    """Building firmware (the runner, a native module) failed; `log` holds the tool's whole output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class UserCodeError(ColibriError):
    """The user's own code (a model factory, the module it lives in) raised; the cause is chained."""


class MissingExtraError(ColibriError, ImportError):
    """A feature needs a package an extra of colibri-moe installs (torch for the front ends); the message
    names the pip command. An ImportError too, so code that tries a feature and falls back keeps working."""

    def __init__(self, feature: str, package: str, extra: str):
        super().__init__(f"{feature} needs {package}, which is not installed: pip install 'colibri-moe[{extra}]'")
        self.name = package  # ImportError's: the module that is missing
