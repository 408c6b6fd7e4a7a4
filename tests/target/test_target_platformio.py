"""platformio.ini and the FreeRTOS example (examples/freertos), checked offline.

PlatformIO's registry (platforms, toolchains, the FreeRTOS kernel) is not
reachable here, so no environment is built: `pio project config` parses and
lints the file, and the tests check what it points at against the repository
(linker scripts, sources, the engine's sources.txt, the flags of each
board.mk). The FreeRTOS example cannot be built without the kernel either; its
RTOS-free part, the smart meter input builder, is compiled for the host and
compared with examples/smart_meter/forecaster.py, and its Makefile must say
clearly when the kernel path is missing.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.platformio

ROOT = Path(__file__).resolve().parents[2]
PIO = Path(sys.executable).parent / "pio"
FREERTOS = ROOT / "examples" / "freertos"
ENVS = {
    "env:nucleo_h743zi": {"board": "nucleo_h743zi", "ldscript": "boards/nucleo_h743zi/linker.ld",
                          "board_mk": "boards/nucleo_h743zi/board.mk"},
    "env:nucleo_h743zi_freertos": {"board": "nucleo_h743zi", "ldscript": "boards/nucleo_h743zi/linker.ld",
                                   "board_mk": None},
    "env:mps2_an500_qemu": {"board": "mps2_an500", "ldscript": "boards/mps2_an500/mps2_an500.ld",
                            "board_mk": "boards/mps2_an500/board.mk"},
}
GENERATED = {"examples/freertos/model/model.c"}  # written by `colibri pack`, not committed


def pio(*args: str, core_dir: Path) -> subprocess.CompletedProcess:
    assert PIO.exists(), f"{PIO} not found: install the test dependencies (pip install platformio)"
    env = dict(os.environ, PLATFORMIO_CORE_DIR=str(core_dir), PLATFORMIO_SETTING_ENABLE_TELEMETRY="No")
    return subprocess.run([str(PIO), *args, "-d", str(ROOT)], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def core_dir(tmp_path_factory) -> Path:
    """A PlatformIO home of its own: nothing here reads or writes ~/.platformio."""
    return tmp_path_factory.mktemp("platformio-core")


@pytest.fixture(scope="module")
def config(core_dir) -> dict[str, dict]:
    """{section: {option: value}} as PlatformIO resolves it ([env] and `extends` merged into each env)."""
    r = pio("project", "config", "--json-output", core_dir=core_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    return {section: dict(options) for section, options in json.loads(r.stdout)}


def as_list(value) -> list[str]:
    return value if isinstance(value, list) else [line for line in str(value).splitlines() if line.strip()]


def flags(value) -> list[str]:
    return [tok for line in as_list(value) for tok in shlex.split(line)]


def make_var(board_mk: Path, name: str) -> list[str]:
    """A `NAME := ...` assignment of a board.mk, with its backslash continuations."""
    text = board_mk.read_text().replace("\\\n", " ")
    m = re.search(rf"^{name}\s*:?=(.*)$", text, re.M)
    assert m, f"{board_mk}: no {name}"
    return m.group(1).split("#")[0].split()


def test_lint_is_clean(core_dir):
    r = pio("project", "config", "--lint", core_dir=core_dir)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "free from linting errors" in out, out
    assert "warning" not in out.lower(), out
    assert not (core_dir / "packages").exists() or not any((core_dir / "packages").iterdir()), "lint downloaded packages"


def test_environments(config):
    assert config["platformio"]["default_envs"] == ["nucleo_h743zi"]
    assert set(ENVS) <= set(config), sorted(config)
    for name, want in ENVS.items():
        env = config[name]
        assert env["platform"] == "ststm32", name
        assert env["board"] == want["board"], name
        assert env["board_build.ldscript"] == want["ldscript"], name
        assert "framework" not in env, f"{name}: bare metal, no framework"
        assert env["monitor_speed"] == 115200, name
        assert flags(env["custom_cpu_flags"]) == ["-mcpu=cortex-m7", "-mthumb", "-mfpu=fpv5-d16", "-mfloat-abi=hard"]
        assert "-O2" in flags(env["build_flags"]) and "-Os" in as_list(env["build_unflags"]), name
        scripts = as_list(env["extra_scripts"])
        assert "pre:platformio/colibri_build.py" in scripts and "post:platformio/colibri_build.py" in scripts
    nucleo, rtos, qemu = (config[n] for n in ENVS)
    assert nucleo["upload_protocol"] == "stlink" and nucleo["test_port"] == "/dev/ttyACM0"
    assert "lib_deps" not in nucleo and "lib_deps" not in qemu
    assert rtos["extends"] == ["env:nucleo_h743zi"]
    assert rtos["lib_deps"] == ["freertos/FreeRTOS-Kernel"] and rtos["lib_ignore"] == ["FreeRTOS-Kernel"]
    assert rtos["custom_freertos_port"] == "GCC/ARM_CM7/r0p1"
    assert rtos["upload_protocol"] == "stlink"
    assert qemu["upload_protocol"] == "custom"
    assert "qemu-system-arm -M mps2-an500" in qemu["upload_command"]
    assert "-icount shift=7" in qemu["upload_command"]  # the work counter's COLIBRI_QEMU_ICOUNT_SHIFT


def test_everything_it_points_at_exists(config):
    src_dir = Path(config["platformio"]["src_dir"])
    assert src_dir == ROOT
    boards_dir = Path(config["platformio"]["boards_dir"])
    assert boards_dir == ROOT / "platformio" / "boards"
    board = json.loads((boards_dir / "mps2_an500.json").read_text())
    assert board["build"]["cpu"] == "cortex-m7" and board["upload"]["protocol"] == "custom"
    for name in ENVS:
        env = config[name]
        assert (ROOT / env["board_build.ldscript"]).is_file(), name
        for script in as_list(env["extra_scripts"]):
            assert (ROOT / script.split(":", 1)[-1]).is_file(), script
        toks = flags(env["build_flags"])
        for i, tok in enumerate(toks):
            if tok == "-I":
                assert (ROOT / toks[i + 1]).is_dir(), f"{name}: -I {toks[i + 1]}"
        patterns = [p[2:-1] for p in as_list(env["build_src_filter"]) if p.startswith("+<")]
        assert as_list(env["build_src_filter"])[0] == "-<*>", name
        sources = set()
        for pattern in patterns:
            if pattern in GENERATED:
                assert (ROOT / pattern).parent.is_dir()
                assert Path(pattern).name in (ROOT / pattern).parent.joinpath(".gitignore").read_text()
                continue
            found = [p for p in src_dir.glob(pattern) if p.is_file()]
            assert found, f"{name}: build_src_filter +<{pattern}> matches nothing"
            sources.update(found)
        assert any(p.name in ("startup.c", "startup.S") for p in sources), f"{name}: no startup code"
        main = "examples/freertos/main.c" if "freertos" in name else "firmware/runner/runner.c"
        assert ROOT / main in sources, name


def test_engine_sources_match_sources_txt(config):
    want = [f"firmware/colibri_core/{s}" for s in (ROOT / "firmware/colibri_core/sources.txt").read_text().split()]
    core = [p[2:-1] for p in as_list(config["env"]["custom_core_src_filter"])]
    assert core == want
    for name in ENVS:
        filt = [p[2:-1] for p in as_list(config[name]["build_src_filter"]) if "colibri_core" in p]
        assert filt == want, name


@pytest.mark.parametrize("name", [n for n, e in ENVS.items() if e["board_mk"]])
def test_flags_match_board_mk(config, name):
    """The CPU flags and the -D capacities are those of the board's board.mk, as `make firmware` builds."""
    board_mk = ROOT / ENVS[name]["board_mk"]
    env = config[name]
    assert flags(env["custom_cpu_flags"]) == make_var(board_mk, "BOARD_CFLAGS")
    defines = [f for f in flags(env["build_flags"]) if f.startswith("-D") and not f.startswith("-DRUNNER_BUILD_FLAGS")]
    assert sorted(defines) == sorted(make_var(board_mk, "BOARD_DEFS"))


