"""The Linux edge service (examples/linux_edge) under test: its build, a running service with its
log, request lines and their parsing, the test models and what the engine answers for them."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import image
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.model import format as F

from helpers.build import ROOT, make

EXAMPLE = ROOT / "examples" / "linux_edge"
MAX_LINE = 1 << 20  # colibri_edge.c
NEEDS_AARCH64 = pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-gcc") is None or shutil.which("qemu-aarch64") is None,
    reason="needs gcc-aarch64-linux-gnu and qemu-user (scripts/setup.sh)")


def edge_image(seed: int) -> bytes:
    """A page-aligned v3 MoE image: two MoE layers, one with a shared expert."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 24), cnn.MoE(24, 5, 32, top_k=2, routing="topk_softmax",
                                                              activation="silu", gated=True),
                              cnn.MoE(24, 4, 16, top_k=1, routing="top1", num_shared=1, shared_hidden=8),
                              torch.nn.Linear(24, 4)).eval()
    return image.write(export(net, None, max_batch=8).graph, page_aligned=True)


def build(variant: str) -> Path:
    r = make("-C", str(EXAMPLE), f"VARIANT={variant}")
    assert r.returncode == 0, r.stdout + r.stderr
    return EXAMPLE / "build" / variant


def request(x: np.ndarray) -> bytes:
    return (";".join(",".join(repr(float(v)) for v in row) for row in x) + "\n").encode()


def parse(answer: bytes, width: int = 4) -> np.ndarray:
    text = answer.decode()
    assert not text.startswith("error"), text
    return np.array([[float(v) for v in row.split(",")] for row in text.strip().split(";")], np.float32).reshape(-1, width)


def expected(data: bytes, x: np.ndarray) -> np.ndarray:
    return colibri.Model(data).forward(x)


def x_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32)


def corrupt_payload(data: bytes) -> bytes:
    """A payload byte of the last tensor flipped: the structure is intact, a per-tensor CRC is not."""
    n_t, t_off = int.from_bytes(data[32:36], "little"), int.from_bytes(data[36:40], "little")
    offset = F.TENSOR.unpack_from(data, t_off + (n_t - 1) * F.TENSOR.size)[0]
    bad = bytearray(data)
    bad[offset] ^= 0x40
    return bytes(bad)


class Lines:
    """Reads whole lines from a pipe or socket without blocking past a deadline."""

    def __init__(self, fd: int, recv=None):
        self.fd, self.recv, self.buf = fd, recv or (lambda: os.read(fd, 65536)), b""

    def line(self, timeout: float = 30) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.fd], [], [], left)[0], f"no answer; have {self.buf[:200]!r}"
            chunk = self.recv()
            assert chunk, f"connection closed; have {self.buf[:200]!r}"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line


class Service:
    def __init__(self, exe: Path, model: Path, log: Path, *args: str, prefix: list[str] | None = None, env=None):
        self.log = log
        self.sock = model.parent / "edge.sock"
        self.proc = subprocess.Popen([*(prefix or []), str(exe), "-s", str(self.sock), *args,
                                      str(exe.parent / "libcolibri.so.0"), str(model)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), env=env)
        self.out = Lines(self.proc.stdout.fileno())
        self.wait_log(r"ready \(colibri ")

    def ask(self, line: bytes) -> bytes:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        return self.out.line()

    def connect(self) -> tuple[socket.socket, Lines]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(self.sock))
        return s, Lines(s.fileno(), lambda: s.recv(65536))

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text(errors="replace")
            if len(re.findall(pattern, text)) >= count:
                return text
            assert self.proc.poll() is None, f"service exited {self.proc.returncode}: {text}"
            assert time.monotonic() < deadline, f"no {pattern!r} in the log: {text}"
            time.sleep(0.02)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0, self.log.read_text()
        assert not self.sock.exists()  # the socket file is removed on the way out
        return self.log.read_text()


def check_error(answer: bytes, status: F.Status, detail: str) -> None:
    m = re.fullmatch(rb"error (-\d+) (.*)", answer)
    assert m, answer
    assert int(m[1]) == status and m[2].decode(errors="replace").startswith(F.STATUS_TEXT[status]), answer
    assert detail in m[2].decode(errors="replace"), answer
