"""colibri_edge under slow, silent and hostile socket clients (issue 25), each case bounded to seconds by
short limits given as options: a client that never reads its answers, or reads them slowly, is held back by
its bounded output buffer (backpressure) and stalls nobody; one that never reads is dropped at the send
timeout, an incomplete request at the request timeout, an idle connection at the idle timeout; at the client
limit the longest idle connection makes room, and with none idle the new one is refused; refusals are logged
at a bounded rate with one line of counts per interval. Reloads only take a model of the same kind and
widths (unless -A). A request line of exactly 1 MiB is served, one byte more is refused."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from colibri import image
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.image import write_atomically
from colibri.model import format as F

from helpers.build import ROOT
from helpers.lmmodels import token_model
from helpers.edge_service import MAX_LINE, Service, check_error, build, expected, parse, request, x_of

LOG_BURST = 3  # colibri_edge.c: lines per kind of event per log interval


@pytest.fixture()
def start(images, tmp_path: Path):
    model = tmp_path / "model.clb"
    write_atomically(model, images[0])
    started = []

    def run(*args: str) -> Service:
        started.append(Service(build("host") / "colibri_edge", model, tmp_path / "edge.log", *args))
        return started[-1]

    yield run
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def flood(socks: list[socket.socket], line: bytes, settle: float = 0.3) -> list[int]:
    """Sends `line` on every socket until none of them takes more for `settle` seconds: the service has stopped
    reading these clients. Returns the requests sent on each."""
    sent = [0] * len(socks)
    for s in socks:
        s.setblocking(False)
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle:
        took = False
        for i, s in enumerate(socks):
            try:
                sent[i] += s.send(line * 256) // len(line)
                took = True
            except BlockingIOError:
                pass
        if took:
            quiet_since = time.monotonic()
        else:
            time.sleep(0.01)
    for s in socks:
        s.setblocking(True)
    return sent


def closed_by_service(sock: socket.socket, timeout: float) -> bool:
    """Whether the service closes this connection within `timeout` (what it had sent is read and dropped)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(1 << 20):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def events(log: str, one: str, counted: str) -> int:
    """How many times an event happened: the lines logged one by one plus the counts of the summary lines."""
    return len(re.findall(one, log)) + sum(int(n) for n in re.findall(counted, log))


def ask(sock_lines, x: np.ndarray) -> bytes:
    sock, lines = sock_lines
    sock.sendall(request(x))
    return lines.line(timeout=10)


def test_clients_that_never_read_stall_nobody_and_are_dropped_at_the_send_timeout(start, images) -> None:
    """8 clients pipeline requests and never read: each has at most -o bytes of answers queued and is no longer
    read. A well-behaved client is served meanwhile, all its answers before any of the silent ones is dropped
    (the old service blocked up to 2 s in a write per silent client); then each silent one goes at -t."""
    svc = start("-o", "4096", "-t", "5000", "-L", "500")
    x = x_of(8, 3)
    silent = [svc.connect()[0] for _ in range(8)]
    # empty requests: each byte a whole request, its answer an 80-byte error line
    assert min(flood(silent, b"\n")) > 0
    good = svc.connect()
    want = expected(images[0], x)
    for _ in range(50):
        np.testing.assert_allclose(parse(ask(good, x)), want, rtol=1e-5, atol=1e-6)
    assert "answers unread" not in svc.log.read_text()  # served while all 8 were still connected
    deadline = time.monotonic() + 20
    while events(svc.log.read_text(), r"dropped a client: answers unread for \d+ ms \(-t\)",
                 r"(\d+) clients dropped: answers unread at the send timeout") < 8:
        assert time.monotonic() < deadline, svc.log.read_text()
        time.sleep(0.1)
    for s in silent:  # what the service had written is still there to read, then the end
        assert closed_by_service(s, 5)
    np.testing.assert_allclose(parse(ask(good, x)), want, rtol=1e-5, atol=1e-6)
    svc.stop()


def test_a_slow_reader_gets_every_answer_in_order_and_starves_nobody(start, images) -> None:
    """A client pipelines 600 requests and drains its answers a little at a time: it is read only while its
    queued answers are under -o, loses none of them, and another client is answered throughout."""
    svc = start("-o", "2048", "-t", "5000")
    xs = [x_of(1, seed) for seed in range(600)]
    slow, slow_lines = svc.connect()
    slow.setblocking(False)
    payload = b"".join(request(x) for x in xs)
    good = svc.connect()
    want_good = expected(images[0], x_of(2, 1))
    received, answered_good = b"", 0
    while payload or received.count(b"\n") < len(xs):
        try:
            payload = payload[slow.send(payload):] if payload else payload
        except BlockingIOError:
            pass
        try:
            received += slow.recv(1024)  # ~20 answers a turn
        except BlockingIOError:
            pass
        np.testing.assert_allclose(parse(ask(good, x_of(2, 1))), want_good, rtol=1e-5, atol=1e-6)
        answered_good += 1
        time.sleep(0.005)
    got = received.split(b"\n")[:-1]
    assert len(got) == len(xs)
    for line, x in zip(got, xs):
        np.testing.assert_allclose(parse(line), expected(images[0], x), rtol=1e-5, atol=1e-6)
    assert answered_good >= 20
    assert "dropped" not in svc.stop()


