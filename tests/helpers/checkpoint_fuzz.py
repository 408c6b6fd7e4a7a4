"""Mutated checkpoint files for the GGUF and safetensors readers' error paths (issue 26): what
tests/export/test_export_checkpoint_fuzz.py runs, a few thousand cases in CI and as many as asked by
`make fuzz-checkpoints`.

A case is a seed file (or folder) with one mutation: cut short, bits flipped in the header, a
length, count, type, dimension or offset field overwritten with an extreme value (the GGUF fields
located through gguf.GGUFReader, the safetensors ones through the header's JSON), a JSON value
replaced, or bytes of the tensor data changed. Its export must end in a written image or in a
ColibriError of one line, with nothing left at the output path either way but the image."""
from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from colibri.checkpoints import gguf_file, hf_folder
from colibri.model.errors import ColibriError

# Field values: small ones, array lengths a reader could loop over (past the end of the file, or past
# what memory holds), and the edges of 32 and 64 bits.
EXTREMES = (0, 1, 2, 3, 31, 32, 255, 2**16, 10**5 + 3, 10**7, 2**30 - 5, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
            2**63 - 1, 2**63, 2**64 - 1)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (mutation, "written" | "refused")
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        written = sum(n for (_, o), n in self.outcomes.items() if o == "written")
        refused = sum(n for (_, o), n in self.outcomes.items() if o == "refused")
        kinds = ", ".join(f"{m} {o} {n}" for (m, o), n in sorted(self.outcomes.items()))
        return [f"{written + refused + len(self.failures)} cases: {written} written, {refused} refused, "
                f"{len(self.failures)} failures ({kinds})", *self.failures[:20]]


def export_outcome(export, source: Path, out: Path) -> str:
    """'written' or 'refused'; anything else (another exception, a multi-line error, a file left
    behind) raises AssertionError naming it."""
    try:
        export(source, out)
    except ColibriError as exc:
        if "\n" in str(exc):
            raise AssertionError(f"a multi-line error: {exc!r}") from None
        left = list(out.parent.iterdir()) if out.parent.exists() else []
        if left:
            raise AssertionError(f"refused ({exc}) but left {[p.name for p in left]}") from None
        return "refused"
    except Exception as exc:  # noqa: BLE001  what the fuzzer is for
        raise AssertionError(f"raw {type(exc).__name__}: {exc}") from exc
    left = sorted(p.name for p in out.parent.iterdir())
    if left != [out.name]:
        raise AssertionError(f"written, but the folder holds {left}")
    out.unlink()
    return "written"


# ---------------------------------------------------------------------------
# GGUF


