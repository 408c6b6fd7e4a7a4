"""Runs an ARM colibri.mpy on a Cortex-M7 (QEMU mps2-an500) under a stand-in loader.

No MicroPython firmware for ARM runs here, so loader.c does the loader's
part itself: parses the .mpy, applies the relocation stream as MicroPython's
mp_native_relocate does, provides the mp_fun_table slots the module calls
(with fake objects), imports the module and drives Model / forward / version
through the objects mpy_init registered. It checks the ARM side of the
linker (Thumb code at text offset 0, GOT relocations, .bss, qstr ids) and of
the runtime header (slot indices, type and dict layouts, raising).

    .venv/bin/python micropython_module/natmod/qemu_loader/run.py armv7emsp model.clb

Prints the log and how the outputs compare with the CPython engine.
Needs arm-none-eabi-gcc (with newlib) and qemu-system-arm.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CFLAGS = ["-mcpu=cortex-m7", "-mthumb", "-mfpu=fpv5-d16", "-mfloat-abi=hard", "-O1", "-Wall",
          "-nostartfiles", "--specs=nano.specs", "--specs=nosys.specs"]


@dataclass
class LoaderRun:
    log: str            # everything the firmware printed but the outputs
    y: np.ndarray       # forward's outputs, [batch, output_size]
    exit_code: int


def _c_bytes(name: str, data: bytes) -> str:
    return (f"const unsigned char {name}[] __attribute__((aligned(8))) = {{{','.join(map(str, data))}}};\n"
            f"const unsigned int {name}_len = {len(data)};\n")


def run(mpy: Path, image: bytes, x: np.ndarray, output_size: int, timeout: float = 120) -> LoaderRun:
    """Loads `mpy` (armv7emsp or armv7emdp) in QEMU and runs forward(x) on `image`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_out = x.shape[0] * output_size
    with tempfile.TemporaryDirectory(prefix="colibri-qemu-loader-") as tmp:
        blobs = Path(tmp) / "blobs.c"
        blobs.write_text(_c_bytes("mpy_blob", mpy.read_bytes()) + _c_bytes("model_blob", image)
                         + f"const float input_blob[] = {{{','.join(repr(float(v)) + 'f' for v in x.ravel())}}};\n"
                         + f"const unsigned int input_count = {x.size};\n"
                         + f"const unsigned int output_count = {n_out};\n")
        elf = Path(tmp) / "loader.elf"
        subprocess.run(["arm-none-eabi-gcc", *CFLAGS, "-T", str(HERE / "link.ld"), str(HERE / "loader.c"),
                        str(blobs), "-o", str(elf)], check=True)
        r = subprocess.run(["qemu-system-arm", "-M", "mps2-an500", "-display", "none", "-monitor", "none",
                            "-serial", "none", "-kernel", str(elf), "-semihosting-config", "enable=on,target=native"],
                           capture_output=True, text=True, timeout=timeout)
    text = (r.stdout + r.stderr).replace("\r", "")  # semihosting writes to QEMU's stderr
    words = re.findall(r"^Y \d+ ([0-9a-f]{8})$", text, re.M)
    y = np.array([int(w, 16) for w in words], dtype=np.uint32).view(np.float32)
    log = re.sub(r"^Y .*\n", "", text, flags=re.M)
    return LoaderRun(log, y.reshape(x.shape[0], output_size) if y.size == n_out else y, r.returncode)


def main() -> int:
    import colibri
    from colibri.target import natmod

    arch, model_path = sys.argv[1], Path(sys.argv[2])
    image = model_path.read_bytes()
    host = colibri.Model(image)
    x = (np.random.default_rng(11).standard_normal((host.max_batch, host.input_size)) * 3).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        mpy = Path(tmp) / "colibri.mpy"
        natmod.build(arch, mpy)
        result = run(mpy, image, x, host.output_size)
    print(result.log, end="")
    if result.exit_code != 0 or result.y.shape != (x.shape[0], host.output_size):
        print(f"{arch}: FAILED (exit {result.exit_code})")
        return 1
    want = host.forward(x)
    err = float(np.abs(result.y - want).max() / (1 + np.abs(want).max()))
    print(f"{arch}: max |device - cpython| / (1 + max|y|) = {err:.3g}, identical {(result.y == want).sum()}/{want.size}")
    return 0 if err <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
