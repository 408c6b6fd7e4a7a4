"""examples/linux_edge: colibri_edge, the service that dlopens libcolibri.so, maps a model file and answers
line requests on stdin and a Unix socket. Its answers equal the Python engine's; garbage gets the engine's
status and text, never a crash; SIGHUP after a rename serves the new model, a corrupt or missing replacement
leaves the old one serving with the status logged, and requests streaming across a reload each get the old
or the new model's answer, in order. -V full refuses a file with a corrupted expert at start, -V on-use
serves it and answers the requests that reach the expert with -24. The aarch64 build answers under
qemu-aarch64."""
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
from colibri.runtime import engine
from colibri import image
from colibri.model import format as F
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.image import write_atomically

from helpers.build import ROOT, make

from helpers.edge_service import (MAX_LINE, NEEDS_AARCH64, EXAMPLE, Lines, Service, build, check_error, corrupt_payload,  # noqa: F401
                                  expected, parse, request, x_of)


@pytest.fixture()
def service(images, tmp_path: Path):
    model = tmp_path / "model.clb"
    write_atomically(model, images[0])
    started = []

    def start(*args: str) -> Service:
        started.append(Service(build("host") / "colibri_edge", model, tmp_path / "edge.log", *args))
        return started[-1]

    yield model, start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_stdin_and_socket_answer_like_the_python_engine(service, images) -> None:
    model, start = service
    svc = start("-w", "2")
    assert re.search(r"serving .*model\.clb: generation 1, format v3, .* in 6, out 4, max batch 8", svc.log.read_text())
    c1, l1 = svc.connect()
    c2, l2 = svc.connect()
    for n, seed in ((1, 1), (5, 2), (8, 3)):
        x = x_of(n, seed)
        want = expected(images[0], x)
        over_stdin = svc.ask(request(x))
        c1.sendall(request(x))
        c2.sendall(request(x)[:7])  # a request split across writes
        time.sleep(0.01)
        c2.sendall(request(x)[7:])
        assert l1.line() == over_stdin and l2.line() == over_stdin
        np.testing.assert_allclose(parse(over_stdin), want, rtol=1e-5, atol=1e-6)
    # several requests in one write, answered in order, one line each
    xs = [x_of(2, s) for s in range(4)]
    c1.sendall(b"".join(request(x) for x in xs))
    for x in xs:
        np.testing.assert_allclose(parse(l1.line()), expected(images[0], x), rtol=1e-5, atol=1e-6)
    c1.close()
    c2.close()
    svc.stop()


GARBAGE = [
    (b"abc", F.Status.BUFFER_SIZE, "row 1 value 1 is not a number ('abc')"),
    (b"", F.Status.BAD_BATCH, "empty request"),
    (b"1,2,3", F.Status.BUFFER_SIZE, "row 1 has 3 values, the model takes 6"),
    (b"1,2,3,4,5,6,7", F.Status.BUFFER_SIZE, "row 1 has more than 6 values"),
    (b";".join([b"1,2,3,4,5,6"] * 9), F.Status.BAD_BATCH, "more than 8 rows"),
    (b"1,2,3,4,5,6;1,2", F.Status.BUFFER_SIZE, "row 2 has 2 values"),
    (b"1,2,,4,5,6", F.Status.BUFFER_SIZE, "row 1 value 3 is not a number"),
    (b"1 2 3 4 5 6", F.Status.BUFFER_SIZE, "unexpected character"),
    (b"1,2,3\x00,4,5,6", F.Status.BUFFER_SIZE, "NUL byte"),
    (bytes(range(1, 10)) + b"\xff\xfe", F.Status.BUFFER_SIZE, "not a number"),
]