def test_freertos_config_is_static_only():
    cfg = (FREERTOS / "FreeRTOSConfig.h").read_text()
    defines = dict(re.findall(r"^#define\s+(config\w+|INCLUDE_\w+)\s+(.+?)\s*(?:/\*.*)?$", cfg, re.M))
    assert defines["configSUPPORT_STATIC_ALLOCATION"] == "1"
    assert defines["configSUPPORT_DYNAMIC_ALLOCATION"] == "0"
    assert defines["configCHECK_FOR_STACK_OVERFLOW"] == "2"
    assert "configASSERT" in cfg and "configCPU_CLOCK_HZ" in defines and "configTICK_RATE_HZ" in defines
    main = (FREERTOS / "main.c").read_text()
    for needed in ("xTaskCreateStatic", "xQueueCreateStatic", "vApplicationGetIdleTaskMemory",
                   "vApplicationGetTimerTaskMemory", "vApplicationStackOverflowHook", "colibri_forward",
                   "board_uart_write"):
        assert needed in main, needed
    code = re.sub(r"/\*.*?\*/", "", main + (FREERTOS / "meter.c").read_text(), flags=re.S)
    for banned in ("malloc", "calloc", "realloc", "free(", "xTaskCreate(", "xQueueCreate(", "pvPortMalloc"):
        assert banned not in code, banned


