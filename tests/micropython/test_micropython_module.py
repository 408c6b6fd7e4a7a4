"""The MicroPython module `colibri` in the real MicroPython interpreter.

The x64 native module is built once per session by `colibri natmod build`
(the path a user takes) and imported by the PyPI unix interpreter
(`micropython`, x86-64, the same .mpy ABI as the Cortex-M7 firmware). Both it
and the CPython binding run the same C engine on the same image, with the
engine's own exp, erf and tanh and no fused multiply-add, so with the
reference kernels on both (the natmod has no others; the host's
`reference_kernels=True`) their outputs are the same bits (NaN where the
host has NaN). Numbers printed by the REPL
are compared to 1e-6 relative (they pass through decimal text).

Data moves through files: inputs as raw float32, which `array('f', bytes)`
reads in MicroPython, outputs written back from the arrays' buffers.
Interpreter runs are few and batched, so the whole file stays within seconds.

COLIBRI_MICROPYTHON names another interpreter (tests/micropython/test_micropython_upstream.py
runs this file under MicroPython's unix port built from source, with the .mpy
and with `colibri` compiled in as a user C module: COLIBRI_MICROPYTHON_BUILTIN=1).
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri.runtime.engine import arena_size
from colibri.model.format import STATUS_TEXT, Status
from helpers.build import ROOT
from helpers.micropython import (BUILTIN, ROUTINGS, after, assert_same_bits, make_model, mp_script, repl,
                                 run_mp)
from helpers.nonfinite_inputs import nonfinite_rows
from helpers.quant_models import quickstart_model

pytestmark = pytest.mark.micropython

FORECAST = ROOT / "examples" / "micropython" / "forecast.py"
MAX_BATCH = 4
BATCHES = (1, 3, MAX_BATCH)
DTYPES = {
    "f32": {},
    "f16": {"dtype": "f16"},
    "q8": {"dtype": "q8"},
    "q8-int8-act": {"dtype": "q8", "int8_act": ["layers.*"]},
    "q4": {"dtype": "q4", "group": 8, "compensation": 0.02},
    "q4-int8-act": {"dtype": "q4", "group": 8, "int8_act": ["layers.*"]},
}
SOURCES = ("bytes", "bytearray", "memoryview")


# --------------------------------------------------------------------------- helpers


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """max|Δ| ≤ 1e-6·(1+max|y|): for numbers that went through decimal text (the REPL, print)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(np.abs(got - want).max())
    tol = 1e-6 * (1 + float(np.abs(want).max()))
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


