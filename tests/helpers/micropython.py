"""The MicroPython interpreter the module tests run, the x64 colibri.mpy it imports (built once a run),
and running scripts and REPL sessions in it."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from colibri import nn as cnn

COLIBRI = str(Path(sys.executable).parent / "colibri")


# The MicroPython interpreter the tests run: the PyPI unix build, or one named by COLIBRI_MICROPYTHON
# (tests/micropython/test_micropython_upstream.py runs these tests again under MicroPython's unix port built from
# source, with and without `colibri` compiled in as a user C module).
MICROPYTHON = Path(os.environ.get("COLIBRI_MICROPYTHON") or Path(sys.executable).parent / "micropython")


def shared_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per pytest run that every xdist worker sees, so each .mpy is built once a run."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "natmod-build"
    root.mkdir(exist_ok=True)
    return root


def build_mpy(arch: str, root: Path) -> Path:
    """`colibri natmod build --arch ARCH -o ...`, the user's command; under a lock, so that parallel
    workers build each architecture once and never read a half-written file."""
    out = root / arch / "colibri.mpy"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            out.parent.mkdir(exist_ok=True)
            r = subprocess.run([COLIBRI, "natmod", "build", "--arch", arch, "-o", str(out)],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            assert out.exists(), r.stdout + r.stderr
    return out


# COLIBRI_MICROPYTHON_BUILTIN=1: the interpreter has `colibri` compiled in as a user C module (it then
# shadows the .mpy on MICROPYPATH), built with the host's default kernels (x86-64: the AVX backend, as
# the CPython binding's default), so the bit-for-bit comparisons use the host's default kernels too.
BUILTIN = os.environ.get("COLIBRI_MICROPYTHON_BUILTIN") == "1"


# routing -> (activation before the norm, expert activation, gated, norm, shared experts):
# every activation the engine has runs somewhere, through the natmod's own math functions.
ROUTINGS = {
    "top1": ("relu", "gelu", False, torch.nn.LayerNorm, 0),
    "topk_softmax": ("tanh", "silu", True, torch.nn.RMSNorm, 1),
    "softmax_topk": ("sigmoid", "gelu_tanh", False, torch.nn.LayerNorm, 1),
    "dense": ("gelu_tanh", "tanh", True, torch.nn.RMSNorm, 1),
}


def run_mp(script: Path | None, *args: str | int | Path, mpy_dir: Path, cwd: Path, flags: tuple[str, ...] = (),
           stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs the interpreter on a script (or `-i` with stdin) with the built module on MICROPYPATH."""
    cmd = [str(MICROPYTHON), *flags, *([str(script)] if script else []), *map(str, args)]
    env = dict(os.environ, MICROPYPATH=str(mpy_dir))
    return subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout)


def mp_script(tmp: Path, name: str, code: str) -> Path:
    """Writes a MicroPython script next to its data (the interpreter puts the script's folder on sys.path)."""
    path = tmp / name
    path.write_text(code)
    return path


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The host engine's float32 bits, and NaN exactly where it has NaN."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    nan = np.isnan(want)
    diff = np.flatnonzero((np.isnan(got) != nan) | (~nan & (got.view(np.uint32) != want.view(np.uint32))))
    assert not len(diff), (f"{what}: {len(diff)} of {got.size} outputs differ, first at {diff[0]}: "
                           f"{got.flat[diff[0]]!r} != {want.flat[diff[0]]!r}")


def make_model(routing: str, seed: int = 0) -> torch.nn.Module:
    """A small model (d ≤ 16) whose layers and activations depend on the routing mode."""
    pre, act, gated, norm, shared = ROUTINGS[routing]
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16),
        cnn.make_activation(pre),
        norm(16),
        cnn.Residual(cnn.MoE(16, 4, 24, top_k=2, routing=routing, renormalize=routing == "softmax_topk",
                             gated=gated, activation=act, num_shared=shared, shared_gate=bool(shared))),
        torch.nn.Linear(16, 6),
    ).eval()


def repl(mpy_dir: Path, cwd: Path, session: str) -> str:
    """Feeds a session to `micropython -i` on stdin. Piped stdin without -i runs as a script, silently;
    with -i this build prints the banner and echoes every line after its '>>> ' prompt, as at a terminal."""
    r = run_mp(None, mpy_dir=mpy_dir, cwd=cwd, flags=("-i",), stdin=session)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def after(transcript: str, line: str) -> str:
    """What the REPL printed in answer to one input line."""
    return transcript.split(f">>> {line}\n", 1)[1].split(">>> ", 1)[0]
