"""Where the emulated Cortex-M7's instructions of one forward pass go, function by function.

    PYTHONPATH=host_tools python bench/m7_profile.py [meter|smart_meter] [--dtype f32|q8|q8i8]
        [--reference-kernels] [--annotate FUNCTION ...]

Runs the mps2-an500 runner in QEMU twice with bench/qemu_pc_profile.c (an instruction-counting
plugin): once loading the model and forwarding one input, once forwarding it a second time as well.
Everything else is identical, so the difference of the two per-instruction counts is what the second
forward executed: colibri_forward and the runner's request handling around it (the firmware's work
counter covers colibri_forward alone). The runner's UART polling (board_uart_getc) waits on the host
and differs run to run; every function colibri_forward runs is deterministic.
Instructions, not cycles. --annotate prints the disassembly of a function with each instruction's
count.
"""
from __future__ import annotations

import argparse
import bisect
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "bench")]
PLUGIN_SRC = ROOT / "bench" / "qemu_pc_profile.c"
PLUGIN = ROOT / "build" / "m7" / "libpcprof.so"


def plugin() -> Path:
    if not PLUGIN.exists() or PLUGIN.stat().st_mtime < PLUGIN_SRC.stat().st_mtime:
        PLUGIN.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-O2", "-Wall", "-shared", "-fPIC", str(PLUGIN_SRC), "-o", str(PLUGIN)], check=True)
    return PLUGIN


def run(elf: Path, image: bytes, x: np.ndarray, forwards: int, reference: bool) -> tuple[Counter, int]:
    """Per-pc instruction counts of a run that loads `image` and forwards x `forwards` times; and the
    work count (instructions inside colibri_forward, by the firmware's counter) of the last forward."""
    from colibri.target.device import Device
    from colibri.target.qemu import Qemu

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "prof.txt"
        work = 0
        with Qemu(elf, extra_args=["-plugin", f"{plugin()},out={out}"], timeout=60) as q, Device(q.url) as dev:
            if reference:
                dev.kernels(reference=True)
            dev.load(image)
            for _ in range(forwards):
                work = dev.forward(x)[1].count
            dev.stats()
        counts: Counter = Counter()
        for line in out.read_text().splitlines():
            pc, n = line.split()
            counts[pc if pc == "elsewhere" else int(pc, 16)] = int(n)
    return counts, work


def symbols(elf: Path) -> tuple[list[int], list[tuple[str, int]]]:
    """Function start addresses (sorted) and (name, size) for each, from the ELF's symbol table."""
    nm = subprocess.run(["arm-none-eabi-nm", "-S", "--defined-only", str(elf)], capture_output=True, text=True,
                        check=True).stdout
    funcs = {}
    for line in nm.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW":
            funcs[int(parts[0], 16) & ~1] = (parts[3], int(parts[1], 16))
    starts = sorted(funcs)
    return starts, [funcs[s] for s in starts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="meter", choices=["meter", "smart_meter"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "q8", "q8i8"])
    ap.add_argument("--reference-kernels", action="store_true")
    ap.add_argument("--annotate", nargs="*", default=[], metavar="FUNCTION")
    args = ap.parse_args()

    import models
    from measure import runner_elf

    from colibri.frontends.exporter import export

    module = models.meter() if args.model == "meter" else models.smart_meter()[0]
    kw = {"f32": {}, "q8": {"dtype": "q8"}, "q8i8": {"dtype": "q8", "int8_act": ["*"]}}[args.dtype]
    image = export(module, None, max_batch=1, **kw).image
    n_in = next(m for m in module.modules() if hasattr(m, "in_features")).in_features
    x = np.random.default_rng(0).standard_normal((1, n_in)).astype(np.float32)
    elf = runner_elf("mps2_an500")

    one, _ = run(elf, image, x, 1, args.reference_kernels)
    two, work = run(elf, image, x, 2, args.reference_kernels)
    diff = {pc: two[pc] - one.get(pc, 0) for pc in two if two[pc] != one.get(pc, 0)}
    starts, funcs = symbols(elf)
    per_func: Counter = Counter()
    for pc, n in diff.items():
        i = bisect.bisect_right(starts, pc) - 1 if pc != "elsewhere" else -1
        name = funcs[i][0] if i >= 0 and pc < starts[i] + max(funcs[i][1], 2) else f"?{pc}"
        per_func[name] += n
    print(f"{args.model} {args.dtype}{' (reference kernels)' if args.reference_kernels else ''}: "
          f"{work} instructions inside colibri_forward (the runner's work counter); by function, the second "
          f"forward request (the runner's UART polling varies run to run):")
    for name, n in per_func.most_common():
        print(f"{n:8d}  {name}")

    for fn in args.annotate:
        i = next((k for k, f in enumerate(funcs) if f[0] == fn), None)
        if i is None:
            sys.exit(f"{fn}: no such function in {elf}")
        lo, size = starts[i], funcs[i][1]
        dis = subprocess.run(["arm-none-eabi-objdump", "-d", "--no-show-raw-insn", f"--start-address={lo}",
                              f"--stop-address={lo + size}", str(elf)], capture_output=True, text=True,
                             check=True).stdout
        print(f"\n{fn}: {sum(n for pc, n in diff.items() if pc != 'elsewhere' and lo <= pc < lo + size)}")
        for line in dis.splitlines():
            m = re.match(r"\s*([0-9a-f]+):\s*(.*)", line)
            if m:
                print(f"{diff.get(int(m.group(1), 16), 0):6d}  {m.group(1)}: {m.group(2)}")


if __name__ == "__main__":
    main()
