"""The engine builds warning-free (host and Cortex-M7) with no heap calls and no writable globals."""
from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from helpers.build import CORE, make

HEAP = {"malloc", "calloc", "realloc", "free", "aligned_alloc", "posix_memalign", "_sbrk", "sbrk"}
WRITABLE = (".data", ".bss", ".sdata", ".sbss", ".tbss", ".tdata")


def _build(variant: str) -> list[Path]:
    """Builds the engine library for a variant and returns its object files.

    The Cortex-M7, AArch64 (NEON) and RISC-V (RVV, rv64gc) objects are rebuilt from scratch so the
    compiler's output can be checked for warnings (the Makefile also passes -Werror).
    """
    if variant in ("cm7", "aarch64", "riscv64", "riscv64gc"):
        make("-C", str(CORE), f"clean-{variant}")
    r = make("-C", str(CORE), variant)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    objs = sorted((CORE / "build" / variant / "obj").glob("*.o"))
    assert objs and (CORE / "build" / variant / "libcolibri.a").exists()
    return objs


@pytest.mark.parametrize("variant", ["host", *(pytest.param(v, marks=pytest.mark.cross)
                                               for v in ("cm7", "aarch64", "riscv64", "riscv64gc"))])
def test_warning_free_build_without_heap_or_writable_data(variant: str) -> None:
    if variant == "cm7" and not shutil.which("arm-none-eabi-gcc"):
        pytest.fail("arm-none-eabi-gcc missing: run scripts/setup.sh")
    if variant == "aarch64" and not shutil.which("aarch64-linux-gnu-gcc"):
        pytest.fail("aarch64-linux-gnu-gcc missing: run scripts/setup.sh")
    if variant.startswith("riscv64") and not (shutil.which("clang-16") and Path("/usr/riscv64-linux-gnu/include").is_dir()):
        pytest.fail("clang-16 or the riscv64 cross sysroot (libc6-dev-riscv64-cross) missing: run scripts/setup.sh")
    for obj in _build(variant):
        with open(obj, "rb") as fh:
            elf = ELFFile(fh)
            symtab = elf.get_section_by_name(".symtab")
            assert isinstance(symtab, SymbolTableSection)
            for sym in symtab.iter_symbols():
                undefined = sym["st_shndx"] == "SHN_UNDEF"
                assert not (undefined and sym.name in HEAP), f"{obj.name} calls {sym.name}"
                if sym["st_info"]["type"] == "STT_OBJECT" or sym["st_shndx"] == "SHN_COMMON":
                    section = elf.get_section(sym["st_shndx"]).name if isinstance(sym["st_shndx"], int) else sym["st_shndx"]
                    assert not section.startswith(WRITABLE) and section != "SHN_COMMON", (
                        f"{obj.name}: writable symbol {sym.name} in {section}"
                    )
            for section in elf.iter_sections():
                if section.name.startswith(WRITABLE):
                    assert section["sh_size"] == 0, f"{obj.name}: {section.name} holds {section['sh_size']} bytes"


# --------------------------------------------------------------------------- the linked runner

ROOT = CORE.parents[1]
RUNNER = ROOT / "firmware" / "runner"
NUMERICS = ("-ffp-contract=off", "-fno-math-errno")
# The runner's own static objects (firmware/runner/README.md: the model buffer and the arena live
# in static storage; the rest are its frame buffers and the boards' driver state). Nothing else in
# the linked firmware may be writable: no errno, no C library state, nothing of the engine's.
RUNNER_STATICS = {"state", "runner_model", "runner_arena", "input_buf", "output_buf", "rx_frame", "tx_packet",
                  "lm_logits", "lm_tokens", "lm_new", "encode_work"}
BOARD_STATICS = {
    "mps2_an500": {"work_overhead", "flash_info", "flash_ops", "power_cut", "board_systick_wraps"},
    "nucleo_h743zi": {"cyc_hi", "cyc_last", "flash_info", "pclk1_hz", "sysclk_hz", "reporting.0", "work_start"},
}
# A fused multiply-add instruction (VFMA, VFMS, VFNMA, VFNMS): -ffp-contract=off lets none through.
FUSED = re.compile(r"\bvfn?m[as]\.f(32|64)\b")