def load_forecast_module():
    """examples/micropython/forecast.py under CPython, for the input it builds."""
    spec = importlib.util.spec_from_file_location("forecast_example", FORECAST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def floats(text: str) -> np.ndarray:
    """Every decimal number in a printed line (MicroPython prints array('f') items as doubles, in full)."""
    return np.array([float(v) for v in re.findall(r"-?\d+\.\d*(?:e[-+]?\d+)?", text)], dtype=np.float64)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """The quickstart model exported at max_batch 16: image 120 KB, arena about 21 KB."""
    path = tmp_path_factory.mktemp("quickstart") / "model.clb"
    colibri.export(quickstart_model(), path, max_batch=16)
    return path


@pytest.fixture(scope="module")
def small_f32(tmp_path_factory) -> Path:
    """A 12 -> 6 f32 model at max_batch 4, for the heap and bad-call runs."""
    path = tmp_path_factory.mktemp("small") / "model.clb"
    colibri.export(make_model("topk_softmax"), path, max_batch=MAX_BATCH)
    return path


# --------------------------------------------------------------------------- 1. outputs equal CPython's

MATRIX_SCRIPT = """
import sys
import colibri
from array import array


def read(path):
    with open(path, "rb") as f:
        return f.read()


def source(data, kind):
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    return data


for line in open(sys.argv[1]):
    case, kind, model_path, in_path = line.split()
    m = colibri.Model(source(read(model_path), kind))
    x = array("f", read(in_path))
    n = len(x) // m.input_size * m.output_size
    y_method = array("f", bytes(4 * n))
    y_function = array("f", bytes(4 * n))
    m.forward(x, y_method)
    colibri.forward(m, x, y_function)
    with open(in_path + ".method", "wb") as f:
        f.write(y_method)
    with open(in_path + ".function", "wb") as f:
        f.write(y_function)
    print("INFO", case, m.num_experts, m.input_size, m.output_size, m.max_batch, m.arena_size)
print("VERSION", colibri.version())
"""


@dataclass
class MatrixRun:
    """One interpreter run over every (dtype, routing, batch) case."""

    folder: Path
    images: dict[str, bytes]
    inputs: dict[str, np.ndarray]
    info: dict[str, list[int]]
    version: str


@pytest.fixture(scope="module")
def matrix(mpy_dir: Path, tmp_path_factory) -> MatrixRun:
    """Every dtype x routing x batch, and the image as bytes, bytearray and memoryview in turn."""
    tmp = tmp_path_factory.mktemp("matrix")
    rng = np.random.default_rng(7)
    images, inputs, lines = {}, {}, []
    for routing in ROUTINGS:
        torch_model = make_model(routing)
        for dtype, options in DTYPES.items():
            name = f"{routing}-{dtype}"
            images[name] = colibri.export(torch_model, tmp / f"{name}.clb", max_batch=MAX_BATCH, **options).image
            for batch in BATCHES:
                # the largest batch carries big inputs, for exp/tanh/erf far into their tails
                x = (rng.standard_normal((batch, 12)) * (8.0 if batch == MAX_BATCH else 1.0)).astype(np.float32)
                case = f"{name}-b{batch}"
                inputs[case] = x
                (tmp / f"{case}.f32").write_bytes(x.tobytes())
                lines.append(f"{case} {SOURCES[len(lines) % 3]} {name}.clb {case}.f32")
    (tmp / "manifest.txt").write_text("\n".join(lines) + "\n")
    script = mp_script(tmp, "matrix.py", MATRIX_SCRIPT)
    r = run_mp(script, "manifest.txt", mpy_dir=mpy_dir, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    info = {ln.split()[1]: [int(v) for v in ln.split()[2:]] for ln in r.stdout.splitlines() if ln.startswith("INFO ")}
    assert len(info) == len(lines), r.stdout
    version = next(ln.split(None, 1)[1] for ln in r.stdout.splitlines() if ln.startswith("VERSION "))
    return MatrixRun(tmp, images, inputs, info, version)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_outputs_equal_cpython_engine(matrix: MatrixRun, routing: str, dtype: str) -> None:
    """Model.forward and colibri.forward in MicroPython give the CPython engine's numbers, at every batch."""
    # The natmod runs the reference kernels (x64 .mpy: no AVX backend): the host must too for the same bits
    # (a user-C-module interpreter runs the default kernels, as the host then does: BUILTIN).
    host = colibri.Model(matrix.images[f"{routing}-{dtype}"], reference_kernels=not BUILTIN)
    for batch in BATCHES:
        case = f"{routing}-{dtype}-b{batch}"
        want = host.forward(matrix.inputs[case])
        for how in ("method", "function"):
            got = np.fromfile(matrix.folder / f"{case}.f32.{how}", dtype=np.float32).reshape(want.shape)
            assert_same_bits(got, want, f"{case} {how}")


@pytest.fixture(scope="module")
def nonfinite(mpy_dir: Path, tmp_path_factory) -> MatrixRun:
    """Every dtype x routing on inputs holding NaN, ±inf, FLT_MAX-scale and subnormal values (alone at
    the first, middle and last position, and as whole rows), through the interpreter in one run."""
    tmp = tmp_path_factory.mktemp("nonfinite")
    x = nonfinite_rows(13, 12, (0, 6, 11))
    images, inputs, lines = {}, {}, []
    for routing in ROUTINGS:
        torch_model = make_model(routing)
        for dtype, options in DTYPES.items():
            name = f"{routing}-{dtype}"
            images[name] = colibri.export(torch_model, tmp / f"{name}.clb", max_batch=MAX_BATCH, **options).image
            for start in range(0, len(x), MAX_BATCH):
                case = f"{name}-r{start}"
                inputs[case] = x[start:start + MAX_BATCH]
                (tmp / f"{case}.f32").write_bytes(inputs[case].tobytes())
                lines.append(f"{case} {SOURCES[len(lines) % 3]} {name}.clb {case}.f32")
    (tmp / "manifest.txt").write_text("\n".join(lines) + "\n")
    r = run_mp(mp_script(tmp, "matrix.py", MATRIX_SCRIPT), "manifest.txt", mpy_dir=mpy_dir, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return MatrixRun(tmp, images, inputs, {}, "")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_nonfinite_inputs_equal_cpython_engine(nonfinite: MatrixRun, routing: str, dtype: str) -> None:
    """NaN stays NaN (ReLU, norms, routers, INT8_ACT), ±inf and overflow as on the host: the same bits."""
    host = colibri.Model(nonfinite.images[f"{routing}-{dtype}"], reference_kernels=not BUILTIN)
    nan_rows = 0
    for case, x in nonfinite.inputs.items():
        if not case.startswith(f"{routing}-{dtype}-r"):
            continue
        want = host.forward(x)
        for how in ("method", "function"):
            got = np.fromfile(nonfinite.folder / f"{case}.f32.{how}", dtype=np.float32).reshape(want.shape)
            assert_same_bits(got, want, f"{case} {how}")
            # A NaN input reaches every output of its row (the first layer mixes it into all): never a number.
            assert np.isnan(got[np.isnan(x).any(axis=1)]).all(), f"{case} {how}: a NaN input gave a number"
        nan_rows += int(np.isnan(x).any(axis=1).sum())
    assert nan_rows >= 4


def test_model_attributes_and_version(matrix: MatrixRun) -> None:
    """The device-side attributes are the engine's model info, as colibri.Model reports it on the host."""
    assert matrix.version == colibri.version()
    for case, got in matrix.info.items():
        host = colibri.Model(matrix.images[case.rsplit("-b", 1)[0]])
        want = [host.num_experts, host.input_size, host.output_size, host.max_batch, host.arena_size]
        assert got == want, case


def test_module_is_the_expected_build(mpy_dir: Path, tmp_path: Path) -> None:
    """`import colibri` finds the native .mpy, or the compiled-in user C module when the interpreter has one."""
    script = mp_script(tmp_path, "origin.py", "import colibri\nprint('FILE', getattr(colibri, '__file__', None))\n")
    r = run_mp(script, mpy_dir=mpy_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    origin = r.stdout.split("FILE ", 1)[1].strip()
    if BUILTIN:
        assert origin == "None", f"expected the built-in module, got {origin}"
    else:
        assert origin.endswith("colibri.mpy"), origin


# --------------------------------------------------------------------------- zero copy, one allocation

ALLOC_SCRIPT = """
import gc
import sys
import colibri
from array import array

with open(sys.argv[1], "rb") as f:
    data = f.read()
buf = bytearray(data)
x = array("f", [0.25] * 48)
y0 = array("f", [0.0] * 24)
y1 = array("f", [0.0] * 24)


def drop(make):
    gc.collect()
    before = gc.mem_free()
    obj = make()
    used = before - gc.mem_free()
    return obj, used


for kind, src in (("bytes", data), ("memoryview", memoryview(data)), ("bytearray", buf)):
    m, used = drop(lambda: colibri.Model(src))
    print("USED", kind, used, m.arena_size, len(data))

# weights are read in place: a change to the buffer after construction shows in the output
m = colibri.Model(buf)
m.forward(x, y0)
off = int(sys.argv[2])
buf[off:off + 4] = bytes.fromhex(sys.argv[3])
m.forward(x, y1)
print("DELTA", repr(y1[0] - y0[0]), max(abs(y1[i] - y0[i]) for i in range(1, 24)))
"""


def test_model_is_zero_copy_with_one_allocation(mpy_dir: Path, quickstart: Path, tmp_path: Path) -> None:
    """Construction allocates the arena (plus the object), never a copy of the 120 KB image; the
    engine reads the caller's buffer in place (a changed bias byte in a bytearray shows at once)."""
    data = quickstart.read_bytes()
    bias = quickstart_model()[-1].bias.detach().numpy().astype("<f4")
    off = data.find(bias.tobytes())
    assert off > 0 and data.find(bias.tobytes(), off + 1) == -1, "the output bias is not unique in the image"
    new = np.array([bias[0] + 1.0], dtype="<f4")
    script = mp_script(tmp_path, "alloc.py", ALLOC_SCRIPT)
    r = run_mp(script, quickstart, off, new.tobytes().hex(), mpy_dir=mpy_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    used = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("USED ")]
    assert [u[1] for u in used] == ["bytes", "memoryview", "bytearray"], r.stdout
    for _, kind, n, arena, image_len in used:
        n, arena, image_len = int(n), int(arena), int(image_len)
        assert image_len > 4 * arena  # so a copy could not hide in the slack below
        assert arena <= n <= arena + 256, f"Model({kind}) allocated {n} B for an arena of {arena} B"
    delta, others = re.search(r"DELTA (\S+) (\S+)", r.stdout).groups()
    assert abs(float(delta) - (float(new[0]) - float(bias[0]))) < 1e-5
    assert float(others) == 0.0


# --------------------------------------------------------------------------- 2. the REPL over stdin

REPL_SESSION = """\
import colibri
from array import array
colibri.version()
m = colibri.Model(open("model.clb", "rb").read())
m
x = array("f", [i / 48 for i in range(48)])
y = array("f", [0.0] * m.output_size)
colibri.forward(m, x, y)
y
m.forward(array("f", [0.0] * 47), y)
m.forward(x, y)
y[23]
"""


def test_repl_session(mpy_dir: Path, quickstart: Path, tmp_path: Path) -> None:
    """What a user types at the board's REPL (examples/micropython/README.md shows this session),
    checked number by number against the host engine, a mistake included."""
    (tmp_path / "model.clb").write_bytes(quickstart.read_bytes())
    out = repl(mpy_dir, tmp_path, REPL_SESSION)
    assert out.startswith("MicroPython "), out
    host = colibri.Model(quickstart, reference_kernels=not BUILTIN)
    assert after(out, "colibri.version()") == f"'{colibri.version()}'\n"
    assert after(out, "m") == (f"<colibri.Model input_size=48 output_size=24 num_experts={host.num_experts} "
                               f"max_batch={host.max_batch} arena_size={host.arena_size}>\n")
    assert after(out, "colibri.forward(m, x, y)") == ""
    want = host.forward((np.arange(48) / 48).astype(np.float32)).astype(np.float64)
    printed = after(out, "y")
    assert printed.startswith("array('f', [") and printed.endswith("])\n"), printed
    assert_close(floats(printed), want, "REPL")
    error = after(out, 'm.forward(array("f", [0.0] * 47), y)')
    assert error.startswith("Traceback (most recent call last):"), error
    assert error.splitlines()[-1].startswith(f"ValueError: colibri: {STATUS_TEXT[Status.BUFFER_SIZE]}"), error
    assert out.count("Traceback") == 1, out
    assert_close(floats(after(out, "y[23]")), want[23:], "REPL after the error")


# --------------------------------------------------------------------------- 3. no allocation, no leak

HEAP_SCRIPT = """
import gc
import sys
import micropython
import colibri
from array import array


def main():
    with open(sys.argv[1], "rb") as f:
        m = colibri.Model(f.read())
    x = array("f", [0.5] * (2 * m.input_size))
    y = array("f", [0.0] * (2 * m.output_size))
    m.forward(x, y)
    colibri.forward(m, x, y)
    gc.collect()
    free0 = gc.mem_free()
    total0 = micropython.mem_total()
    for batch in range(10):
        for i in range(1000):
            m.forward(x, y)
        gc.collect()
    total1 = micropython.mem_total()
    free1 = gc.mem_free()
    print("FREE", free0, free1)
    print("ALLOCATED", total1 - total0)  # bytes through m_malloc: the interpreter's side of the calls
    # any allocation at all, the module's own gc_realloc included, raises MemoryError while locked
    micropython.heap_lock()
    try:
        for i in range(100):
            m.forward(x, y)
            colibri.forward(m, x, y)
            m.input_size + m.output_size + m.max_batch + m.num_experts + m.arena_size
        result = "ok"
    except MemoryError:
        result = "MemoryError"
    micropython.heap_unlock()
    print("LOCKED", result)
    # the model keeps its image and arena alive: nothing else refers to the bytes read above, and
    # blocks freed by mistake would now be reused (and overwritten) by this garbage
    before = list(y)
    junk = []
    for i in range(600):
        junk.append(bytearray(1000))  # zero-filled
    junk = None
    gc.collect()
    m.forward(x, y)
    print("KEPT", list(y) == before)


main()
"""


def test_forward_allocates_nothing(mpy_dir: Path, small_f32: Path, tmp_path: Path) -> None:
    """Ten thousand forwards leave the heap as it was, forward runs with the heap locked, and what a
    model needs stays alive through collections."""
    script = mp_script(tmp_path, "heap.py", HEAP_SCRIPT)
    r = run_mp(script, small_f32, mpy_dir=mpy_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    free0, free1 = map(int, re.search(r"FREE (\d+) (\d+)", r.stdout).groups())
    assert free0 == free1, f"heap free {free0} B before, {free1} B after 10,000 forwards"
    assert re.search(r"ALLOCATED (-?\d+)", r.stdout).group(1) == "0", r.stdout
    assert "LOCKED ok" in r.stdout, r.stdout
    assert "KEPT True" in r.stdout, r.stdout


# --------------------------------------------------------------------------- 4. bad calls

BAD_CALLS_SCRIPT = """
import sys
import colibri
from array import array


def read(path):
    with open(path, "rb") as f:
        return f.read()


data = read(sys.argv[1])
m = colibri.Model(data)
I, O, B = m.input_size, m.output_size, m.max_batch


def f32(n):
    return array("f", [0.5] * n)


corrupt = bytearray(data)
corrupt[len(data) // 2] ^= 0xFF
shifted = bytearray(len(data) + 4)
shifted[1:1 + len(data)] = data


def resized_under_the_model():
    buf = bytearray(data)
    moved = colibri.Model(buf)
    buf.extend(bytes(100000))  # the bytes move; the model must notice, not read freed memory
    moved.forward(f32(I), f32(O))


def array_resized_under_the_model():
    arr = array("B", data)
    moved = colibri.Model(arr)
    arr.extend(bytes(100000))
    moved.forward(f32(I), f32(O))


def view_base_resized_under_the_model():
    # a memoryview keeps the old address, not its bytearray: the resize cannot be seen through it
    buf = bytearray(data)
    moved = colibri.Model(memoryview(buf))
    buf.extend(bytes(100000))
    moved.forward(f32(I), f32(O))

CASES = (
    ("model_int", lambda: colibri.Model(123)),
    ("model_none", lambda: colibri.Model(None)),
    ("model_no_argument", lambda: colibri.Model()),
    ("model_path_string", lambda: colibri.Model("model.clb")),
    ("model_two_arguments", lambda: colibri.Model(data, data)),
    ("model_garbage", lambda: colibri.Model(b"garbage")),
    ("model_bad_magic", lambda: colibri.Model(b"garbage!" * 16)),
    ("model_corrupted", lambda: colibri.Model(corrupt)),
    ("model_truncated", lambda: colibri.Model(data[:len(data) // 2])),
    ("model_misaligned", lambda: colibri.Model(memoryview(shifted)[1:1 + len(data)])),
    ("model_too_big_for_the_heap", lambda: colibri.Model(read(sys.argv[3]))),
    ("model_attribute_store", lambda: setattr(m, "input_size", 5)),
    ("model_unknown_attribute", lambda: getattr(m, "weights")),
    ("forward_list_input", lambda: m.forward([0.5] * I, f32(O))),
    ("forward_list_output", lambda: m.forward(f32(I), [0.0] * O)),
    ("forward_double_input", lambda: m.forward(array("d", [0.5] * I), f32(O))),
    ("forward_int_input", lambda: m.forward(array("i", [1] * I), f32(O))),
    ("forward_double_output", lambda: m.forward(f32(I), array("d", [0.0] * O))),
    ("forward_bytearray_input", lambda: m.forward(bytearray(4 * I), f32(O))),
    ("forward_bytes_output", lambda: m.forward(f32(I), bytes(4 * O))),
    ("forward_ragged_input", lambda: m.forward(f32(I + 1), f32(O))),
    ("forward_empty", lambda: m.forward(f32(0), f32(0))),
    ("forward_batch_too_big", lambda: m.forward(f32(I * (B + 1)), f32(O * (B + 1)))),
    ("forward_output_short", lambda: m.forward(f32(2 * I), f32(O))),
    ("forward_output_long", lambda: m.forward(f32(I), f32(2 * O))),
    ("forward_missing_output", lambda: m.forward(f32(I))),
    ("function_not_a_model", lambda: colibri.forward(data, f32(I), f32(O))),
    ("function_none_model", lambda: colibri.forward(None, f32(I), f32(O))),
    ("function_batch_too_big", lambda: colibri.forward(m, f32(I * (B + 1)), f32(O * (B + 1)))),
    ("forward_image_resized", resized_under_the_model),
    ("forward_array_image_resized", array_resized_under_the_model),
    ("forward_view_base_resized", view_base_resized_under_the_model),
    ("model_view_of_array", lambda: colibri.Model(memoryview(array("B", data)))),
    ("model_view_slice_of_bytearray", lambda: colibri.Model(memoryview(bytearray(data))[0:len(data)])),
)
for name, call in CASES:
    try:
        call()
        print("CASE", name, "NoException", "")
    except Exception as e:
        print("CASE", name, type(e).__name__, repr(str(e)))
    print("ALIVE", name)

# the model is unharmed: a good call after all the bad ones
x = array("f", read(sys.argv[2]))
y = array("f", bytes(4 * O))
m.forward(x, y)
with open(sys.argv[2] + ".out", "wb") as f:
    f.write(y)
print("END")
"""

# name -> (exception type, engine status whose colibri_strerror text the message must carry, or None)
BAD_CALLS: dict[str, tuple[str, Status | None]] = {
    "model_int": ("TypeError", None),
    "model_none": ("TypeError", None),
    "model_no_argument": ("TypeError", None),
    "model_path_string": ("TypeError", None),  # str has the buffer protocol, but a path is not an image
    "model_two_arguments": ("TypeError", None),
    "model_garbage": ("ValueError", Status.TRUNCATED),
    "model_bad_magic": ("ValueError", Status.BAD_MAGIC),
    "model_corrupted": ("ValueError", Status.BAD_CRC),
    "model_truncated": ("ValueError", Status.TRUNCATED),
    "model_misaligned": ("ValueError", Status.IMAGE_ALIGN),
    "model_too_big_for_the_heap": ("MemoryError", None),
    "model_attribute_store": ("AttributeError", None),
    "model_unknown_attribute": ("AttributeError", None),
    "forward_list_input": ("TypeError", None),
    "forward_list_output": ("TypeError", None),
    "forward_double_input": ("TypeError", None),
    "forward_int_input": ("TypeError", None),
    "forward_double_output": ("TypeError", None),
    "forward_bytearray_input": ("TypeError", None),
    "forward_bytes_output": ("TypeError", None),
    "forward_ragged_input": ("ValueError", Status.BUFFER_SIZE),
    "forward_empty": ("ValueError", Status.BUFFER_SIZE),
    "forward_batch_too_big": ("ValueError", Status.BAD_BATCH),
    "forward_output_short": ("ValueError", Status.BUFFER_SIZE),
    "forward_output_long": ("ValueError", Status.BUFFER_SIZE),
    "forward_missing_output": ("TypeError", None),
    "function_not_a_model": ("TypeError", None),
    "function_none_model": ("TypeError", None),
    "function_batch_too_big": ("ValueError", Status.BAD_BATCH),
    "forward_image_resized": ("ValueError", None),
    "forward_array_image_resized": ("ValueError", None),
    # a writable view cannot be guarded (it does not know its base object): refused at construction
    "forward_view_base_resized": ("TypeError", None),
    "model_view_of_array": ("TypeError", None),
    "model_view_slice_of_bytearray": ("TypeError", None),
}


@pytest.fixture(scope="module")
def bad_calls(mpy_dir: Path, small_f32: Path, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Every bad call in one interpreter run; each must raise, print its sentinel and leave the model usable."""
    tmp = tmp_path_factory.mktemp("bad")
    x = np.random.default_rng(5).standard_normal(12).astype(np.float32)
    (tmp / "x.f32").write_bytes(x.tobytes())
    # an arena of tens of MB: more than the interpreter's 2 MB heap
    big = colibri.export(make_model("dense"), tmp / "big.clb", max_batch=65535)
    assert arena_size(big.image) > 8 << 20
    script = mp_script(tmp, "bad.py", BAD_CALLS_SCRIPT)
    r = run_mp(script, small_f32, "x.f32", "big.clb", mpy_dir=mpy_dir, cwd=tmp)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("END"), r.stdout + r.stderr
    got = np.fromfile(tmp / "x.f32.out", dtype=np.float32)
    assert_close(got, colibri.Model(small_f32).forward(x), "forward after the bad calls")
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("CASE "):
            _, name, exc, message = line.split(" ", 3)
            results[name] = (exc, message)
    lines = r.stdout.splitlines()
    for name in results:  # the sentinel right after every case: the interpreter went on
        assert lines[lines.index(f"ALIVE {name}") - 1].startswith(f"CASE {name} "), name
    return results


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_call_raises(bad_calls: dict[str, tuple[str, str]], case: str) -> None:
    """Wrong types raise TypeError, wrong sizes and bad images ValueError with the engine's own words."""
    exc_type, status = BAD_CALLS[case]
    assert case in bad_calls, "the case did not run"
    exc, message = bad_calls[case]
    assert exc == exc_type, f"{case}: {exc} {message}"
    assert message not in ("''", '""'), f"{case}: {exc} without a message"
    if status is not None:
        assert STATUS_TEXT[status] in message, f"{case}: {message}"


# --------------------------------------------------------------------------- the example


def forecast_lines(stdout: str) -> list[str]:
    """The numbers of forecast.py's '+HH:MM  value kW' lines."""
    return re.findall(r"^\+\d\d:\d\d\s+(-?\d+\.\d+) kW$", stdout, re.M)


def test_forecast_example(mpy_dir: Path, quickstart: Path, tmp_path: Path) -> None:
    """examples/micropython/forecast.py prints the CPython engine's 24-step forecast for its curve,
    with the model path as argument and from its default name."""
    r = run_mp(FORECAST, quickstart, mpy_dir=mpy_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    printed = forecast_lines(r.stdout)
    assert len(printed) == 24, r.stdout

    fc = load_forecast_module()
    inp, mean, scale = fc.normalise(fc.load_curve(48))
    y = colibri.Model(quickstart).forward(np.frombuffer(inp, dtype=np.float32))
    want = y.astype(np.float64) * scale + mean
    got = np.array([float(v) for v in printed])
    assert np.abs(got - want).max() <= 1e-6 * (1 + np.abs(want).max()) + 5e-7  # + printing to 6 decimals

    (tmp_path / fc.DEFAULT_MODEL).write_bytes(quickstart.read_bytes())
    default = run_mp(FORECAST, mpy_dir=mpy_dir, cwd=tmp_path)
    assert default.returncode == 0, default.stdout + default.stderr
    assert forecast_lines(default.stdout) == printed


# --------------------------------------------------------------------------- the user C module's build files

MODULE_DIR = ROOT / "micropython_module"
CORE_SOURCES = [(ROOT / "firmware" / "colibri_core" / s).resolve()
                for s in (ROOT / "firmware" / "colibri_core" / "sources.txt").read_text().split()]
# The warnings MicroPython's ports build with, in their C dialect.
MICROPYTHON_CFLAGS = ["-std=gnu99", "-Wall", "-Werror", "-Wextra", "-Wno-unused-parameter", "-Wpointer-arith",
                      "-Wdouble-promotion", "-Wfloat-conversion", "-Os"]


@pytest.mark.cross
def test_micropython_mk_lists_the_engine(tmp_path: Path) -> None:
    """Without a MicroPython checkout, include micropython.mk the way py/py.mk does and check what it adds:
    the binding, every engine source, and include flags under which the engine builds with the ports' flags."""
    (tmp_path / "Makefile").write_text(
        f"USERMOD_DIR := {MODULE_DIR}\n"
        "include $(USERMOD_DIR)/micropython.mk\n"
        "show:\n"
        "\t@echo 'C:' $(SRC_USERMOD_C)\n\t@echo 'LIB:' $(SRC_USERMOD_LIB_C)\n\t@echo 'CFLAGS:' $(CFLAGS_USERMOD)\n")
    r = subprocess.run(["make", "-s", "-C", str(tmp_path), "show"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines())
    assert [Path(p).resolve() for p in lines["C"].split()] == [MODULE_DIR / "colibri_mp.c"]
    assert [Path(p).resolve() for p in lines["LIB"].split()] == CORE_SOURCES
    # the engine under the warnings and C dialect of MicroPython's stm32 port, for the Cortex-M7
    arm = ["arm-none-eabi-gcc", "-mcpu=cortex-m7", "-mthumb", "-mfpu=fpv5-d16", "-mfloat-abi=hard"]
    c = subprocess.run([*arm, *MICROPYTHON_CFLAGS, *lines["CFLAGS"].split(), "-c", *map(str, CORE_SOURCES)],
                       cwd=tmp_path, capture_output=True, text=True)
    assert c.returncode == 0, c.stderr


def test_micropython_cmake_lists_the_engine(tmp_path: Path) -> None:
    """micropython.cmake, included into a stand-in for py/usermod.cmake: an INTERFACE library with the
    binding and every engine source, linked into `usermod`."""
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.12)\nproject(usermod_check NONE)\n"
        "add_library(usermod INTERFACE)\n"
        f"include({MODULE_DIR / 'micropython.cmake'})\n"
        "get_target_property(SOURCES usermod_colibri INTERFACE_SOURCES)\n"
        "get_target_property(INCLUDES usermod_colibri INTERFACE_INCLUDE_DIRECTORIES)\n"
        "get_target_property(LINKED usermod INTERFACE_LINK_LIBRARIES)\n"
        'message(STATUS "SOURCES=${SOURCES}")\nmessage(STATUS "INCLUDES=${INCLUDES}")\n'
        'message(STATUS "LINKED=${LINKED}")\n')
    r = subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "build")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    found = dict(re.findall(r"-- (SOURCES|INCLUDES|LINKED)=(.*)", r.stdout))
    assert [Path(p).resolve() for p in found["SOURCES"].split(";")] == [MODULE_DIR / "colibri_mp.c", *CORE_SOURCES]
    assert [Path(p).resolve() for p in found["INCLUDES"].split(";")] == [ROOT / "firmware" / "colibri_core" / "include"]
    assert found["LINKED"] == "usermod_colibri"
