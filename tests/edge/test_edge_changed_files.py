"""Issue 25, the engine's half: serving that never hangs, crashes or answers wrong.

A model file that is not a regular file (a FIFO renamed over the model, a device) is refused at
open without blocking, by the POSIX layer, the Python binding and the edge service; a file
truncated in place is FILE_CHANGED for `colibri.LM` as for `colibri.Model` and for the edge
service at any size, 0 bytes included; an image changed under a live context (a file rewritten in
place at the same size, a caller's buffer overwritten) gives wrong numbers or an error status,
never a crash, because every index the engine reads from the image in place is bounded at its use.
Whatever could crash runs in a child interpreter, so a regression fails one test instead of
killing the session."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import image
from colibri.runtime import engine
from colibri import format as F
from colibri import nn as cnn
from colibri.model.errors import ModelFileError
from colibri.frontends.exporter import export
from colibri.image import write_atomically
from colibri.model.format import Status

from helpers.build import ROOT, make
from helpers.lmmodels import token_model
from helpers.micropython import mp_script, run_mp

EDGE = ROOT / "examples" / "linux_edge"
CHILD_TIMEOUT = 120


def _feature_model(seed: int) -> torch.nn.Module:
    """Two MoE layers (top-k and top-1 with a shared expert) between linears: 6 in, 4 out."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 24),
        cnn.MoE(24, 5, 32, top_k=2, routing="topk_softmax", activation="silu", gated=True),
        cnn.MoE(24, 4, 16, top_k=1, routing="top1", num_shared=1, shared_hidden=8),
        torch.nn.Linear(24, 4)).eval()


@pytest.fixture(scope="module")
def f32_images() -> tuple[bytes, bytes]:
    """Two page-aligned v3 images of the same architecture (so the same size), other weights."""
    a, b = (image.write(export(_feature_model(s), None, max_batch=8).graph, page_aligned=True) for s in (11, 12))
    assert len(a) == len(b)
    return a, b


@pytest.fixture(scope="module")
def q8_image() -> bytes:
    """The same model in q8 with a compensation term: row pointers and columns read in place."""
    data = export(_feature_model(11), None, max_batch=8, dtype="q8", compensation=0.05).image
    assert any(t[4] == F.DType.Q8_PARAMS and int.from_bytes(data[t[0]:t[0] + 4], "little") for t in _tensors(data))
    return data


@pytest.fixture(scope="module")
def lm_image() -> bytes:
    return image.write(token_model(3))


def _tensors(data: bytes) -> list[tuple]:
    n_t, t_off = int.from_bytes(data[32:36], "little"), int.from_bytes(data[36:40], "little")
    return [F.TENSOR.unpack_from(data, t_off + i * F.TENSOR.size) for i in range(n_t)]


def _child(code: str, *args) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter: a SIGSEGV or SIGBUS there is a failed assertion here."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, f"child exited {r.returncode} (negative: killed by that signal)\n{r.stdout}\n{r.stderr}"
    return r


# ---- 1. hangs: anything but a regular file is refused at open, without waiting ------------------


def _without_blocking(fn, fifo: Path | None = None, timeout: float = 20.0):
    """fn()'s exception (or None), or a failed test if fn blocks: the FIFO is then opened for writing
    so the stuck thread gets free."""
    outcome: list = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 (handed back to the test)
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{fn} blocked for {timeout} s")
    return outcome[0]


OPENERS = {
    "Model": lambda p: colibri.Model(p),
    "Model(copy=True)": lambda p: colibri.Model(p, copy=True),
    "LM": lambda p: colibri.LM(p),
    "LM(copy=True)": lambda p: colibri.LM(p, copy=True),
    "open_file": lambda p: engine.open_file(p),
    "read_model_file": lambda p: engine.read_model_file(p),
}


@pytest.mark.parametrize("opener", list(OPENERS))
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, opener: str) -> None:
    fifo = tmp_path / "model.clb"
    os.mkfifo(fifo)
    exc = _without_blocking(lambda: OPENERS[opener](fifo), fifo)
    assert isinstance(exc, ModelFileError) and exc.status == Status.FILE_OPEN, repr(exc)
    assert "not a regular file (a FIFO)" in str(exc)


