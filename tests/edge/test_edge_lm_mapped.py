"""Token models on the edge runtime (issue 27): `colibri.LM(path)` opens by structure, checks the tensors
every token reads at open and each expert's payloads on first use, advises the routed experts' pages and
the next stages' through the POSIX layer (colibri_file_on_route), pins with `lock=` and serves unpinned
when asked to where mlock is refused, and keeps serving a file replaced by rename."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image, reference
from colibri.image import writer
from colibri.model import format as F
from colibri.model.errors import ColibriError
from colibri.model.format import Status
from colibri.model.ir import MoE
from colibri.runtime import engine

from helpers.cli import COLIBRI
from helpers.lmmodels import token_model

PAGE = F.PAGE_SIZE
PROMPT = [3, 17, 5, 29, 11, 2, 38, 7]


@pytest.fixture(scope="module")
def graph():
    return token_model(5, vocab=40, d=16, layers=4, experts=4, hidden=24, max_seq_len=32)


@pytest.fixture(scope="module")
def paged(graph) -> bytes:
    return image.write(graph, page_aligned=True)


def _write(tmp_path: Path, data: bytes, name: str = "lm.clb") -> Path:
    path = tmp_path / name
    image.write_atomically(path, data)
    return path


def _tensors(data: bytes) -> list[tuple]:
    n_t, t_off = int.from_bytes(data[32:36], "little"), int.from_bytes(data[36:40], "little")
    return [F.TENSOR.unpack_from(data, t_off + i * F.TENSOR.size) for i in range(n_t)]


def _corrupt(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x5A
    return bytes(out)


def _mapped_rss(path: Path) -> int:
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _expert_pages(f: engine.ModelFile) -> int:
    ranges = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    return sum(-(-(off + size) // PAGE) - off // PAGE for off, size in ranges) * PAGE


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_default_open_reads_no_expert_page(paged: bytes, tmp_path: Path) -> None:
    """From a cold page cache (mincore of the mapping: the page cache, which the kernel's fault-around
    would blur in the process's RSS), the default open reads the tables and the every-token tensors,
    never an expert's page; one token reads only its routed experts and the shared ones."""
    path = _write(tmp_path, paged)
    _drop(path)
    probe = engine.open_file(path, verify="none")
    experts = _expert_pages(probe)
    assert experts > len(paged) // 2  # the model is mostly experts, so the bounds below mean something
    if probe.resident() > len(paged) - experts:
        pytest.skip("posix_fadvise(DONTNEED) did not drop this file's pages (tmpfs?)")
    del probe
    lm = colibri.LM(path)
    assert lm.file.resident() <= len(paged) - experts + PAGE
    lm.forward_tokens(PROMPT[:1])
    sizes = [size for layer, n in enumerate(lm.file.experts()) for _, size in
             (lm.file.expert_range(layer, e) for e in range(n))]
    # top-2 of 4 and one shared expert in two layers, the one expert of the other two
    assert lm.file.resident() <= len(paged) - experts + PAGE + 8 * (max(sizes) + PAGE)
    lm.file.verify()
    assert lm.file.resident() >= len(paged) - PAGE


def test_default_logits_equal_full_and_copy(paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    want = colibri.LM(paged).forward_tokens(PROMPT)
    for opts in ({}, {"verify": "full"}, {"verify": "none", "advise": False}, {"workers": 2}, {"ahead": 0}):
        np.testing.assert_array_equal(colibri.LM(path, **opts).forward_tokens(PROMPT), want, err_msg=str(opts))
    with pytest.raises(ValueError, match="advise=False"):
        colibri.LM(path, advise=False)


def _routing(graph, ids) -> list[tuple[int, list[int], list[int]]]:
    """The engine's on_route calls the reference's routing implies: per MoE layer, the expert records
    selected (routed slots with tokens, in slot order, then the shared ones) and each one's token count."""
    moes = [layer for layer in graph.layers if isinstance(layer, MoE)]
    first, at = {}, 0
    for i, moe in enumerate(moes):
        first[id(moe)] = (i, at, len(moe.experts))
        at += len(moe.experts) + len(moe.shared)
    calls = []

    def on_route(moe, selection) -> None:
        layer, base, n = first[id(moe)]
        counts = [0] * n
        for token in selection:
            for slot, weight in token:
                if weight != 0:
                    counts[slot] += 1
        records = [base + s for s in range(n) if counts[s]] + [base + n + j for j in range(len(moe.shared))]
        calls.append((layer, records, [c for c in counts if c] + [len(selection)] * len(moe.shared)))

    reference.LMState(graph).forward_tokens(ids, on_route=on_route)
    return calls


@pytest.mark.parametrize("workers", [1, 2])
def test_on_route_sees_the_reference_routing_and_advice_is_recorded(graph, paged: bytes, tmp_path: Path,
                                                                    workers: int) -> None:
    path = _write(tmp_path, paged)
    lm = colibri.LM(path, workers=workers)
    seen = []
    lm.forward_tokens(PROMPT, on_route=lambda layer, experts, tokens: seen.append((layer, experts, tokens)))
    assert seen == _routing(graph, PROMPT)
    advice = lm.file.advice()
    assert advice["route_calls"] == sum(len(experts) for _, experts, _ in seen)
    # One token more: every MoE layer advised the next stage's merged ranges (one stage ahead by default).
    stages = len(lm.file.experts()) + 1
    ranges = [lm.file.ahead_ranges(s) for s in range(stages)]
    before = lm.file.advice()
    lm.forward_tokens([int(np.argmax(lm.forward_tokens([1])[-1]))])
    after = lm.file.advice()
    per_token = sum(len(ranges[(layer + 1) % stages]) for layer in range(stages - 1))
    assert after["ahead_calls"] - before["ahead_calls"] == 2 * per_token
    assert after["ahead_bytes"] - before["ahead_bytes"] == 2 * sum(
        end - start for layer in range(stages - 1) for start, end in ranges[(layer + 1) % stages])


def test_ahead_ranges_cover_every_tensor_but_experts_and_the_embedding(graph, paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    f = engine.open_file(path)
    stages = len(f.experts()) + 1
    moes = [layer for layer in graph.layers if isinstance(layer, MoE)]

    def covered(stage: int, offset: int, nbytes: int) -> bool:
        return any(start <= offset and offset + nbytes <= end for start, end in f.ahead_ranges(stage))

    for layer, moe in enumerate(moes):  # a layer's shared experts are advised with its stage
        for j in range(len(moe.shared)):
            assert covered(layer, *f.expert_range(layer, len(moe.experts) + j))
    expert_spans = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    tensors = _tensors(paged)
    for t in tensors[1:]:  # tensor 0 is the embedding table: a token reads one row of it
        off, nbytes = t[0], t[1]
        if not any(o <= off < o + size for o, size in expert_spans):
            assert any(covered(s, off, nbytes) for s in range(stages)), t
    with pytest.raises(ColibriError):
        f.ahead_ranges(stages)
    lm = colibri.LM(path, ahead=0)
    lm.forward_tokens(PROMPT)
    assert lm.file.advice()["ahead_calls"] == 0
    assert lm.file.advice()["route_calls"] > 0


def _first_routed(graph, ids) -> tuple[int, int]:
    """(MoE layer, routed slot) the first token's routing selects first."""
    layer, records, _ = _routing(graph, ids[:1])[0]
    return layer, records[0]


def test_a_corrupted_expert_is_bad_payload_crc_on_first_use(graph, paged: bytes, tmp_path: Path) -> None:
    layer, slot = _first_routed(graph, PROMPT)
    f = engine.open_file(_write(tmp_path, paged, "clean.clb"))
    off, size = f.expert_range(layer, slot)
    bad = _corrupt(paged, off + size // 2)
    path = _write(tmp_path, bad)
    lm = colibri.LM(path)  # the tables and every-token tensors are intact: it opens
    with pytest.raises(ColibriError) as err:
        lm.forward_tokens(PROMPT[:1])
    assert err.value.status == Status.BAD_PAYLOAD_CRC
    assert lm.position == 0  # nothing appended
    with pytest.raises(ColibriError) as err:
        colibri.LM(path, verify="full")
    assert err.value.status == Status.BAD_PAYLOAD_CRC
    # The same expert of a feature model's file gives the same status: the file layer's, shared by both.
    with pytest.raises(ColibriError) as err:
        engine.open_file(path).verify_expert(layer, slot)
    assert err.value.status == Status.BAD_PAYLOAD_CRC
    colibri.LM(path, verify="none").forward_tokens(PROMPT[:1])  # no check asked: it runs


def test_an_unselected_corrupted_expert_never_stops_decoding(graph, paged: bytes, tmp_path: Path) -> None:
    used = {(layer, r) for layer, records, _ in _routing(graph, PROMPT[:1]) for r in records}
    f = engine.open_file(_write(tmp_path, paged, "clean.clb"))
    first = 0
    unused = None
    for layer, n in enumerate(f.experts()):
        for slot in range(n):
            if (layer, first + slot) not in used:
                unused = (layer, slot)
        first += n
    assert unused is not None
    off, size = f.expert_range(*unused)
    lm = colibri.LM(_write(tmp_path, _corrupt(paged, off + size - 1)))
    np.testing.assert_array_equal(lm.forward_tokens(PROMPT[:1]), colibri.LM(paged).forward_tokens(PROMPT[:1]))


def test_every_corrupted_tensor_that_is_no_experts_is_caught_at_open(paged: bytes, tmp_path: Path) -> None:
    """Embeddings, attention, norms, routers, the head: each corrupted in turn is BAD_PAYLOAD_CRC from the
    default open, before any forward reads it."""
    f = engine.open_file(_write(tmp_path, paged, "clean.clb"))
    expert_spans = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    checked = 0
    for t in _tensors(paged):
        off, nbytes = t[0], t[1]
        if nbytes == 0 or any(o <= off < o + size for o, size in expert_spans):
            continue
        path = _write(tmp_path, _corrupt(paged, off + nbytes // 2))
        with pytest.raises(ColibriError) as err:
            colibri.LM(path)
        # An expert map is also checked for what it is (a permutation): the structure check sees it first.
        want = Status.BAD_MOE if t[4] == F.DType.I32 else Status.BAD_PAYLOAD_CRC
        assert err.value.status == want, t
        checked += 1
    assert checked >= 4 * 8  # per layer two norms, q k v o, a router; the embedding, the final norm, the head


@pytest.mark.parametrize("verify", ["on_use", "full", "none"])
def test_truncated_under_an_open_lm_is_file_changed_before_a_page_is_touched(paged: bytes, tmp_path: Path,
                                                                            verify: str) -> None:
    path = _write(tmp_path, paged)
    lm = colibri.LM(path, verify=verify)
    os.truncate(path, len(paged) // 2)
    resident = _mapped_rss(path)
    for call in (lambda: lm.forward_tokens(PROMPT), lambda: lm.generate(PROMPT, 4)):
        with pytest.raises(ColibriError) as err:
            call()
        assert err.value.status == Status.FILE_CHANGED
    assert _mapped_rss(path) == resident  # refused before any page past the check was read
    with pytest.raises(ColibriError) as err:
        colibri.LM(path)
    assert err.value.status == Status.TRUNCATED


def test_replaced_by_rename_during_decode_keeps_serving(graph, paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    want = colibri.LM(paged).generate(PROMPT, 12)
    lm = colibri.LM(path)
    stream = lm.stream(PROMPT, 12)
    got = [next(stream) for _ in range(4)]
    assert not lm.file.replaced()
    image.write_atomically(path, image.write(token_model(9, vocab=40, d=16, layers=4, experts=4, hidden=24,
                                                         max_seq_len=32), page_aligned=True))
    got += list(stream)
    assert got == want  # the old mapping served every token
    assert lm.file.replaced()
    fresh = colibri.LM(path)  # a reopen maps the new file
    assert not fresh.file.replaced()
    assert not np.array_equal(fresh.forward_tokens(PROMPT), colibri.LM(paged).forward_tokens(PROMPT))


def _limited(code: str) -> subprocess.CompletedProcess:
    """Runs code in a child whose RLIMIT_MEMLOCK is one page and, as root, without CAP_IPC_LOCK."""
    code = "import resource\nresource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, 4096))\n" + textwrap.dedent(code)
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0 and shutil.which("capsh"):  # root's CAP_IPC_LOCK ignores the limit: drop it
        cmd = ["capsh", "--drop=cap_ipc_lock", "--", "-c", shlex.join(cmd)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_mlock_refused_is_a_status_and_decoding_goes_on_unpinned_when_asked(paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    want = colibri.LM(paged).generate(PROMPT, 8)
    out = _limited(f"""
        import warnings, colibri
        try:
            colibri.LM({str(path)!r}, lock="all")
            print("locked")
        except colibri.ColibriError as exc:
            print("refused", int(exc.status), exc)
        try:
            colibri.LM({str(path)!r}, lock="dense")
            print("locked")
        except colibri.ColibriError as exc:
            print("refused", int(exc.status), exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lm = colibri.LM({str(path)!r}, lock="all", lock_required=False)
        print("unpinned", int(lm.lock_error.status) if lm.lock_error else 0, len(caught))
        print("tokens", lm.generate({PROMPT!r}, 8))
    """)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("locked"):
        pytest.skip("running as root without capsh: mlock is not limited by RLIMIT_MEMLOCK")
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"refused {int(Status.MLOCK_FAILED)}") and "RLIMIT_MEMLOCK is 4,096 bytes" in lines[0]
    assert lines[1].startswith(f"refused {int(Status.MLOCK_FAILED)}")
    assert lines[2] == f"unpinned {int(Status.MLOCK_FAILED)} 1"
    assert lines[3] == f"tokens {want}"


def test_generate_cli_verify_and_lock_options(paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    texts = set()
    for extra in ([], ["--verify", "full"], ["--verify", "none"], ["--lock"]):
        r = subprocess.run([COLIBRI, "generate", str(path), "-p", "\x03\x11", "-n", "6", "--tokenizer", "byte",
                            "--no-echo", *extra], capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr
        texts.add(r.stdout)
    assert len(texts) == 1
    bad = _write(tmp_path, _corrupt(paged, _tensors(paged)[-1][0]), "bad.clb")
    r = subprocess.run([COLIBRI, "generate", str(bad), "-p", "\x03", "-n", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "CRC" in r.stderr


def test_export_defaults_page_align_only_linux_sized_images(graph, tmp_path: Path, monkeypatch) -> None:
    assert not writer.linux_layout(graph)  # a few KiB: compact, as a microcontroller slot wants it
    monkeypatch.setattr(writer, "LINUX_LAYOUT_MIN_BYTES", 1)
    assert writer.linux_layout(graph)
    from colibri.image import stream

    report = stream.write_file(graph, tmp_path / "paged.clb")
    data = (tmp_path / "paged.clb").read_bytes()
    assert int.from_bytes(data[16:20], "little") & F.Flag.PAGE_ALIGNED
    assert data == image.write(graph, page_aligned=True)
    assert report.bytes_written == len(data)
    stream.write_file(graph, tmp_path / "compact.clb", page_aligned=False)
    assert (tmp_path / "compact.clb").read_bytes() == image.write(graph)


def test_lock_dense_pins_every_tensor_but_the_experts(paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    _drop(path)
    lm = colibri.LM(path, lock="dense", verify="none")  # pinned pages are resident: no read by a CRC needed
    experts = _expert_pages(lm.file)
    dense = sum(t[1] for t in _tensors(paged) if not any(
        o <= t[0] < o + s for o, s in (lm.file.expert_range(layer, e) for layer, n in enumerate(lm.file.experts())
                                       for e in range(n))))
    assert lm.file.resident() >= dense
    if engine.open_file(path, verify="none").resident() <= len(paged) - experts + PAGE:  # the cache was dropped
        assert lm.file.resident() <= len(paged) - experts + PAGE
    np.testing.assert_array_equal(lm.forward_tokens(PROMPT), colibri.LM(paged).forward_tokens(PROMPT))
    with pytest.raises(ValueError, match="'dense'"):
        colibri.LM(path, lock="hot")


def test_advice_reaches_madvise_for_pages_out_of_memory_only(paged: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, paged)
    _drop(path)
    probe = engine.open_file(path, verify="none")
    if probe.resident() > len(paged) - _expert_pages(probe):
        pytest.skip("posix_fadvise(DONTNEED) did not drop this file's pages (tmpfs?)")
    del probe
    lm = colibri.LM(path, verify="none")
    lm.forward_tokens(PROMPT[:1])
    cold = lm.file.advice()
    assert cold["route_advised"] > 0 and cold["ahead_advised"] > 0  # out of memory: advised
    lm.file.verify()  # reads every page: all resident now
    cold = lm.file.advice()
    lm.forward_tokens(PROMPT[1:3])
    warm = lm.file.advice()
    assert warm["route_calls"] > cold["route_calls"] and warm["ahead_calls"] > cold["ahead_calls"]
    assert warm["route_advised"] == cold["route_advised"] and warm["ahead_advised"] == cold["ahead_advised"]


def test_lm_open_bench_runs_small(tmp_path: Path) -> None:
    """bench/lm_open.py (make bench-lm-open) does not rot: tiny models, every row printed."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "bench" / "lm_open.py"), "--layers", "2", "--d", "64", "--hidden",
                          "64", "--experts", "4", "--vocab", "256", "--feature-layers", "1", "--feature-experts", "4",
                          "--feature-d", "64", "--feature-hidden", "64", "--repeat", "1", "--decode", "2",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(" ms ") >= 12 and "refused" not in out.stdout
    assert out.stdout.count("checking's share of the first output") == 4
    assert all(f"ahead {n}: first token" in out.stdout for n in (0, 1, 2))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def big_experts() -> bytes:
    """Experts of 96 pages each (f32, d 64, hidden 512): several read-ahead requests apiece."""
    return image.write(token_model(3, vocab=40, d=64, layers=2, experts=4, hidden=512, max_seq_len=16),
                       page_aligned=True)


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def _resident_pages(f: engine.ModelFile, offset: int, size: int) -> int:
    """Pages of the image's [offset, offset + size) in the page cache now (mincore on the mapping)."""
    base = np.frombuffer(f.raw, np.uint8).ctypes.data
    first, end = offset // PAGE * PAGE, -(-(offset + size) // PAGE) * PAGE
    vec = bytes((end - first) // PAGE)
    assert _libc().mincore(base + first, end - first, vec) == 0
    return sum(b & 1 for b in vec)


def _cold(path: Path) -> engine.ModelFile:
    _drop(path)
    f = engine.open_file(path, verify="none")
    if f.resident() > 4 * PAGE * (1 + len(f.experts())):  # the tables only, a few pages
        pytest.skip("posix_fadvise(DONTNEED) did not drop this file's pages (tmpfs?)")
    return f


def test_will_need_requests_every_missing_page_in_pieces_and_they_arrive(big_experts: bytes, tmp_path: Path) -> None:
    """An expert routing selects is asked for whole, in requests of request_bytes (Linux reads no more of one
    request than its read-ahead limit and drops the rest): every one of its pages is then in the page cache,
    read by the kernel, not by faults. A resident page is not asked for again."""
    path = _write(tmp_path, big_experts)
    f = _cold(path)
    assert f.advice()["request_bytes"] >= PAGE and f.advice()["request_bytes"] % PAGE == 0
    f.set_request_bytes(8 * PAGE)
    off, size = f.expert_range(0, 1)
    pages = -(-(off + size) // PAGE) - off // PAGE
    assert pages >= 90 and _resident_pages(f, off, size) == 0
    before = f.advice()
    f.will_need(0, [1])
    after = f.advice()
    assert after["route_advised"] - before["route_advised"] == pages * PAGE
    assert after["requests"] - before["requests"] == -(-pages // 8)
    assert after["request_bytes"] == 8 * PAGE
    for _ in range(500):  # the reads were started, not waited for
        if _resident_pages(f, off, size) == pages:
            break
        time.sleep(0.01)
    assert _resident_pages(f, off, size) == pages
    f.will_need(0, [1])
    assert f.advice()["route_advised"] == after["route_advised"] and f.advice()["requests"] == after["requests"]
    for bad in (0, PAGE + 1, PAGE // 2):
        with pytest.raises(ColibriError) as err:
            f.set_request_bytes(bad)
        assert err.value.status == Status.UNSUPPORTED


def test_will_need_asks_only_for_the_pages_a_partial_eviction_took(big_experts: bytes, tmp_path: Path) -> None:
    path = _write(tmp_path, big_experts)
    f = _cold(path)
    f.set_request_bytes(4 * PAGE)
    off, size = f.expert_range(0, 2)
    start, end = off // PAGE * PAGE, -(-(off + size) // PAGE) * PAGE
    view = np.frombuffer(f.raw, np.uint8)
    middle = start + (end - start) // 2 // PAGE * PAGE
    int(view[start:middle:PAGE].sum()) + int(view[end - PAGE])  # faults in the first half and the last page
    resident = _resident_pages(f, off, size)
    assert resident >= (middle - start) // PAGE + 1
    missing = (end - start) // PAGE - resident
    before = f.advice()
    f.will_need(0, [2])
    after = f.advice()
    assert after["route_advised"] - before["route_advised"] == missing * PAGE
    assert after["requests"] - before["requests"] >= -(-missing // 4)
    for _ in range(500):
        if _resident_pages(f, off, size) == (end - start) // PAGE:
            break
        time.sleep(0.01)
    assert _resident_pages(f, off, size) == (end - start) // PAGE


def test_cold_open_and_first_token_request_their_pages_rather_than_fault_them(big_experts: bytes,
                                                                              tmp_path: Path) -> None:
    """From a cold cache the default open reads the every-token tensors by requests (no more than their
    pages), and a token's routed experts arrive by requests: the tokens equal the in-memory model's."""
    path = _write(tmp_path, big_experts)
    _cold(path).close()
    lm = colibri.LM(path)
    opened = lm.file.advice()
    assert opened["requests"] > 0
    got = lm.forward_tokens(PROMPT[:2])
    advice = lm.file.advice()
    assert advice["route_advised"] > 0 and advice["requests"] > opened["requests"]
    np.testing.assert_array_equal(got, colibri.LM(big_experts).forward_tokens(PROMPT[:2]))


def test_cold_structure_open_requests_the_q4_companions_it_checks(tmp_path: Path) -> None:
    """The structure check reads every int4 matrix's companion (its group scales). A cold open asks for
    them by read-ahead requests before checking, so they are resident after it, while the experts' own
    int4 weights are not read at all."""
    from colibri.quant.quantize import quantize

    graph = quantize(token_model(4, vocab=40, d=64, layers=2, experts=4, hidden=2048, max_seq_len=16), "q4")
    data = image.write(graph, page_aligned=True)
    path = _write(tmp_path, data)
    _drop(path)
    import resource

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    f = engine.open_file(path, verify="none")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    tensors = _tensors(data)
    companions = [t for t in tensors if t[4] == F.DType.Q4_PARAMS]
    weights = [t for t in tensors if t[4] == F.DType.I4]
    assert len(companions) >= 3 * 5 and f.advice()["requests"] >= len(companions) // 3
    if f.resident() == len(data):
        pytest.skip("posix_fadvise(DONTNEED) did not drop this file's pages (tmpfs?)")
    pages = 0
    for t in companions:
        n = -(-(t[0] + t[1]) // PAGE) - t[0] // PAGE
        assert _resident_pages(f, t[0], t[1]) == n, t
        pages += n
    # Faulted in one page a fault, the check would have taken a major fault for most of those pages.
    assert faults < pages // 4, (faults, pages)
    spans = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    in_expert = [t for t in weights if any(o <= t[0] < o + s for o, s in spans)]
    assert in_expert and all(-(-(t[0] + t[1]) // PAGE) - t[0] // PAGE > 8 for t in in_expert)
    for t in in_expert:  # at most the pages it shares with its neighbours came in
        assert _resident_pages(f, t[0], t[1]) <= 2, t