def test_freertos_makefile_needs_the_kernel_path():
    env = {k: v for k, v in os.environ.items() if k not in ("FREERTOS_KERNEL_PATH", "MAKEFLAGS", "MFLAGS")}
    r = subprocess.run(["make", "-C", str(FREERTOS)], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode != 0
    assert "FREERTOS_KERNEL_PATH is not set" in r.stderr, r.stderr
    r = subprocess.run(["make", "-C", str(FREERTOS), "FREERTOS_KERNEL_PATH=/nonexistent"], capture_output=True,
                       text=True, env=env, timeout=30)
    assert r.returncode != 0 and "not a FreeRTOS-Kernel checkout" in r.stderr, r.stderr


class History(ctypes.Structure):
    _fields_ = [("mw", ctypes.c_float * 336), ("count", ctypes.c_uint32), ("head", ctypes.c_uint32)]


@pytest.fixture(scope="module")
def meter(tmp_path_factory):
    """examples/freertos/meter.c built for the host (it has no RTOS or board code)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no host C compiler"
    lib_path = tmp_path_factory.mktemp("meter") / "libmeter.so"
    r = subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-Wconversion", "-shared", "-fPIC",
                        str(FREERTOS / "meter.c"), "-o", str(lib_path), "-lm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(lib_path))
    lib.meter_synthetic_mw.restype = ctypes.c_float
    lib.meter_synthetic_mw.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
    lib.meter_history_push.argtypes = [ctypes.POINTER(History), ctypes.c_float]
    lib.meter_build_input.argtypes = [ctypes.POINTER(History), ctypes.c_uint32, ctypes.POINTER(ctypes.c_float),
                                      ctypes.c_size_t]
    return lib


def header_define(name: str) -> str:
    m = re.search(rf"^#define {name} (\S+)", (FREERTOS / "meter.h").read_text(), re.M)
    assert m, name
    return m.group(1)


def test_freertos_input_is_the_forecasters(meter):
    """The C input builder gives forecaster.features() for the same readings, at every time of day."""
    sys.path.insert(0, str(ROOT / "examples" / "smart_meter"))
    import forecaster as F

    assert int(header_define("METER_STEPS_PER_DAY").rstrip("u")) == F.STEPS_PER_DAY
    mean, std = float(header_define("METER_MEAN_MW").rstrip("f")), float(header_define("METER_STD_MW").rstrip("f"))
    # The training statistics as forecaster.dataset() takes them (without building every window).
    taylor = F.load_series()
    train = taylor[: len(taylor) - F.TEST_DAYS * F.STEPS_PER_DAY]
    assert abs(mean - float(train.mean())) < 0.01 and abs(std - float(train.std())) < 0.01, (train.mean(), train.std())

    noise = ctypes.c_uint32(12345)
    series = np.array([meter.meter_synthetic_mw(s, ctypes.byref(noise)) for s in range(F.WEEK + 2 * 48)], np.float32)
    assert 15_000 < series.min() and series.max() < 45_000  # the load curve is in the forecaster's range (MW)

    hist = History()
    meter.meter_history_init(ctypes.byref(hist))
    x = (ctypes.c_float * F.N_FEATURES)()
    checked = 0
    for step, mw in enumerate(series):
        t = step  # readings 0 .. t-1 pushed so far
        if t >= F.WEEK:
            assert meter.meter_build_input(ctypes.byref(hist), t, x, F.N_FEATURES) == 0
            np.testing.assert_allclose(np.array(x, np.float32), F.features(series, t, mean, std), atol=2e-6)
            checked += 1
        else:
            assert meter.meter_build_input(ctypes.byref(hist), t, x, F.N_FEATURES) == -1  # not a week yet
        meter.meter_history_push(ctypes.byref(hist), ctypes.c_float(mw))
    assert checked == 2 * 48
    assert meter.meter_build_input(ctypes.byref(hist), len(series), x, F.N_FEATURES - 1) == -1
