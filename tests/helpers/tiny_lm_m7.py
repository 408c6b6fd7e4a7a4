"""The trained tiny King James model (examples/tiny_lm) on the emulated Cortex-M7, without an upload.

Sending an image over the emulated UART (10-20 KB/s) costs about 45 s for the q8 image (420 KB) and
minutes for the f32 one, so neither tests/target/test_target_hil_lm.py nor scripts/measure.py sends one. The model reaches the
runner the two ways a NUCLEO-H743ZI would hold it (boards/nucleo_h743zi):
  - q8 in flash slot A: the emulated flash is loaded from a file holding the committed slot
    (colibri.target.slots.slot_image), and the runner boots it in place, as it boots a slot on the board;
  - f16 (and, on the emulator only, f32) linked into the firmware (colibri pack --c-array, make MODEL_C=...), as a model
    beside the runner in flash bank 1; each dtype gets its own build folder (BUILD_SUFFIX).
The images are examples/tiny_lm/evaluate.py's: 256-position KV cache, max_batch 1 (a prompt goes in
one token a call, as the firmware decodes).
"""
from __future__ import annotations

import fcntl
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from colibri.target import slots
from colibri.target.device import Device
from colibri.target.pack import c_array
from colibri.target.qemu import FLASH_BASE, FLASH_SIZE, Qemu

from helpers.build import ROOT

RUNNER = ROOT / "firmware" / "runner"
sys.path.insert(0, str(ROOT / "examples" / "tiny_lm"))
import evaluate  # noqa: E402

PROMPT = "And God said, "
NEW_TOKENS = 24  # greedy bytes generated on the target
SLOT_DTYPES = ("q8", "q4")  # small enough for one 512 KB slot
# A slot is too small: linked into the firmware. f32 (1.55 MB) fits the emulator's 4 MB code memory, not a
# NUCLEO's 1 MB bank 1; it is checked on the emulator only, and its build costs about 20 s.
LINKED_DTYPES = ("f16", "f32")
FIGURE_DTYPES = ("q8", "f16")  # scripts/measure.py's: the two a NUCLEO-H743ZI holds


def image(dtype: str) -> bytes:
    """The tiny LM's `dtype` image (exported once, cached in build/tiny_lm)."""
    return evaluate.image_path(dtype).read_bytes()


def flash_with_slot_a(data: bytes, path: Path) -> Path:
    """A file for the emulated flash: `data` committed in slot A (sequence 1), the rest erased."""
    layout = slots.LAYOUTS["mps2_an500"]
    if len(data) > layout.capacity:
        raise ValueError(f"a {len(data):,}-byte image does not fit a {layout.capacity:,}-byte slot")
    flash = bytearray(b"\xff" * FLASH_SIZE)
    off = layout.slot_a - FLASH_BASE
    committed = slots.slot_image(data, 1)
    flash[off : off + len(committed)] = committed
    path.write_bytes(bytes(flash))
    return path


def build_runner(board: str, model_c: Path | None = None, suffix: str = "") -> Path:
    """The runner for `board`, with a linked-in model if `model_c` is given (build/<board><suffix>).
    Under the runner's build lock (colibri.target.firmware.build_runner), so parallel workers never share a make."""
    args = ["make", "-s", "-C", str(RUNNER), f"BOARD={board}"]
    if model_c is not None:
        args += [f"MODEL_C={model_c}", f"BUILD_SUFFIX={suffix}"]
    with open(RUNNER / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return RUNNER / "build" / f"{board}{suffix}" / "runner.elf"


def linked_runner(dtype: str, work_dir: Path, board: str = "mps2_an500") -> Path:
    """The runner for `board` with the tiny LM's `dtype` image linked in."""
    packed = c_array(image(dtype), work_dir / f"tiny_lm_{dtype}", name="colibri_model")
    return build_runner(board, packed.source, f"-tiny-lm-{dtype}")


@contextmanager
def booted(dtype: str, work_dir: Path) -> Iterator[Device]:
    """A QEMU mps2-an500 runner already running the tiny LM in `dtype` (slot A or linked in)."""
    if dtype in SLOT_DTYPES:
        firmware = build_runner("mps2_an500")
        flash = flash_with_slot_a(image(dtype), work_dir / f"flash-{dtype}.bin")
    else:
        firmware, flash = linked_runner(dtype, work_dir), None
    with Qemu(firmware, flash=flash) as q, Device(q.url, timeout=30) as dev:
        yield dev


@dataclass(frozen=True)
class NucleoLayout:
    """What the NUCLEO-H743ZI runner has for a model, read from its built ELF (boards/nucleo_h743zi)."""

    model_buffer: int  # runner_model: the RAM buffer an uploaded model goes to
    arena: int  # runner_arena: RUNNER_ARENA_CAPACITY
    slot: int  # __model_slot_size: one flash slot, 32-byte header included
    bank1: int  # FLASH (bank 1): the runner and a linked-in model


def nucleo_layout(elf: Path) -> NucleoLayout:
    out = subprocess.run(["arm-none-eabi-nm", "-S", str(elf)], capture_output=True, text=True, check=True).stdout
    sizes, values = {}, {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            sizes[parts[3]] = int(parts[1], 16)
        elif len(parts) == 3:
            values[parts[2]] = int(parts[0], 16)
    ld = (ROOT / "boards" / "nucleo_h743zi" / "linker.ld").read_text()
    bank1 = re.search(r"FLASH\s+\(rx\)\s*:\s*ORIGIN = 0x08000000, LENGTH = (\d+)K", ld)
    if bank1 is None:
        raise ValueError("boards/nucleo_h743zi/linker.ld: no FLASH region at 0x08000000")
    return NucleoLayout(sizes["runner_model"], sizes["runner_arena"], values["__model_slot_size"],
                        int(bank1.group(1)) * 1024)


def board_mk_capacity(name: str, board: str = "nucleo_h743zi") -> int:
    """-D<name>=<bytes> from boards/<board>/board.mk."""
    m = re.search(rf"-D{name}=(\d+)", (ROOT / "boards" / board / "board.mk").read_text())
    if m is None:
        raise ValueError(f"boards/{board}/board.mk defines no {name}")
    return int(m.group(1))


def prompt_ids() -> list[int]:
    return list(PROMPT.encode("ascii"))