def test_garbage_gets_errors_and_the_service_goes_on(service, images) -> None:
    model, start = service
    svc = start()
    good = x_of(2, 9)
    want = expected(images[0], good)
    conn, lines = svc.connect()
    for line, status, detail in GARBAGE:
        check_error(svc.ask(line + b"\n"), status, detail)
        conn.sendall(line + b"\r\n")  # CRLF clients too
        check_error(lines.line(), status, detail)
    # A line past the limit: one error, its rest skipped up to its newline, then normal service.
    conn.sendall(b"1," * (MAX_LINE // 2 + 1000) + b"1\n" + request(good))
    check_error(lines.line(), F.Status.BUFFER_SIZE, f"request longer than {MAX_LINE} bytes")
    np.testing.assert_allclose(parse(lines.line()), want, rtol=1e-5, atol=1e-6)
    # NaN and infinities are numbers: the engine propagates them
    assert b"nan" in svc.ask(b"nan,inf,-inf,0,0,0\n").lower()
    # A client that leaves mid-line and one that sends random bytes then leaves harm nobody.
    for junk in (b"1,2,3", np.random.default_rng(5).bytes(100_000)):
        c, _ = svc.connect()
        c.sendall(junk)
        c.close()
    np.testing.assert_allclose(parse(svc.ask(request(good))), want, rtol=1e-5, atol=1e-6)
    conn.close()
    svc.stop()


def test_sighup_reloads_a_renamed_file_and_keeps_the_old_model_on_a_bad_one(service, images, tmp_path) -> None:
    model, start = service
    svc = start()
    x = x_of(3, 4)
    old, new = expected(images[0], x), expected(images[1], x)
    conn, lines = svc.connect()
    np.testing.assert_allclose(parse(svc.ask(request(x))), old, rtol=1e-5, atol=1e-6)

    write_atomically(model, images[1])  # the safe update: temporary file, fsync, rename
    svc.proc.send_signal(signal.SIGHUP)
    svc.wait_log(r"reloaded .*model\.clb: generation 2")
    np.testing.assert_allclose(parse(svc.ask(request(x))), new, rtol=1e-5, atol=1e-6)
    conn.sendall(request(x))  # the socket client, connected before the reload, gets the new model too
    np.testing.assert_allclose(parse(lines.line()), new, rtol=1e-5, atol=1e-6)

    # Replacements that must not be served: each is rejected with its status, generation 2 goes on.
    bad = [(corrupt_payload(images[0]), F.Status.BAD_PAYLOAD_CRC),  # structure fine, weights not
           (b"not a model at all, just text\n" * 10, F.Status.BAD_MAGIC),
           (images[0][: len(images[0]) // 2], F.Status.TRUNCATED),
           (None, F.Status.FILE_NOT_FOUND)]
    for i, (data, status) in enumerate(bad, 1):
        if data is None:
            model.unlink()
        else:
            write_atomically(model, data)
        svc.proc.send_signal(signal.SIGHUP)
        log = svc.wait_log(r"reload of .* failed", count=i)
        failure = re.findall(r"reload of .* failed: status (-\d+) \((.*)\)(?:, [^()]*)?: still serving generation (\d+)", log)[-1]
        assert failure == (str(int(status)), F.STATUS_TEXT[status], "2"), log
        np.testing.assert_allclose(parse(svc.ask(request(x))), new, rtol=1e-5, atol=1e-6)
    conn.close()
    assert "stopping (generation 2)" in svc.stop()


def test_requests_streaming_across_reloads_get_whole_answers_in_order(service, images) -> None:
    """The signal only sets a flag: a reload lands between two requests, never inside one."""
    model, start = service
    svc = start("-w", "2")
    x = x_of(4, 6)
    answers = {"old": expected(images[0], x), "new": expected(images[1], x)}
    assert np.allclose(parse(svc.ask(request(x))), answers["old"], rtol=1e-5, atol=1e-6)
    n = 100  # per half: ~50 KB of requests, ~15 KB of answers, within the pipes' buffers
    svc.proc.stdin.write(request(x) * n)
    svc.proc.stdin.flush()
    write_atomically(model, images[1])
    for _ in range(5):  # reloads while requests stream (each after the first reloads the same file)
        svc.proc.send_signal(signal.SIGHUP)
        time.sleep(0.005)
    svc.proc.stdin.write(request(x) * n)  # read only after the pending SIGHUPs were handled
    svc.proc.stdin.flush()
    seen = []
    for _ in range(2 * n):
        got = parse(svc.out.line())
        which = [k for k, v in answers.items() if np.allclose(got, v, rtol=1e-5, atol=1e-6)]
        assert len(which) == 1, got
        seen.append(which[0])
    assert seen[-1] == "new" and seen == sorted(seen, key=lambda k: k == "new")  # never back to the old model
    svc.stop()


@pytest.mark.qemu
@pytest.mark.cross
@NEEDS_AARCH64
def test_aarch64_build_answers_over_stdin_under_qemu(images, tmp_path: Path) -> None:
    b = build("aarch64")
    model = tmp_path / "model.clb"
    write_atomically(model, images[0])
    xs = [x_of(1, 1), x_of(8, 2)]
    r = subprocess.run(["qemu-aarch64", str(b / "colibri_edge"), str(b / "libcolibri.so.0"), str(model)],
                       input=b"".join(request(x) for x in xs) + b"1,2\n", capture_output=True, timeout=120,
                       env={**os.environ, "QEMU_LD_PREFIX": "/usr/aarch64-linux-gnu"})
    assert r.returncode == 0, r.stderr.decode()
    assert b"kernels aarch64 neon" in r.stderr, r.stderr.decode()
    out = r.stdout.splitlines()
    assert len(out) == 3
    for line, x in zip(out, xs):
        np.testing.assert_allclose(parse(line), expected(images[0], x), rtol=1e-4, atol=1e-5)
    check_error(out[2], F.Status.BUFFER_SIZE, "row 1 has 2 values, the model takes 6")


def test_verify_modes_full_refuses_a_corrupt_expert_on_use_answers_its_status(images, tmp_path: Path) -> None:
    """-V full (default) checks every payload before serving; -V on-use opens without reading weights and
    answers a request routed to a corrupted expert with -24, then goes on serving."""
    b = build("host")
    model = tmp_path / "model.clb"
    write_atomically(model, images[0])
    f = engine.open_file(model, verify="none")
    ranges = [f.expert_range(0, e) for e in range(f.experts()[0])]
    del f
    bad = bytearray(images[0])
    for offset, _ in ranges:  # every expert of the first MoE layer: any token routes to one
        bad[offset] ^= 0x40
    write_atomically(model, bytes(bad))
    cmd = [str(b / "colibri_edge"), str(b / "libcolibri.so.0"), str(model)]
    r = subprocess.run(cmd, input=request(x_of(1)), capture_output=True, timeout=60)
    assert r.returncode == 1 and r.stdout == b"", r
    assert re.search(rb"model\.clb: status -24 \(a tensor payload's CRC-32", r.stderr), r.stderr
    r = subprocess.run([cmd[0], "-V", "on-use", *cmd[1:]], input=request(x_of(1)) * 2, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        check_error(line, F.Status.BAD_PAYLOAD_CRC, "")
    assert len(r.stdout.splitlines()) == 2