def _runner(board: str) -> Path:
    r = make("-C", str(RUNNER), f"BOARD={board}")
    assert r.returncode == 0, r.stdout + r.stderr
    return RUNNER / "build" / board / "runner.elf"


@pytest.mark.cross
@pytest.mark.parametrize("board", BOARD_STATICS)
def test_linked_runner_has_no_errno_and_no_foreign_writable_data(board: str) -> None:
    """The README's "no mutable globals" for the firmware as linked: the engine's math never reaches
    libm (whose expf, erff and tanhf write newlib's errno through its reentrancy struct in .data), and
    every writable object is one of the runner's own statics."""
    with open(_runner(board), "rb") as fh:
        elf = ELFFile(fh)
        symtab = elf.get_section_by_name(".symtab")
        writable = {}
        for sym in symtab.iter_symbols():
            assert not re.search(r"errno|impure|_reent|fdlib|__math_", sym.name), f"{board}: links {sym.name}"
            if sym["st_info"]["type"] == "STT_OBJECT" and isinstance(sym["st_shndx"], int):
                section = elf.get_section(sym["st_shndx"]).name
                if section.startswith(WRITABLE) or elf.get_section(sym["st_shndx"])["sh_flags"] & 1:  # SHF_WRITE
                    writable[sym.name] = section
    foreign = set(writable) - RUNNER_STATICS - BOARD_STATICS[board]
    assert not foreign, f"{board}: writable objects that are not the runner's: {sorted(foreign)}"
    assert RUNNER_STATICS <= set(writable), "the runner's statics were not found: is the symbol table stripped?"


@pytest.mark.cross
@pytest.mark.parametrize("board", BOARD_STATICS)
def test_linked_runner_fuses_only_in_the_cmsis_kernels(board: str) -> None:
    """-ffp-contract=off reaches every object of the firmware: no VFMA/VFMS anywhere but in the functions
    of the optimised Cortex-M backend (src/kernels/cmsis), which fuses on purpose (written out with
    fmaf and VFMA, tested against the reference within a stated tolerance). So the reference kernels,
    which the device runs after a KERNELS request, round every product and sum as the host does
    (tests/target/test_target_hil.py checks the bits)."""
    elf = _runner(board)
    cmsis_obj = RUNNER / "build" / board / "core" / "colibri_kernels_cmsis.o"
    nm = subprocess.run(["arm-none-eabi-nm", "--defined-only", str(cmsis_obj)], capture_output=True, text=True,
                        check=True).stdout
    cmsis_functions = {ln.split()[-1] for ln in nm.splitlines() if ln.split()[1] in "tT"}
    dis = subprocess.run(["arm-none-eabi-objdump", "-d", str(elf)], capture_output=True, text=True,
                         check=True).stdout
    fused, where, function = [], set(), None
    for ln in dis.splitlines():
        m = re.match(r"[0-9a-f]+ <([^>]+)>:", ln)
        if m:
            function = m[1]
        elif FUSED.search(ln):
            fused.append(ln.strip())
            where.add(function)
    assert fused, f"{board}: no fused multiply-add at all: is the cmsis backend built?"
    assert where <= cmsis_functions, f"{board}: fused multiply-adds outside the cmsis kernels: {where - cmsis_functions}"


@pytest.mark.cross
def test_gnu11_without_the_contract_would_fuse() -> None:
    """Why the flag is needed: the same kernels built as -std=gnu11 (PlatformIO, MicroPython ports)
    without -ffp-contract=off contain fused multiply-adds on the Cortex-M7; with it, none."""
    src = CORE / "src" / "kernels" / "colibri_kernels_ref.c"
    base = ["arm-none-eabi-gcc", "-std=gnu11", "-O2", "-mcpu=cortex-m7", "-mthumb", "-mfpu=fpv5-d16",
            "-mfloat-abi=hard", f"-I{CORE / 'include'}", "-S", "-o", "-", str(src)]
    fused = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    plain = subprocess.run(base + list(NUMERICS), capture_output=True, text=True, check=True).stdout
    assert FUSED.search(fused) and not FUSED.search(plain)


# --------------------------------------------------------------------------- every build's flags


