"""The runner firmware links for both boards, with no heap, and reports its size; `colibri hil` and
`colibri footprint` on the emulated board."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from elftools.elf.elffile import ELFFile

from colibri import nn as cnn
from colibri.frontends.exporter import export

from helpers.build import ROOT, make

pytestmark = pytest.mark.cross

RUNNER = ROOT / "firmware" / "runner"
COLIBRI = str(Path(sys.executable).parent / "colibri")
HEAP = {"malloc", "free", "calloc", "realloc", "_sbrk", "sbrk", "_malloc_r", "_free_r"}


def build(board: str) -> Path:
    r = make("-C", str(RUNNER), f"BOARD={board}")
    assert r.returncode == 0, r.stdout + r.stderr
    elf = RUNNER / "build" / board / "runner.elf"
    assert elf.exists()
    return elf


def symbols(elf: Path) -> dict[str, int]:
    with open(elf, "rb") as fh:
        tab = ELFFile(fh).get_section_by_name(".symtab")
        return {s.name: s["st_value"] for s in tab.iter_symbols() if s.name}


@pytest.mark.parametrize("board", ["mps2_an500", "nucleo_h743zi"])
def test_runner_links_without_heap(board: str) -> None:
    names = symbols(build(board))
    assert not HEAP & set(names), f"heap functions linked: {sorted(HEAP & set(names))}"
    assert "colibri_forward" in names and "colibri_init" in names


def test_nucleo_vector_table_and_memory_map() -> None:
    elf = build("nucleo_h743zi")
    with open(elf, "rb") as fh:
        e = ELFFile(fh)
        flash = [s for s in e.iter_segments() if s["p_type"] == "PT_LOAD" and s["p_filesz"]]
        lowest = min(flash, key=lambda s: s["p_paddr"])
        assert lowest["p_paddr"] == 0x08000000
        words = lowest.data()[:8]
    sp, reset = int.from_bytes(words[:4], "little"), int.from_bytes(words[4:], "little")
    assert 0x20000000 < sp <= 0x20020000, hex(sp)  # top of DTCM (RM0433 memory map)
    assert reset & 1 and 0x08000000 <= reset < 0x08200000, hex(reset)  # Thumb, in flash
    sources = "".join(p.read_text() for p in (ROOT / "boards" / "nucleo_h743zi").glob("*.[ch]"))
    assert len(re.findall(r"RM0433", sources)) >= 5, "clock, flash and UART code cite the reference manual"
    size = subprocess.run(["arm-none-eabi-size", str(elf)], capture_output=True, text=True, check=True).stdout
    print(size)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 16), cnn.MoE(16, 4, 32, top_k=2), torch.nn.Linear(16, 3))
    path = tmp_path_factory.mktemp("hil") / "m.clb"
    export(m, path, max_batch=4, dtype="q8")
    return path


@pytest.mark.qemu
def test_colibri_hil_prints_error_work_and_footprint(model_file: Path) -> None:
    runs = []
    for _ in range(2):
        r = subprocess.run([COLIBRI, "hil", str(model_file)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "device agrees with the host engine" in r.stdout
        assert "instructions (QEMU -icount, not cycles)" in r.stdout
        assert "stack high-water" in r.stdout and "runner firmware: flash" in r.stdout
        runs.append(re.findall(r"work ([\d,]+) instructions", r.stdout))
    assert runs[0] == runs[1] and len(runs[0]) == 2, runs  # identical instruction counts across runs
    assert "target kernels: cmsis" in r.stdout  # the runner's default on the Cortex-M7


@pytest.mark.qemu
def test_colibri_hil_reference_kernels_bit_for_bit(model_file: Path) -> None:
    """--reference-kernels: the target runs the reference kernels and must equal the host's bit for bit."""
    r = subprocess.run([COLIBRI, "hil", "--reference-kernels", str(model_file)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "target kernels: reference" in r.stdout and "max |device - host| 0;" in r.stdout
    assert "device agrees with the host engine bit for bit" in r.stdout


def test_colibri_footprint(model_file: Path) -> None:
    r = subprocess.run([COLIBRI, "footprint", str(model_file)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"engine \(Cortex-M7 libcolibri.a\): code [\d,]+ B flash, 0 B static RAM", r.stdout)
    assert re.search(r"runner \(runner.elf\): flash [\d,]+ B", r.stdout)
    assert re.search(r"stack high-water [\d,]+ B", r.stdout)


@pytest.mark.qemu
def test_runner_reports_and_enforces_format_versions(model_file: Path, no_qemu_left_behind) -> None:
    """HELLO says which image format versions the runner's engine reads; an image of a newer version
    is refused over serial with the engine's UNSUPPORTED_VERSION, a corrupt version field with
    BAD_VERSION, and the runner goes on with the next good image."""
    from colibri.model import format as F
    from colibri.target.device import Device, DeviceError
    from colibri.target.pack import firmware_formats
    from colibri.target.qemu import Qemu

    elf = build("mps2_an500")
    data = model_file.read_bytes()
    with Qemu(elf) as q, Device(q.url) as dev:
        hello = dev.hello()
        assert hello.formats == (F.MIN_READ_VERSION, F.MAX_READ_VERSION) == firmware_formats(elf)
        for version, status in ((F.MAX_READ_VERSION + 1, F.Status.UNSUPPORTED_VERSION),
                                (0xFFFF, F.Status.BAD_VERSION)):
            b = bytearray(data)
            b[4:6] = version.to_bytes(2, "little")
            with pytest.raises(DeviceError) as exc:
                dev.load(bytes(b))
            assert exc.value.code == status, exc.value
            assert "UNSUPPORTED_VERSION" in str(exc.value) or status != F.Status.UNSUPPORTED_VERSION
        assert dev.load(data).image_size == len(data)