@pytest.mark.parametrize("opener", list(OPENERS))
def test_a_device_or_a_directory_is_refused(tmp_path: Path, opener: str) -> None:
    for path, kind in ((Path("/dev/null"), "device"), (tmp_path, "directory")):
        exc = _without_blocking(lambda: OPENERS[opener](path))
        assert isinstance(exc, ModelFileError) and exc.status == Status.FILE_OPEN, (path, repr(exc))
        assert "not a regular file" in str(exc) and kind in str(exc), str(exc)


# ---- the edge service (examples/linux_edge) ------------------------------------------------------


class Edge:
    """colibri_edge over a model path: requests on stdin, answers on stdout, the log in a file."""

    def __init__(self, model: Path, tmp: Path):
        r = make("-C", str(EDGE), "VARIANT=host")
        assert r.returncode == 0, r.stdout + r.stderr
        exe = EDGE / "build" / "host" / "colibri_edge"
        self.log = tmp / "edge.log"
        self.proc = subprocess.Popen([str(exe), "-s", str(tmp / "edge.sock"), str(exe.parent / "libcolibri.so.0"),
                                      str(model)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "wb"))
        self.buf = b""
        self.wait_log(r"ready \(colibri ")

    def wait_log(self, pattern: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text(errors="replace")
            if re.search(pattern, text):
                return text
            assert self.proc.poll() is None, f"service exited {self.proc.returncode}: {text}"
            assert time.monotonic() < deadline, f"no {pattern!r} in the log: {text}"
            time.sleep(0.02)

    def ask(self, x: np.ndarray, timeout: float = 30) -> bytes:
        self.proc.stdin.write((";".join(",".join(repr(float(v)) for v in row) for row in x) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        import select

        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([fd], [], [], left)[0], f"no answer: {self.log.read_text()}"
            chunk = os.read(fd, 65536)
            assert chunk, f"service closed its output (exit {self.proc.poll()}): {self.log.read_text()}"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=20) == 0, self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture()
def edge(tmp_path: Path, f32_images):
    model = tmp_path / "model.clb"
    write_atomically(model, f32_images[0])
    svc = Edge(model, tmp_path)
    yield model, svc
    svc.kill()


def _x(n: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32)


def _answer(line: bytes) -> np.ndarray:
    text = line.decode()
    assert not text.startswith("error"), text
    return np.array([[float(v) for v in row.split(",")] for row in text.split(";")], np.float32)


def test_edge_refuses_a_fifo_renamed_over_its_model_and_still_answers_sigterm(edge, f32_images) -> None:
    model, svc = edge
    fifo = model.with_name("incoming.clb")
    os.mkfifo(fifo)
    os.replace(fifo, model)
    svc.proc.send_signal(signal.SIGHUP)
    svc.wait_log(r"reload of .*model\.clb failed: status -26 .*: still serving generation 1")
    np.testing.assert_allclose(_answer(svc.ask(_x())), colibri.Model(f32_images[0]).forward(_x()), rtol=1e-5,
                               atol=1e-6)
    svc.stop()


@pytest.mark.parametrize("size", [0, 4096, "half"])
def test_edge_answers_file_changed_for_a_file_truncated_in_place(edge, f32_images, size) -> None:
    model, svc = edge
    svc.ask(_x())
    os.truncate(model, len(f32_images[0]) // 2 if size == "half" else size)
    line = svc.ask(_x(2, 1)).decode()
    assert line.startswith(f"error {int(Status.FILE_CHANGED)} "), line
    svc.wait_log(r"changed size under its mapping")
    svc.stop()


# ---- 3. LM over a file truncated in place -------------------------------------------------------


@pytest.mark.parametrize("verify", ["full", "none"])
def test_lm_over_a_file_truncated_in_place_is_file_changed(tmp_path: Path, lm_image: bytes, verify: str) -> None:
    path = tmp_path / "lm.clb"
    path.write_bytes(lm_image)
    r = _child("""
        import os, sys
        import colibri
        from colibri.model.errors import ModelFileError
        from colibri.model.format import Status
        path, verify = sys.argv[1], sys.argv[2]
        for size in (0, 4096, os.path.getsize(path) // 2):
            with open(path, "r+b") as fh:
                original = fh.read()
            lm = colibri.LM(path, verify=verify)
            want = lm.generate([1, 2, 3], 4)
            os.truncate(path, size)
            for call in (lambda: lm.forward_tokens([1, 2]), lambda: lm.generate([1, 2, 3], 4),
                         lambda: list(lm.stream([1, 2], 3))):
                try:
                    call()
                except ModelFileError as exc:
                    assert exc.status == Status.FILE_CHANGED, exc
                else:
                    raise AssertionError("no FILE_CHANGED")
            with open(path, "r+b") as fh:  # the same size again: the mapping reads the bytes back
                fh.write(original)
            assert lm.generate([1, 2, 3], 4) == want
            print("ok", size)
    """, path, verify)
    assert r.stdout.count("ok") == 3, r.stdout


# ---- 4. an image changed under a live context: wrong numbers at worst, never a crash ------------


def _same_size_rewrites(data: bytes, other: bytes | None) -> dict[str, bytes]:
    """Images of len(data) bytes that a file rewritten in place (or a buffer overwritten) could hold:
    the tables read in place (expert maps: I32; q8 row pointers and columns: Q8_PARAMS) set to
    out-of-range values, the record tables scrambled, everything but the header random, another
    valid model."""
    tensors = _tensors(data)
    out: dict[str, bytes] = {}

    def fill(what: str, dtype: int, word: bytes, skip: int = 0) -> None:
        b = bytearray(data)
        for t in tensors:
            if t[4] == dtype:
                start, end = t[0] + skip, t[0] + t[1]
                b[start:end] = (word * ((end - start) // len(word) + 1))[: end - start]
        out[what] = bytes(b)

    fill("expert maps past the experts", F.DType.I32, (0x40000000).to_bytes(4, "little"))
    fill("expert maps all pruned", F.DType.I32, b"\xff\xff\xff\xff")
    fill("expert maps all slot 0", F.DType.I32, bytes(4))
    fill("expert maps negative", F.DType.I32, (0x80000001).to_bytes(4, "little"))
    fill("q8 companions all ones", F.DType.Q8_PARAMS, b"\xff", skip=8)
    fill("q8 companions 0x7f", F.DType.Q8_PARAMS, b"\x7f", skip=8)
    rng = np.random.default_rng(0)
    header = F.HEADER.unpack_from(data)
    for name, count, offset, size in (("tensor", header[9], header[10], F.TENSOR.size),
                                      ("layer", header[11], header[12], F.LAYER.size),
                                      ("moe", header[13], header[14], F.MOE.size),
                                      ("expert", header[15], header[16], F.EXPERT.size)):
        b = bytearray(data)
        b[offset:offset + count * size] = rng.integers(0, 256, count * size, dtype=np.uint8).tobytes()
        out[f"{name} table random"] = bytes(b)
    for seed in range(3):
        b = bytearray(data)
        b[F.HEADER_SIZE:] = np.random.default_rng(seed).integers(0, 256, len(data) - F.HEADER_SIZE,
                                                                 dtype=np.uint8).tobytes()
        out[f"random after the header ({seed})"] = bytes(b)
    out["all zero"] = bytes(len(data))
    if other is not None:
        out["another valid model"] = other
    return out


REWRITE_CHILD = """
    import sys
    import numpy as np
    import colibri
    from colibri.model.errors import ColibriError
    path, verify, original, *mutations = sys.argv[1:]
    original = open(original, "rb").read()
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    for mutation in mutations:
        with open(path, "r+b") as fh:
            fh.write(original)
        m = colibri.Model(path, verify=verify)
        before = m.forward(x)
        with open(path, "r+b") as fh:  # in place: the mapping sees the new bytes
            fh.write(open(mutation, "rb").read())
        outcome = []
        for rows in (x, x[:1], x[3:5]):
            try:
                y = m.forward(rows)
                outcome.append("finite" if np.isfinite(y).all() else "nonfinite")
            except ColibriError as exc:
                outcome.append(f"status {int(exc.status)}")
        print("survived", mutation, outcome)
"""


@pytest.mark.parametrize("verify", ["on_use", "full", "none"])
@pytest.mark.parametrize("dtype", ["f32", "q8"])
def test_a_file_rewritten_in_place_gives_numbers_or_a_status_never_a_crash(tmp_path: Path, f32_images, q8_image,
                                                                           verify: str, dtype: str) -> None:
    data, other = (f32_images[0], f32_images[1]) if dtype == "f32" else (q8_image, None)
    path, original = tmp_path / "model.clb", tmp_path / "original.clb"
    path.write_bytes(data)
    original.write_bytes(data)
    files = []
    for i, (what, bytes_) in enumerate(_same_size_rewrites(data, other).items()):
        assert len(bytes_) == len(data), what
        files.append(tmp_path / f"rewrite{i}.clb")
        files[-1].write_bytes(bytes_)
    r = _child(REWRITE_CHILD, path, verify, original, *files)
    assert r.stdout.count("survived") == len(files), r.stdout


def test_a_buffer_overwritten_under_a_context_gives_numbers_never_a_crash(tmp_path: Path, f32_images,
                                                                         q8_image) -> None:
    """The same for a buffer the caller owns and the engine reads in place: an engine context over a
    bytearray (colibri.Model copies bytes it is given; the binding's Context, as libcolibri's
    callers, does not)."""
    r = _child("""
        import sys
        import numpy as np
        from colibri.runtime import _engine
        x = np.random.default_rng(0).standard_normal(8 * 6).astype(np.float32)
        out = np.empty(8 * 4, np.float32)
        for path in sys.argv[1:]:
            rewrites = np.load(path)
            for name in rewrites.files:
                buf = bytearray(rewrites["original"].tobytes())
                ctx = _engine.Context(buf)
                ctx.forward(x, out, 8)
                before = out.copy()
                buf[:] = rewrites[name].tobytes()
                try:
                    ctx.forward(x, out, 8)
                    print("survived", name, "same" if np.array_equal(out, before, equal_nan=True) else "changed")
                except _engine.EngineError as exc:
                    print("survived", name, "status", exc.args[0])
    """, *_npz_of_rewrites(tmp_path, f32_images, q8_image))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("survived")]
    assert len(lines) == 2 * (len(_same_size_rewrites(q8_image, None)) + 1) + 1, r.stdout
    # the buffer is read in place: a rewrite of the expert maps changes the answer
    assert any(ln.startswith("survived expert maps all slot 0 changed") for ln in lines), r.stdout


def _npz_of_rewrites(tmp: Path, f32_images, q8_image) -> list[Path]:
    paths = []
    for i, (data, other) in enumerate(((f32_images[0], f32_images[1]), (q8_image, None))):
        arrays = {k: np.frombuffer(v, np.uint8) for k, v in _same_size_rewrites(data, other).items()}
        paths.append(tmp / f"rewrites{i}.npz")
        np.savez(paths[-1], original=np.frombuffer(data, np.uint8), **arrays)
    return paths


MP_REWRITE = """
import sys
import colibri
from array import array

with open(sys.argv[1], "rb") as f:
    original = f.read()
x = array("f", [0.25, -1.0, 0.5, 2.0, -0.75, 1.5] * 8)
y = array("f", [0.0] * 32)
for path in sys.argv[2:]:
    with open(path, "rb") as f:
        new = f.read()
    buf = bytearray(original)
    m = colibri.Model(buf)
    m.forward(x, y)
    buf[0:len(new)] = new  # the caller's buffer, overwritten in place under the live model
    try:
        m.forward(x, y)
        print("survived", path, "numbers")
    except Exception as exc:
        print("survived", path, "raised", exc)
"""


def test_a_micropython_bytearray_overwritten_under_a_model_never_crashes(tmp_path: Path, mpy_dir: Path, f32_images,
                                                                         q8_image) -> None:
    script = mp_script(tmp_path, "rewrite.py", MP_REWRITE)
    for n, (data, other) in enumerate(((f32_images[0], f32_images[1]), (q8_image, None))):
        original = tmp_path / f"original{n}.clb"
        original.write_bytes(data)
        files = []
        for i, bytes_ in enumerate(_same_size_rewrites(data, other).values()):
            files.append(tmp_path / f"rewrite{n}_{i}.clb")
            files[-1].write_bytes(bytes_)
        r = run_mp(script, original, *files, mpy_dir=mpy_dir, cwd=tmp_path)
        assert r.returncode == 0, f"micropython exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        assert r.stdout.count("survived") == len(files), r.stdout