def test_the_client_limit_evicts_an_idle_client_and_refuses_when_none_is(start, images) -> None:
    """At -c, a newcomer takes the place of the idle client that never sent a byte, else of the one idle the
    longest; with every client in the middle of a request, the newcomer is refused and the others served."""
    svc = start("-c", "3")
    x = x_of(1, 2)
    want = expected(images[0], x)
    a = svc.connect()
    np.testing.assert_allclose(parse(ask(a, x)), want, rtol=1e-5, atol=1e-6)
    time.sleep(0.05)
    silent = svc.connect()  # never sends
    c = svc.connect()
    np.testing.assert_allclose(parse(ask(c, x)), want, rtol=1e-5, atol=1e-6)  # all 3 slots taken
    d = svc.connect()  # the silent one makes room, though `a` has been idle longer
    np.testing.assert_allclose(parse(ask(d, x)), want, rtol=1e-5, atol=1e-6)
    assert closed_by_service(silent[0], 5)
    svc.wait_log(r"evicted a client idle for \d+ ms, silent since it connected, to take a new one \(3 connected, -c\)")
    e = svc.connect()  # now `a`, idle the longest
    np.testing.assert_allclose(parse(ask(e, x)), want, rtol=1e-5, atol=1e-6)
    assert closed_by_service(a[0], 5)
    svc.wait_log(r"evicted a client idle for \d+ ms to take a new one \(3 connected, -c\)")
    # every slot busy with a request in flight (none idle): a newcomer is refused, the others stay served
    for sock, lines in (c, d, e):
        sock.sendall(request(x) + b"1,2,")  # one read: its answer shows the service holds the partial one too
        np.testing.assert_allclose(parse(lines.line()), want, rtol=1e-5, atol=1e-6)
    refused, _ = svc.connect()
    assert closed_by_service(refused, 5)
    svc.wait_log(r"refused a client: 3 connected \(-c\), none idle")
    for sock, lines in (c, d, e):
        sock.sendall(b"3,4,5,6\n")
        np.testing.assert_allclose(parse(lines.line()), expected(images[0], np.array([[1, 2, 3, 4, 5, 6]], np.float32)),
                                   rtol=1e-5, atol=1e-6)
    svc.stop()


def test_idle_and_request_timeouts(start, images) -> None:
    """-i closes a connection with nothing in flight; -r drops one whose request line does not end in time
    (a byte every 100 ms), while a request completed in time is answered. The limits leave room for a busy CI."""
    svc = start("-i", "1000", "-r", "1500")
    x = x_of(1, 5)
    idle, _ = svc.connect()
    assert closed_by_service(idle, 5)
    svc.wait_log(r"dropped a client: idle for \d+ ms \(-i\)")
    answered = svc.connect()
    line = request(x)
    answered[0].sendall(line[:5])
    time.sleep(0.2)
    answered[0].sendall(line[5:])
    np.testing.assert_allclose(parse(answered[1].line()), expected(images[0], x), rtol=1e-5, atol=1e-6)
    trickle, _ = svc.connect()
    closed = False
    for byte in line[:-1] * 4:  # never reaches its newline in time
        try:
            trickle.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.1)
    assert closed or closed_by_service(trickle, 5)
    svc.wait_log(r"dropped a client: request incomplete for \d+ ms \(-r\)")
    svc.stop()


def test_refused_connections_are_logged_at_a_bounded_rate(start) -> None:
    """300 refused connections give at most LOG_BURST lines per interval and a line of counts; nothing is
    lost from the count."""
    svc = start("-c", "1", "-L", "300")
    holder, lines = svc.connect()
    holder.sendall(b"1,2,3,4,5,6\n1,")  # one read: answered, and a request in flight, so never idle
    assert not lines.line().startswith(b"error")
    attempts = 300
    for _ in range(attempts):
        s, _ = svc.connect()
        s.close()
    refused = (r"refused a client: 1 connected", r"(\d+) clients refused \(every slot busy, none idle\)")
    deadline = time.monotonic() + 20
    while events(svc.log.read_text(), *refused) < attempts:
        assert time.monotonic() < deadline, svc.log.read_text()
        time.sleep(0.05)
    log = svc.stop()
    assert events(log, *refused) == attempts, log
    assert "evicted" not in log
    one_by_one = len(re.findall(refused[0], log))
    intervals = len(re.findall(r"in the last \d+\.\d s, not logged one by one", log))
    assert 1 <= intervals and one_by_one <= LOG_BURST * (intervals + 1), log  # +1: the last, unsummarised
    assert len(log.splitlines()) < 40, log


