"""The FreeRTOS example (examples/freertos) against real FreeRTOS-Kernel trees, and its config checks.

No package registry has the FreeRTOS kernel, so the builds need a checkout:
FREERTOS_KERNEL_PATH names one, or several separated by ':' (e.g. main,
V11.1.0 and V10.4.2, as `make upstream-check` passes them). Without it those
tests are skipped with that reason; what needs no kernel (the configuration's
macros, the Makefile's board and version claims) runs everywhere.

With a kernel, for each one:
- the example builds for the NUCLEO-H743ZI with both Cortex-M7 ports and for
  QEMU's mps2-an500, with no warning from the compiler or the linker;
- the mps2-an500 build runs in QEMU (-icount: deterministic) until two
  forecasts have been scored: both tasks ran (readings in, forecasts out on
  the UART), every forecast is the host engine's (the reference kernels on
  both sides: the 48 float32 outputs bit for bit, and the printed MW), the
  error lines are what the host computes from the same readings, and the
  stack high-water marks of both tasks are printed and plausible.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from helpers.build import ROOT

FREERTOS = ROOT / "examples" / "freertos"
KERNELS = [Path(p).resolve() for p in os.environ.get("FREERTOS_KERNEL_PATH", "").split(os.pathsep) if p.strip()]
needs_kernel = pytest.mark.skipif(
    not KERNELS, reason="FREERTOS_KERNEL_PATH is not set (a FreeRTOS-Kernel checkout, or several separated by ':'; "
                        "docs/testing.md 'Upstream checks': make upstream-check FREERTOS_KERNEL_PATH=...)")
ARM_GCC = shutil.which("arm-none-eabi-gcc")
QEMU = shutil.which("qemu-system-arm")
# The oldest kernel the example claims (Makefile, README.md): INCLUDE_xTaskDelayUntil came with it.
OLDEST_KERNEL = "V10.4.2"

SENSOR_STACK_WORDS, INFERENCE_STACK_WORDS = 256, 1024  # main.c
NOISE_SEED = 0x2545F491  # main.c's sensor task
STOP_AFTER_DAYS = 2
QEMU_DEFS = f"-DAPP_STOP_AFTER_DAYS={STOP_AFTER_DAYS} -DAPP_REFERENCE_KERNELS -DAPP_PRINT_RAW"


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def config_macros() -> list[str]:
    """Every macro FreeRTOSConfig.h defines, in any branch of its #if blocks."""
    return re.findall(r"^\s*#\s*define\s+(\w+)", strip_comments((FREERTOS / "FreeRTOSConfig.h").read_text()), re.M)


# --------------------------------------------------------------------------- without a kernel (CI)


def test_config_sets_only_the_new_delay_until_macro() -> None:
    """FreeRTOS.h (V10.4.2 and later) stops with an #error when both INCLUDE_vTaskDelayUntil and
    INCLUDE_xTaskDelayUntil are defined; the example sets only the new one and calls the new function."""
    macros = config_macros()
    assert "INCLUDE_xTaskDelayUntil" in macros
    assert "INCLUDE_vTaskDelayUntil" not in macros
    code = strip_comments((FREERTOS / "main.c").read_text())
    assert "xTaskDelayUntil(" in code and "vTaskDelayUntil(" not in code


