"""Running the C test drivers of tests/c on images: colibri_check's statuses, field by field."""
from __future__ import annotations

import struct
import subprocess
from pathlib import Path

END = 0xFFFFFFFF  # colibri_check's end-of-stream length


def check(drivers: Path, images: list[bytes]) -> list[dict[str, str]]:
    """Runs colibri_check over a batch of images; one dict of fields per image."""
    stream = b"".join(struct.pack("<I", len(b)) + b for b in images) + struct.pack("<I", END)
    r = subprocess.run([str(drivers / "colibri_check")], input=stream, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    lines = r.stdout.decode().splitlines()
    assert len(lines) == len(images), r.stderr.decode()[-3000:]
    return [dict(f.split("=", 1) for f in line.split()) for line in lines]


def status(fields: dict[str, str], key: str = "validate") -> int:
    return int(fields[key].split(":")[0])