def test_a_request_of_exactly_1_mib_is_served_and_one_byte_more_is_not(start, images) -> None:
    svc = start()
    x = x_of(1, 7)
    want = expected(images[0], x)
    row = request(x).rstrip(b"\n")
    conn = svc.connect()
    exactly = row + b" " * (MAX_LINE - len(row))
    assert len(exactly) == MAX_LINE
    for line in (exactly + b"\n", exactly + b"\r\n"):
        conn[0].sendall(line)
        np.testing.assert_allclose(parse(conn[1].line()), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parse(svc.ask(exactly + b"\n")), want, rtol=1e-5, atol=1e-6)  # stdin too
    for over in (exactly + b" \n", exactly + b" \r\n", exactly + b"\r \n"):
        conn[0].sendall(over)
        check_error(conn[1].line(), F.Status.BUFFER_SIZE, f"request longer than {MAX_LINE} bytes")
    check_error(svc.ask(exactly + b" \n"), F.Status.BUFFER_SIZE, f"request longer than {MAX_LINE} bytes")
    conn[0].sendall(request(x))  # the connection goes on
    np.testing.assert_allclose(parse(conn[1].line()), want, rtol=1e-5, atol=1e-6)
    svc.stop()


def _image_in8() -> bytes:
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), cnn.MoE(16, 4, 16, top_k=1, routing="top1"),
                              torch.nn.Linear(16, 4)).eval()
    return image.write(export(net, None, max_batch=4).graph, page_aligned=True)


def test_reload_refuses_another_kind_or_width_unless_told(start, images, tmp_path) -> None:
    model = tmp_path / "model.clb"
    token = image.write(token_model(1))
    in8 = _image_in8()
    svc = start()
    x = x_of(2, 8)
    want = expected(images[0], x)
    for i, (data, status, detail) in enumerate(
            [(token, F.Status.MODEL_KIND, r"a token model \(vocabulary 40\): this service answers feature rows"),
             (in8, F.Status.BUFFER_SIZE, r"in 8, out 4 where the served model has in 6, out 4; -A allows")], 1):
        write_atomically(model, data)
        svc.proc.send_signal(signal.SIGHUP)
        log = svc.wait_log(r"reload of .* failed", count=i)
        text = re.escape(F.STATUS_TEXT[status])
        assert re.search(rf"reload of .*model\.clb failed: status {int(status)} \({text}\), "
                         rf"{detail}[^()]*: still serving generation 1", log), log
        np.testing.assert_allclose(parse(svc.ask(request(x))), want, rtol=1e-5, atol=1e-6)
    assert "stopping (generation 1)" in svc.stop()

    widen = start("-A")  # told: the new widths are served
    write_atomically(model, in8)
    widen.proc.send_signal(signal.SIGHUP)
    widen.wait_log(r"reloaded .*model\.clb: generation 2, .* in 8, out 4")
    x8 = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(parse(widen.ask(request(x8))), expected(in8, x8), rtol=1e-5, atol=1e-6)
    write_atomically(model, token)  # a token model never: this service has no token endpoint
    widen.proc.send_signal(signal.SIGHUP)
    widen.wait_log(r"reload of .* failed: status -34 .*: still serving generation 2")
    widen.stop()

    r = subprocess.run([str(build("host") / "colibri_edge"), str(build("host") / "libcolibri.so.0"), str(model)],
                       input=b"1\n", capture_output=True, timeout=60)
    assert r.returncode == 1 and r.stdout == b"", r
    assert re.search(rb"model\.clb: status -34 .*a token model", r.stderr), r.stderr


def test_bad_limit_options_are_refused(images, tmp_path) -> None:
    exe = build("host") / "colibri_edge"
    model = tmp_path / "model.clb"
    write_atomically(model, images[0])
    for args, text in ((["-c", "0"], "-c takes a number in 1..100000, not '0'"),
                       (["-o", "-5"], "-o takes a number"), (["-t", "1x"], "-t takes a number"),
                       (["-L", "0"], "-L takes a number in 1..3600000")):
        r = subprocess.run([str(exe), *args, str(exe.parent / "libcolibri.so.0"), str(model)], capture_output=True,
                           timeout=30)
        assert r.returncode == 2 and text in r.stderr.decode(), r.stderr
    r = subprocess.run(["sh", "-c", f"ulimit -n 64; exec {exe} -s {tmp_path}/s.sock -c 100 "
                                    f"{exe.parent / 'libcolibri.so.0'} {model}"], capture_output=True, timeout=30)
    assert r.returncode == 2 and b"-c 100 needs 116 file descriptors, ulimit -n is 64" in r.stderr, r.stderr


@pytest.mark.slow
def test_load_bench_short_run_answers_bit_for_bit_and_the_service_survives() -> None:
    """bench/edge_load.py for 3 s, half the clients hostile (every kind): what is deterministic is checked
    (no wrong answer, the service alive, fds within its client limit; --check makes them the exit status),
    not the latencies."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "edge_load.py"), "--model", "small", "--seconds", "3",
                        "--clients", "10", "--hostile", "0.5", "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    row = re.search(r"^\s+50%\s+5\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)\s+(\d+)\s.*\s(yes|NO.*)$", r.stdout, re.M)
    assert row, r.stdout
    answers, wrong, _, alive = row.groups()
    assert int(answers) > 0 and wrong == "0" and alive == "yes", r.stdout
    assert "idle" in r.stdout and "slow-writer" in r.stdout, r.stdout  # every kind took part