def gguf_fields(path: Path) -> tuple[list[tuple[int, int]], list[int], int]:
    """Where a GGUF file's numeric header fields are ((offset, width) of every length, count, type,
    dimension and tensor offset, as the gguf package located them), where its tensor-offset fields
    are, and where the tensor data starts."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    spots: list[tuple[int, int]] = []
    offsets: list[int] = []
    for f in reader.fields.values():
        for part in f.parts:
            if part.dtype != np.uint8 and part.nbytes <= 8:
                spots.append((part.ctypes.data - base, part.nbytes))
    for t in reader.tensors:
        for part in t.field.parts[2:]:
            spots.append((part.ctypes.data - base, part.itemsize))
        offsets.append(t.field.parts[5].ctypes.data - base)
    return spots, offsets, int(reader.data_offset)


def mutate_gguf(seed: bytes, spots, offsets, data_start: int, rng: random.Random) -> tuple[str, bytes]:
    b = bytearray(seed)
    kind = rng.choices(["cut", "flip", "field", "offset", "word", "data"], weights=[20, 25, 25, 10, 15, 5])[0]
    if kind == "cut":
        b = b[: rng.randrange(data_start + 64) if rng.random() < 0.8 else rng.randrange(len(b))]
    elif kind == "flip":
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(data_start)] ^= 1 << rng.randrange(8)
    elif kind == "field":
        at, width = rng.choice(spots)
        near = int.from_bytes(b[at : at + width], "little") + rng.choice((-1, 1))
        value = rng.choice(EXTREMES) if rng.random() < 0.7 else near
        b[at : at + width] = (value % (1 << 8 * width)).to_bytes(width, "little")
    elif kind == "offset":
        at, there = rng.choice(offsets), rng.choice(offsets)
        other = int.from_bytes(seed[there : there + 8], "little")  # another tensor's data: overlapping tensors
        value = rng.choice([other, other + 32, rng.choice(EXTREMES), len(seed) - data_start, 16])
        b[at : at + 8] = (value % 2**64).to_bytes(8, "little")
    elif kind == "word":
        at = rng.randrange(data_start - 8)
        b[at : at + 8] = rng.choice(EXTREMES).to_bytes(8, "little")
    else:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(data_start, len(b))] = rng.randrange(256)
    return kind, bytes(b)


def fuzz_gguf(seeds: list[Path], work: Path, cases: int, rng: random.Random, tally: Tally) -> None:
    layouts = [(s.read_bytes(), *gguf_fields(s)) for s in seeds]
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "case.gguf", work / "out" / "m.clb"

    def export(path: Path, target: Path) -> None:
        gguf_file.export_gguf(path, target, max_seq_len=8)

    for _ in range(cases):
        seed, spots, offsets, data_start = rng.choice(layouts)
        kind, data = mutate_gguf(seed, spots, offsets, data_start, rng)
        src.write_bytes(data)
        try:
            tally.outcomes[kind, export_outcome(export, src, out)] += 1
        except AssertionError as exc:
            tally.failures.append(f"gguf {kind}: {exc}")
            _keep(src, work, len(tally.failures))
        shutil.rmtree(out.parent, ignore_errors=True)


# ---------------------------------------------------------------------------
# safetensors folders


def _header_end(shard: bytes) -> int:
    return 8 + int.from_bytes(shard[:8], "little") if len(shard) >= 8 else len(shard)


def _json_edit(doc: object, rng: random.Random) -> object:
    """One value somewhere in a JSON document replaced by one of the wrong kind or size."""
    wrong = [None, -1, 0, 1, 2**40, -(2**40), 1.5, "x", "F64", "I8", True, [], [0], [0, 2**50], [7, 3], {"a": 1}]
    if isinstance(doc, dict) and doc:
        key = rng.choice(list(doc))
        if isinstance(doc[key], (dict, list)) and doc[key] and rng.random() < 0.7:
            doc[key] = _json_edit(doc[key], rng)
        elif rng.random() < 0.1:
            del doc[key]
        else:
            doc[key] = rng.choice(wrong)
    elif isinstance(doc, list) and doc:
        i = rng.randrange(len(doc))
        doc[i] = _json_edit(doc[i], rng) if isinstance(doc[i], (dict, list)) else rng.choice(wrong)
    return doc


def mutate_folder(folder: Path, rng: random.Random) -> str:
    files = sorted(folder.glob("*.safetensors")) + [folder / "config.json"] + sorted(folder.glob("*.index.json"))
    target = rng.choice(files)
    b = bytearray(target.read_bytes())
    shard = target.suffix == ".safetensors"
    end = _header_end(b) if shard else len(b)
    kind = rng.choices(["cut", "flip", "length", "json", "data"], weights=[20, 25, 10, 40, 5] if shard
                       else [10, 10, 0, 80, 0])[0]
    if kind == "cut":
        b = b[: rng.randrange(end + 64 if rng.random() < 0.8 else len(b))]
    elif kind == "flip":
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(end)] ^= 1 << rng.randrange(8)
    elif kind == "length":
        b[:8] = rng.choice(EXTREMES + (end - 9, end - 7, end + 1)).to_bytes(8, "little", signed=False)
    elif kind == "json":
        start = 8 if shard else 0
        doc = _json_edit(json.loads(bytes(b[start:end])), rng)
        text = json.dumps(doc).encode()
        b = bytearray(len(text).to_bytes(8, "little") + text + b[end:]) if shard else bytearray(text)
    else:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(end, len(b))] = rng.randrange(256)
    target.write_bytes(bytes(b))
    return f"{kind} {'shard' if shard else target.name}"


def fuzz_folders(seeds: list[Path], work: Path, cases: int, rng: random.Random, tally: Tally) -> None:
    work.mkdir(parents=True, exist_ok=True)
    case, out = work / "case", work / "out" / "m.clb"

    def export(path: Path, target: Path) -> None:
        hf_folder.export_folder(path, target, max_seq_len=8)

    for _ in range(cases):
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(rng.choice(seeds), case)
        kind = mutate_folder(case, rng)
        try:
            tally.outcomes[kind, export_outcome(export, case, out)] += 1
        except AssertionError as exc:
            tally.failures.append(f"safetensors {kind}: {exc}")
            _keep(case, work, len(tally.failures))
        shutil.rmtree(out.parent, ignore_errors=True)


def _keep(case: Path, work: Path, n: int) -> None:
    """A failing case kept beside the run, to reproduce it."""
    dest = work / f"failure-{n}{case.suffix}"
    if case.is_dir():
        shutil.copytree(case, dest, dirs_exist_ok=True)
    else:
        shutil.copy(case, dest)