def _compile_lines(dry_run: str) -> list[str]:
    """Every compiler run on a C source (assembler sources have no floating point to contract)."""
    return [ln for ln in dry_run.splitlines() if re.match(r"\S*gcc\s", ln) and re.search(r"\s\S+\.c(\s|$)", ln)]


def _dry_run(*args: str) -> list[str]:
    """The compile commands `make -n -B` would run (nothing is built)."""
    r = subprocess.run(["make", "-n", "-B", *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _compile_lines(r.stdout)
    assert lines, r.stdout
    return lines


def _fake_freertos(tmp: Path) -> tuple[Path, Path]:
    """Just enough of a FreeRTOS-Kernel checkout and a packed model for the example's Makefile to
    plan its build (a dry run reads no source)."""
    kernel = tmp / "FreeRTOS-Kernel"
    for f in ("tasks.c", "queue.c", "list.c", "timers.c", "include/FreeRTOS.h", "portable/GCC/ARM_CM7/r0p1/port.c"):
        (kernel / f).parent.mkdir(parents=True, exist_ok=True)
        (kernel / f).touch()
    model = tmp / "model"
    model.mkdir()
    (model / "model.c").touch()
    (model / "model.h").touch()
    return kernel, model / "model.c"


def test_every_build_sets_the_floating_point_contract(tmp_path: Path) -> None:
    """-ffp-contract=off and -fno-math-errno on every compile of every build the project ships, so a
    new build (or a changed flag list) cannot quietly fuse multiply-adds or set errno again."""
    kernel, model_c = _fake_freertos(tmp_path)
    makefiles = {
        "firmware/colibri_core": _dry_run("-C", "firmware/colibri_core", "all-variants"),
        "firmware/runner mps2_an500": _dry_run("-C", "firmware/runner", "BOARD=mps2_an500"),
        "firmware/runner nucleo_h743zi": _dry_run("-C", "firmware/runner", "BOARD=nucleo_h743zi"),
        "tests/c": _dry_run("-C", "tests/c", "VARIANT=host"),
        "examples/freertos": _dry_run("-C", "examples/freertos", f"FREERTOS_KERNEL_PATH={kernel}", f"MODEL_C={model_c}"),
        "examples/freertos mps2_an500": _dry_run("-C", "examples/freertos", "BOARD=mps2_an500",
                                                 f"FREERTOS_KERNEL_PATH={kernel}", f"MODEL_C={model_c}",
                                                 f"BUILD={tmp_path / 'build'}"),
    }
    assert any("colibri_check.c" in ln for ln in makefiles["tests/c"]), "the C test drivers are compiled too"
    for build, lines in makefiles.items():
        for line in lines:
            assert all(f in line.split() for f in NUMERICS), f"{build}: {line}"
    # The CPython binding (setup.py), the native .mpy (colibri natmod) and PlatformIO.
    setup = ast.parse((ROOT / "setup.py").read_text())
    args = [ast.literal_eval(kw.value) for node in ast.walk(setup) if isinstance(node, ast.Call)
            for kw in node.keywords if kw.arg == "extra_compile_args"]
    assert args and all(set(NUMERICS) <= set(a) for a in args), args
    from colibri.target import natmod
    for arch in natmod.ARCHS.values():
        assert set(NUMERICS) <= set(arch.cflags), arch.name
    ini = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",))
    ini.read(ROOT / "platformio.ini")
    flags = ini["env"]["build_flags"].split()
    assert set(NUMERICS) <= set(flags), flags
    envs = [s for s in ini.sections() if s.startswith("env:")]
    assert envs and all("${env.build_flags}" in ini[s].get("build_flags", "${env.build_flags}") for s in envs)
    # The MicroPython user C module, for make-based and CMake-based ports.
    mk = (ROOT / "micropython_module" / "micropython.mk").read_text()
    assert re.search(r"^CFLAGS_USERMOD \+=.*-ffp-contract=off -fno-math-errno", mk, re.M), mk
    cmake = (ROOT / "micropython_module" / "micropython.cmake").read_text()
    assert re.search(r"^target_compile_options\(usermod_colibri INTERFACE -ffp-contract=off -fno-math-errno\)",
                     cmake, re.M), cmake
