"""The benches' cached Colibri images, remade when what made them has changed.

A cached image is reused only if its stamp (a file beside it) names the same export settings and
the same exporter: a hash of the Python sources that decide an image's bytes (the quantiser, the
front ends, the checkpoint readers, the image writer, the model format). An image from an older
checkout, or made with other settings, is exported again rather than measured as if it were new."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORTER = [ROOT / "host_tools" / "colibri" / part for part in ("quant", "frontends", "checkpoints", "image", "model")]


def exporter_hash() -> str:
    digest = hashlib.sha256()
    for folder in EXPORTER:
        for source in sorted(folder.rglob("*.py")):
            digest.update(source.relative_to(ROOT).as_posix().encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _stamp_path(image: Path) -> Path:
    return image.with_name(image.name + ".stamp")


def _stamp(settings: dict) -> str:
    return json.dumps({"exporter": exporter_hash(), "settings": settings}, sort_keys=True, default=str)


def is_fresh(image: Path, settings: dict) -> bool:
    """Whether `image` exists and was exported with `settings` by this checkout's exporter."""
    stamp = _stamp_path(image)
    return image.exists() and stamp.exists() and stamp.read_text() == _stamp(settings)


def mark_fresh(image: Path, settings: dict) -> None:
    """Records that `image` was just exported with `settings`."""
    _stamp_path(image).write_text(_stamp(settings))
