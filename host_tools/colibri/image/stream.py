"""Write a model image to a file one payload at a time (`colibri export DIR`, issue 26).

The image is laid out by the same `writer.layout` as `write`, so the file is byte for byte the
image `write` would build for the same graph. Version 3 and later put every CRC where streaming
needs it: each payload has its own CRC-32 (computed as the payload is written), and the header
CRC covers only the metadata (header, tables, CRC table), which is packed last and written over
the zeros reserved for it at the file's start. So only one payload at a time is in memory.

The file is a temporary one beside the target, renamed over it when complete: a failure at any
tensor leaves nothing at the target path.
"""
from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..model import format as F
from ..model.errors import ExportError
from ..model.format import DType
from ..model.ir import Graph
from . import writer

LIMIT_32 = 0xFFFFFFFF  # image_size and every offset are u32 (docs/model-format.md "Header")

# Bytes per element of the payloads whose size the records alone give.
_FIXED = {DType.F32: 4, DType.F16: 2, DType.I8: 1, DType.I32: 4}


@dataclass
class StreamReport:
    path: Path
    bytes_written: int
    tensors: int
    version: int


def least_size(plan: writer.Layout) -> int:
    """A lower bound of the image's size from its records alone (companions at their smallest:
    header and scales), so an image past the 32-bit limits is refused before a byte is written."""
    pos = plan.payload_start
    for t in plan.tensors.entries:
        if t.dtype in _FIXED:
            size = t.rows * t.cols * _FIXED[t.dtype]
        elif t.dtype == DType.I4:
            size = t.rows * F.q4_row_bytes(t.cols)
        elif t.dtype == DType.TOKENIZER:
            size = t.rows
        elif t.dtype == DType.Q8_PARAMS:
            size = F.Q8_PARAMS_HEADER + 2 * t.rows
        else:  # Q4_PARAMS: at least one f16 scale a row
            size = F.Q4_PARAMS_HEADER + 2 * t.rows
        pos = plan.place(pos, t) + size
    return pos


def write_file(graph: Graph, path: str | Path, *, on_tensor: Callable[[int, int, int], None] | None = None,
               finish: Callable[[Path], None] | None = None, page_aligned: bool | None = None) -> StreamReport:
    """Write `graph`'s image to `path`, making each payload (its `image_entries` thunk) only when its
    turn comes. `on_tensor(index, count, nbytes)` after each payload (a progress bar). `finish(tmp)`
    runs on the complete temporary file before the rename (a validation); raising there, or anywhere,
    leaves no file at `path`. Token models only (format v4/v5: per-tensor CRCs). `page_aligned` puts each
    expert on pages of its own; None: once the compact image would be at least
    writer.LINUX_LAYOUT_MIN_BYTES (the records alone say it, no payload is made twice)."""
    path = Path(path)
    plan = writer.layout(graph)
    if page_aligned is None:
        page_aligned = least_size(plan) >= writer.LINUX_LAYOUT_MIN_BYTES and any(e.page for e in plan.tensors.entries)
    if page_aligned:
        plan = writer.layout(graph, page_aligned=True)
    if not plan.tensor_crc:
        raise ValueError("streaming needs per-tensor CRCs (format version 3 or later); this graph's image "
                         f"is version {plan.version}")
    least = least_size(plan)
    if least > LIMIT_32:
        raise ExportError(f"{path}: the image would be at least {least / 2**30:.2f} GiB, past the format's 32-bit "
                          f"sizes and offsets (4 GiB): choose a smaller dtype (q8, q4); nothing written")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(plan.payload_start))  # the metadata's place, filled in last
            pos = plan.payload_start
            placed: list[tuple[int, int]] = []
            crcs: list[int] = []
            count = len(plan.tensors.entries)
            for i, entry in enumerate(plan.tensors.entries):
                data = entry.payload() if callable(entry.payload) else entry.payload
                start = plan.place(pos, entry)
                if start + len(data) > LIMIT_32:
                    raise ExportError(f"{path}: the image passes 4 GiB at tensor {i} of {count}, past the format's "
                                      "32-bit sizes and offsets: choose a smaller dtype (q8, q4); nothing written")
                f.write(bytes(start - pos))
                f.write(data)
                placed.append((start, len(data)))
                crcs.append(zlib.crc32(data) & 0xFFFFFFFF)
                pos = start + len(data)
                entry.payload = b""  # written: let it go
                if on_tensor is not None:
                    on_tensor(i, count, len(data))
                del data
            image_size = (pos + 3) // 4 * 4  # as `write` ends an image
            f.write(bytes(image_size - pos))
            f.seek(0)
            f.write(plan.metadata(placed, crcs, image_size))
            f.flush()
            os.fsync(f.fileno())
        if finish is not None:
            finish(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return StreamReport(path=path, bytes_written=image_size, tensors=len(placed), version=plan.version)