def test_config_sets_no_option_twice_or_a_replaced_pair() -> None:
    """No macro defined twice in one board's branch, and none of the pairs a kernel refuses together."""
    text = strip_comments((FREERTOS / "FreeRTOSConfig.h").read_text())
    for board in ("", "-DAPP_BOARD_MPS2_AN500"):
        r = subprocess.run(["cpp", "-P", "-dM", "-D__ASSEMBLER__", *filter(None, [board]), "-"], input=text,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        defined = set(re.findall(r"^#define (\w+)", r.stdout, re.M))
        assert "configCPU_CLOCK_HZ" in defined and "configTICK_RATE_HZ" in defined, board
        # V11 derives the tick width from configUSE_16_BIT_TICKS; setting both is an #error there.
        assert not {"configUSE_16_BIT_TICKS", "configTICK_TYPE_WIDTH_IN_BITS"} <= defined, board
        assert not {"INCLUDE_vTaskDelayUntil", "INCLUDE_xTaskDelayUntil"} <= defined, board
        assert ("vPortSVCHandler" in defined) == (board == ""), "direct SVCall routing is the NUCLEO's"
        # V10's ports assert configPRIO_BITS against the NVIC, whose bits QEMU's version decides
        assert ("configPRIO_BITS" in defined) == (board == ""), board
    # one #define per name per branch: the NUCLEO and mps2-an500 branches may each set a name once
    counts = {m: config_macros().count(m) for m in set(config_macros())}
    assert {m for m, n in counts.items() if n > 1} <= {"configCPU_CLOCK_HZ", "configKERNEL_INTERRUPT_PRIORITY",
                                                       "configMAX_SYSCALL_INTERRUPT_PRIORITY"}, counts


def test_makefile_refuses_an_unknown_board() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    r = subprocess.run(["make", "-C", str(FREERTOS), "BOARD=stm32f4"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode != 0 and "supports BOARD=nucleo_h743zi and BOARD=mps2_an500" in r.stderr, r.stderr


def test_kernel_version_claims_agree() -> None:
    """The Makefile and the README claim the same oldest kernel, and the README's table of the kernels
    the example was last built and run on names that one and full commit hashes."""
    makefile = (FREERTOS / "Makefile").read_text()
    readme = (FREERTOS / "README.md").read_text()
    assert f"{OLDEST_KERNEL} or later" in makefile
    assert f"{OLDEST_KERNEL} or later" in readme
    table = readme.split("### Kernel versions", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `?([^|`]+?)`? \| `([0-9a-f]{40})` \|", table, re.M)
    assert OLDEST_KERNEL in [tag for tag, _ in rows], table
    assert "V11.1.0" in [tag for tag, _ in rows] and any(tag.startswith("main") for tag, _ in rows), table
    assert "V10.4 .." not in makefile and "V10.4 and later" not in readme


# --------------------------------------------------------------------------- with a kernel


@pytest.fixture(scope="module")
def model_c(tmp_path_factory) -> Path:
    """The smart meter forecaster (examples/smart_meter: 3-expert MoE, 105 -> 48), briefly trained,
    quantised to q8 as `make demo` does, packed into model.c by `colibri pack --c-array`."""
    sys.path.insert(0, str(ROOT / "examples" / "smart_meter"))
    try:
        import forecaster as F
    finally:
        sys.path.remove(str(ROOT / "examples" / "smart_meter"))
    from colibri.quant import quantize as Q
    from colibri.frontends.exporter import build_graph

    import torch

    torch.set_num_threads(1)
    moe = F.train(F.build_moe(), F.dataset(), steps=200)
    graph, _ = build_graph(moe, max_batch=7)
    out = tmp_path_factory.mktemp("model")
    (out / "meter_q8.clb").write_bytes(colibri.image.write(Q.quantize(graph, "q8")))
    r = subprocess.run([str(Path(sys.executable).parent / "colibri"), "pack", str(out / "meter_q8.clb"),
                        "--c-array", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return out / "model.c"


def build(kernel: Path, board: str, build_dir: Path, model: Path, port: str = "GCC/ARM_CM7/r0p1",
          defs: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-C", str(FREERTOS), "-j2", f"BOARD={board}", f"FREERTOS_KERNEL_PATH={kernel}",
                           f"FREERTOS_PORT={port}", f"MODEL_C={model}", f"BUILD={build_dir}", f"APP_DEFS={defs}"],
                          capture_output=True, text=True, env=env, timeout=600)


def kernel_id(kernel: Path) -> str:
    return kernel.name


@pytest.mark.upstream
@pytest.mark.cross
@needs_kernel
@pytest.mark.skipif(ARM_GCC is None, reason="arm-none-eabi-gcc is not installed (scripts/setup.sh installs it)")
@pytest.mark.parametrize("kernel", KERNELS, ids=kernel_id)
@pytest.mark.parametrize("board,port", [("nucleo_h743zi", "GCC/ARM_CM7/r0p1"), ("nucleo_h743zi", "GCC/ARM_CM4F"),
                                        ("mps2_an500", "GCC/ARM_CM7/r0p1"), ("mps2_an500", "GCC/ARM_CM4F")])
def test_builds_without_warnings(kernel: Path, board: str, port: str, model_c: Path, tmp_path: Path) -> None:
    r = build(kernel, board, tmp_path, model_c, port)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert not re.search(r"warning:|warning \(", out, re.I), out  # compiler and linker warnings
    assert (tmp_path / "colibri_freertos.elf").is_file() and (tmp_path / "colibri_freertos.hex").is_file()


class MeterLib:
    """examples/freertos/meter.c built for the host: the same readings and inputs as the firmware's."""

    def __init__(self, folder: Path) -> None:
        so = folder / "libmeter.so"
        r = subprocess.run(["cc", "-std=c11", "-O2", "-ffp-contract=off", "-shared", "-fPIC",
                            str(FREERTOS / "meter.c"), "-o", str(so), "-lm"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        self.lib = ctypes.CDLL(str(so))
        self.lib.meter_synthetic_mw.restype = ctypes.c_float
        self.lib.meter_synthetic_mw.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
        self.lib.meter_unscale.restype = ctypes.c_float
        self.lib.meter_unscale.argtypes = [ctypes.c_float]
        self.history = (ctypes.c_uint8 * 4096)()  # meter_history: 336 floats and two counters
        self.lib.meter_history_init(self.history)

    def readings(self, n: int) -> np.ndarray:
        noise = ctypes.c_uint32(NOISE_SEED)
        return np.array([self.lib.meter_synthetic_mw(s, ctypes.byref(noise)) for s in range(n)], np.float32)

    def inputs(self, series: np.ndarray, t: int, n_features: int) -> np.ndarray:
        self.lib.meter_history_init(self.history)
        for mw in series[:t]:
            self.lib.meter_history_push(self.history, ctypes.c_float(mw))
        x = (ctypes.c_float * n_features)()
        assert self.lib.meter_build_input(self.history, ctypes.c_uint32(t), x, ctypes.c_size_t(n_features)) == 0
        return np.array(x, np.float32)

    def unscale(self, y: float) -> np.float32:
        return np.float32(self.lib.meter_unscale(ctypes.c_float(y)))


def round_i32(x: np.float32) -> int:
    """main.c's round_to_i32: half away from zero, in float32."""
    half = np.float32(0.5)
    return int(np.float32(x - half) if x < 0 else np.float32(x + half))


def run_qemu(elf: Path, tmp: Path, timeout: float = 300) -> tuple[int, str, str]:
    """Runs the firmware to its semihosting exit; its exit status, the UART's output and QEMU's stderr."""
    serial = tmp / "uart.txt"
    cmd = [QEMU, "-M", "mps2-an500", "-display", "none", "-monitor", "none", "-nodefaults",
           "-semihosting-config", "enable=on,target=native", "-icount", "shift=7,sleep=off",
           "-serial", f"file:{serial}", "-kernel", str(elf)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"QEMU did not end in {timeout} s; UART so far:\n{serial.read_text(errors='replace')}")
    return proc.returncode, serial.read_text(errors="replace"), err


@pytest.mark.upstream
@pytest.mark.cross
@pytest.mark.qemu
@needs_kernel
@pytest.mark.skipif(ARM_GCC is None or QEMU is None, reason="needs arm-none-eabi-gcc and qemu-system-arm "
                                                         "(scripts/setup.sh installs them)")
@pytest.mark.parametrize("port", ["GCC/ARM_CM7/r0p1", "GCC/ARM_CM4F"])
@pytest.mark.parametrize("kernel", KERNELS, ids=kernel_id)
def test_mps2_an500_forecasts_equal_the_host_engine(kernel: Path, port: str, model_c: Path, tmp_path: Path,
                                                    no_qemu_left_behind) -> None:
    r = build(kernel, "mps2_an500", tmp_path, model_c, port, QEMU_DEFS)
    assert r.returncode == 0, r.stdout + r.stderr
    status, uart, stderr = run_qemu(tmp_path / "colibri_freertos.elf", tmp_path)
    assert status == 0, uart + stderr
    lines = [ln.rstrip("\r") for ln in uart.splitlines()]
    assert lines[-1] == "done", uart
    version = re.search(r'tskKERNEL_VERSION_NUMBER\s+"([^"]+)"', (kernel / "include" / "task.h").read_text()).group(1)
    banner = f"colibri {colibri.version()} on FreeRTOS {version}, mps2-an500 (QEMU), core r"
    assert any(ln.startswith(banner) and ln.endswith(" at 25 MHz") for ln in lines), uart
    assert "kernels: reference" in lines, uart
    assert not any(ln.startswith(("error", "***", "FAULT", "readings lost")) for ln in lines), uart

    image = (model_c.parent / "meter_q8.clb").read_bytes()
    host = colibri.Model(image, reference_kernels=True)
    meter = MeterLib(tmp_path)
    first_day = 7
    series = meter.readings((first_day + STOP_AFTER_DAYS + 1) * 48)
    days = [int(d) for d in re.findall(r"^day (\d+) \(\w+\) forecast", uart, re.M)]
    assert days == list(range(first_day, first_day + STOP_AFTER_DAYS)), uart
    for day in days:
        t = day * 48
        y = host.forward(meter.inputs(series, t, host.input_size)[None, :])[0]
        block = uart.split(f"day {day} (", 1)[1]
        raw = [int(v, 16) for ln in block.splitlines()[1:9] if ln.strip().startswith("raw")
               for v in ln.split()[1:]]
        assert raw == [int(v) for v in y.view(np.uint32)], f"day {day}: the model's outputs differ from the host's"
        mw = [meter.unscale(v) for v in y]
        printed = [int(v) for ln in block.splitlines()[1:5] for v in ln.split()[1:]]
        assert printed == [round_i32(v) for v in mw], f"day {day}: printed MW differ"
        # the next day's readings against it, summed in float32 in the same order as main.c
        err_sum, actual_sum = np.float32(0), np.float32(0)
        for i in range(48):
            err_sum = np.float32(err_sum + abs(np.float32(mw[i] - series[t + i])))
            actual_sum = np.float32(actual_sum + series[t + i])
        mae = round_i32(np.float32(err_sum / np.float32(48)))
        tenths = round_i32(np.float32(np.float32(1000) * err_sum / actual_sum))
        want = f"day {day} actual vs forecast: mean absolute error {mae} MW ({tenths // 10}.{tenths % 10} % of the load)"
        assert want in lines, (want, uart)

    marks = dict(re.findall(r"^(sensor|inference) task stack: (\d+) of \d+ words never used", uart, re.M))
    assert set(marks) == {"sensor", "inference"}, uart
    assert 0 < int(marks["sensor"]) < SENSOR_STACK_WORDS and 0 < int(marks["inference"]) < INFERENCE_STACK_WORDS
