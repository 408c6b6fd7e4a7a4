"""Write a model image to a file one payload at a time (`colibri export DIR`, issue 26).

The image is laid out by the same `writer.layout` as `write`, so the file is byte for byte the
image `write` would build for the same graph. Version 3 and later put every CRC where streaming
needs it: each payload has its own CRC-32 (computed as the payload is written), and the header
CRC covers only the metadata (header, tables, CRC table), which is packed last and written over
the zeros reserved for it at the file's start. So only one payload at a time is in memory.

The file is a temporary one beside the target, renamed over it when complete: a failure at any
tensor leaves nothing at the target path.

Past 4 GiB the image is format version 7 (64-bit sizes and offsets), exactly as `write` decides:
when the records alone show the image cannot fit 32 bits the file is laid out as version 7 from
the start; when only the payloads made on the way show it (the companions' sizes follow from the
quantiser), the narrow file is dropped and the image written again as version 7.
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
from ..model.ir import Graph
from . import writer
from .writer import least_size  # noqa: F401  (the streamed writer's bound; tests name it here)

@dataclass
class StreamReport:
    path: Path
    bytes_written: int
    tensors: int
    version: int


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4  # as `write` ends an image


class _PastNarrow(Exception):
    """The narrow layout's payloads passed writer.NARROW_LIMIT: write the image again as version 7."""


def layout(graph: Graph, *, version: int | None = None, where: str = "the image",
           page_aligned: bool | None = None) -> writer.Layout:
    """The streamed image's layout before a payload is made: version 7 when its records alone show it
    passes 4 GiB (writer.NARROW_LIMIT), else `writer.layout`'s choice or `version`. `page_aligned` puts
    each expert on pages of its own; None: once the compact image would be at least
    writer.LINUX_LAYOUT_MIN_BYTES (the records alone say it, no payload is made twice)."""
    plan = writer.layout(graph, version=version)
    if page_aligned is None:
        page_aligned = least_size(plan) >= writer.LINUX_LAYOUT_MIN_BYTES and any(e.page for e in plan.tensors.entries)
    if page_aligned:
        plan = writer.layout(graph, version=version, page_aligned=True)
    if not plan.tensor_crc:
        raise ValueError("streaming needs per-tensor CRCs (format version 3 or later); this graph's image "
                         f"is version {plan.version}")
    least = least_size(plan)
    if plan.version < F.WIDE_VERSION and least > writer.NARROW_LIMIT:
        if version is not None:
            raise ExportError(f"{where}: the image would be at least {least / 2**30:.2f} GiB, past format version "
                              f"{version}'s 32-bit sizes and offsets (version {F.WIDE_VERSION} holds it); "
                              "nothing written")
        plan.widen()
    return plan


def write_file(graph: Graph, path: str | Path, *, on_tensor: Callable[[int, int, int], None] | None = None,
               finish: Callable[[Path], None] | None = None, version: int | None = None,
               page_aligned: bool | None = None) -> StreamReport:
    """Write `graph`'s image to `path`, making each payload (its `image_entries` thunk) only when its
    turn comes. `on_tensor(index, count, nbytes)` after each payload (a progress bar). `finish(tmp)`
    runs on the complete temporary file before the rename (a validation); raising there, or anywhere,
    leaves no file at `path`. Images with per-tensor CRCs only (format v3 on: token models). The
    version is `write`'s choice (7 past 4 GiB) unless `version` asks for one; `page_aligned` as `layout`'s."""
    path = Path(path)
    plan = layout(graph, version=version, where=str(path), page_aligned=page_aligned)
    try:
        return _write(plan, path, on_tensor, finish)
    except _PastNarrow:
        if version is not None:
            raise ExportError(f"{path}: the image passes 4 GiB, past format version {version}'s 32-bit sizes and "
                              "offsets; nothing written") from None
    # fresh payload thunks: the first ones are spent
    plan = writer.layout(graph, version=F.WIDE_VERSION, page_aligned=plan.page_aligned)
    return _write(plan, path, on_tensor, finish)


def _write(plan: writer.Layout, path: Path, on_tensor: Callable[[int, int, int], None] | None,
           finish: Callable[[Path], None] | None) -> StreamReport:
    narrow = plan.version < F.WIDE_VERSION
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
                if narrow and _align4(start + len(data)) > writer.NARROW_LIMIT:
                    raise _PastNarrow
                f.write(bytes(start - pos))
                f.write(data)
                placed.append((start, len(data)))
                crcs.append(zlib.crc32(data) & 0xFFFFFFFF)
                pos = start + len(data)
                entry.payload = b""  # written: let it go
                if on_tensor is not None:
                    on_tensor(i, count, len(data))
                del data
            image_size = _align4(pos)
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
