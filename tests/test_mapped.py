"""Issue 11, the file side: format v3 (one CRC per tensor), the POSIX file layer
(firmware/colibri_core/posix/colibri_file.c through colibri.runtime._engine.File), colibri.Model(path)
mapping instead of copying, page-aligned experts, hot model swap by rename and the truncation case."""
from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri.runtime import engine
from colibri import image, reference
from colibri.model import format as F
from colibri import nn as cnn
from colibri.model.errors import ImageError, ModelFileError
from colibri.frontends.exporter import export
from colibri.image import write_atomically
from colibri.model.format import Status

PAGE = 4096


def _model(seed: int, experts: int = 6, hidden: int = 40) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), cnn.MoE(16, experts, hidden, top_k=2),
                               torch.nn.Linear(16, 16), cnn.MoE(16, experts, hidden, top_k=2, gated=True, activation="silu"),
                               torch.nn.Linear(16, 3))


@pytest.fixture(scope="module")
def graph():
    return export(_model(0), None, max_batch=4).graph


@pytest.fixture(scope="module")
def paged(graph) -> bytes:
    return image.write(graph, page_aligned=True)


def _x(n: int = 3) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((n, 8)).astype(np.float32)


def _tensors(data: bytes):
    n_t, t_off = struct.unpack_from("<II", data, 32)
    return [F.TENSOR.unpack_from(data, t_off + i * F.TENSOR.size) for i in range(n_t)]


# ---- format v3 ---------------------------------------------------------------------------------


def test_v3_layout_and_crcs(graph, paged: bytes) -> None:
    assert struct.unpack_from("<H", paged, 4)[0] == 3
    plain = image.write(graph)
    assert struct.unpack_from("<H", plain, 4)[0] == 1  # no q8, not paged: the lowest version, as before
    meta, crc_off = F.V3_FIELDS.unpack_from(paged, 64)
    recs = _tensors(paged)
    assert crc_off + 4 * len(recs) == meta and all(r[0] >= meta for r in recs)
    assert struct.unpack_from("<I", paged, 8)[0] == zlib.crc32(paged[12:meta])
    for i, (off, nbytes, *_) in enumerate(recs):
        assert struct.unpack_from("<I", paged, crc_off + 4 * i)[0] == zlib.crc32(paged[off : off + nbytes])
    # v3 and v1 images of one graph compute the same bits
    x = _x()
    np.testing.assert_array_equal(colibri.Model(paged).forward(x), colibri.Model(plain).forward(x))
    assert image.write(graph, tensor_crc=True)[4] == 3
    with pytest.raises(ValueError):
        image.write(graph, version=2, tensor_crc=True)


def test_page_aligned_experts_own_their_pages(paged: bytes, tmp_path: Path) -> None:
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    f = engine.open_file(path)
    ranges = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    assert f.experts() == [6, 6]
    pages = []
    for off, size in ranges:
        assert off % PAGE == 0
        pages.append(set(range(off // PAGE, (off + size + PAGE - 1) // PAGE)))
    recs = _tensors(paged)
    expert_bytes = set()
    for off, size in ranges:
        expert_bytes |= set(range(off // PAGE, (off + size + PAGE - 1) // PAGE))
    for a in range(len(pages)):  # no page shared between two experts...
        for b in range(a + 1, len(pages)):
            assert not pages[a] & pages[b]
    for off, nbytes, *_ in recs:  # ...nor between an expert and a tensor outside every expert
        inside = any(o <= off < o + s for o, s in ranges)
        if not inside:
            assert not set(range(off // PAGE, (off + nbytes + PAGE - 1) // PAGE)) & expert_bytes


def test_structure_check_reads_no_payload_and_full_check_finds_corruption(paged: bytes) -> None:
    recs = _tensors(paged)
    off, nbytes = recs[-2][:2]  # a payload (last layer's weight or bias)
    bad = bytearray(paged)
    bad[off + nbytes // 2] ^= 0x10
    assert engine._engine.validate(bytes(bad)) == Status.BAD_PAYLOAD_CRC
    assert image.status(bytes(bad)) == Status.BAD_PAYLOAD_CRC
    assert engine._engine.validate_structure(bytes(bad)) == 0
    assert image.status(bytes(bad), check="structure") == 0
    with pytest.raises(ImageError, match="CRC"):
        colibri.Model(bytes(bad))  # colibri_init: full, as the MCU's boot and slot commit
    assert colibri.arena_size(bytes(bad)) == colibri.arena_size(paged)  # model_size: structure
    image.set_tensor_crcs(bad)
    assert engine._engine.validate(bytes(bad)) == 0 == image.status(bytes(bad))


@pytest.mark.parametrize("case", ["meta_small", "meta_odd", "meta_big", "crc_table", "payload_in_meta", "header_crc",
                                  "reserved"])
def test_v3_header_statuses_agree(paged: bytes, case: str) -> None:
    b = bytearray(paged)
    meta, crc_off = F.V3_FIELDS.unpack_from(b, 64)
    size = struct.unpack_from("<I", b, 12)[0]
    want = {"meta_small": Status.BAD_HEADER, "meta_odd": Status.BAD_HEADER, "meta_big": Status.BAD_HEADER,
            "crc_table": Status.TABLE_BOUNDS, "payload_in_meta": Status.TENSOR_BOUNDS, "header_crc": Status.BAD_CRC,
            "reserved": Status.BAD_HEADER}[case]
    if case == "meta_small":
        struct.pack_into("<I", b, 64, 40)
    elif case == "meta_odd":
        struct.pack_into("<I", b, 64, meta + 2)
    elif case == "meta_big":
        struct.pack_into("<I", b, 64, size + 4)
    elif case == "crc_table":
        struct.pack_into("<I", b, 68, meta - 4)
    elif case == "payload_in_meta":
        first = _tensors(paged)[0][0]
        struct.pack_into("<I", b, 64, first + 32)
    elif case == "reserved":
        b[75] = 1
    if case != "header_crc":
        image.set_crc(b)
    else:
        b[crc_off] ^= 1  # the CRC table is metadata: the header CRC covers it
    assert engine._engine.validate(bytes(b)) == want
    assert image.status(bytes(b)) == want
    assert engine._engine.validate_structure(bytes(b)) == want == image.status(bytes(b), check="structure")


def test_older_versions_still_read(graph) -> None:
    for v in (1, 2):
        data = image.write(graph, version=v)
        assert engine._engine.validate(data) == 0 == engine._engine.validate_structure(data)
        bad = bytearray(data)
        bad[-5] ^= 1  # v1/v2: one CRC over everything, checked at either level
        assert engine._engine.validate_structure(bytes(bad)) == Status.BAD_CRC == image.status(bytes(bad), check="structure")


# ---- the POSIX layer ---------------------------------------------------------------------------


def test_model_path_maps_not_copies(paged: bytes, tmp_path: Path) -> None:
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    x = _x()
    m = colibri.Model(path)
    assert m.file is not None
    np.testing.assert_allclose(m.forward(x), reference.run(image.read(paged), x), rtol=1e-5, atol=1e-6)
    # the weights are read in place: the image buffer is the mapping of the file
    maps = Path("/proc/self/maps").read_text()
    assert str(path) in maps
    copied = colibri.Model(path, copy=True)
    assert copied.file is None and isinstance(copied.image, bytes)
    np.testing.assert_array_equal(copied.forward(x), m.forward(x))
    with pytest.raises(BufferError):
        m.file.close()  # the Model still reads it
    del m


def test_file_statuses(paged: bytes, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as e:
        colibri.Model(tmp_path / "missing.clb")
    assert e.value.status == Status.FILE_NOT_FOUND and "missing.clb" in str(e.value)
    with pytest.raises(ModelFileError) as e:
        colibri.Model(tmp_path)
    assert e.value.status == Status.FILE_OPEN
    (tmp_path / "text.clb").write_bytes(b"hello, not a model" * 10)
    with pytest.raises(ImageError) as e:
        colibri.Model(tmp_path / "text.clb")
    assert e.value.status == Status.BAD_MAGIC
    (tmp_path / "short.clb").write_bytes(b"CLBR")
    with pytest.raises(ImageError) as e:
        colibri.Model(tmp_path / "short.clb")
    assert e.value.status == Status.TRUNCATED
    if os.geteuid() != 0:
        locked = tmp_path / "locked.clb"
        locked.write_bytes(paged)
        locked.chmod(0)
        with pytest.raises(ModelFileError) as e:
            colibri.Model(locked)
        assert e.value.status == Status.FILE_OPEN
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    with pytest.raises(colibri.ColibriError) as e:
        engine.open_file(path, lock=[(0, 6)])
    assert e.value.status == Status.NO_SUCH_EXPERT and "expert 6" in str(e.value)


def test_mlock_refused_reports_rlimit(paged: bytes, tmp_path: Path) -> None:
    """mlock beyond RLIMIT_MEMLOCK, in a child whose limit is lowered to one page (root bypasses it)."""
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    code = textwrap.dedent(f"""
        import resource, sys
        from colibri.runtime import engine
        from colibri.model.format import Status
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, 4096))
        try:
            engine.open_file({str(path)!r}, lock="all")
        except Exception as exc:
            print(int(exc.status), exc)
            sys.exit(0)
        print("locked")
    """)
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0 and shutil.which("capsh"):  # root's CAP_IPC_LOCK ignores the limit: drop it
        cmd = ["capsh", "--drop=cap_ipc_lock", "--", "-c", shlex.join(cmd)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("locked"):
        assert os.geteuid() == 0
        pytest.skip("running as root without capsh: mlock is not limited by RLIMIT_MEMLOCK")
    assert out.stdout.startswith(str(int(Status.MLOCK_FAILED))), out.stdout
    assert "RLIMIT_MEMLOCK is 4,096 bytes" in out.stdout


def test_lock_options_and_will_need(paged: bytes, tmp_path: Path) -> None:
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = sum(engine.open_file(path).expert_range(0, e)[1] for e in (0, 1)) + 2 * PAGE
    if soft != resource.RLIM_INFINITY and soft < need and os.geteuid() != 0:
        pytest.skip(f"RLIMIT_MEMLOCK {soft} below {need}")
    x = _x()
    want = colibri.Model(paged).forward(x)
    for lock in ("all", "none", [(0, 0), (1, 5)]):
        m = colibri.Model(path, lock=lock)
        np.testing.assert_array_equal(m.forward(x), want)
    f = engine.open_file(path)
    f.will_need(1, [0, 3, 5])
    with pytest.raises(colibri.ColibriError) as e:
        f.will_need(1, [6])
    assert e.value.status == Status.NO_SUCH_EXPERT
    with pytest.raises(colibri.ColibriError) as e:
        f.will_need(2, [0])
    assert e.value.status == Status.NO_SUCH_EXPERT
    assert f.resident() > 0


def test_verify_on_use_per_expert(paged: bytes, tmp_path: Path) -> None:
    """A corrupted expert: open succeeds (nothing of it is read), its first use fails with
    BAD_PAYLOAD_CRC, the other experts verify; full verification at open refuses the file."""
    f0 = None
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    f0 = engine.open_file(path)
    off, size = f0.expert_range(1, 0)
    del f0
    bad = bytearray(paged)
    bad[off + size // 3] ^= 0x40
    path.write_bytes(bad)
    f = engine.open_file(path)  # structure only: opens
    f.will_need(1, [1, 2, 3])
    f.verify_expert(0, 0)
    with pytest.raises(ImageError) as e:
        f.will_need(1, [0])
    assert e.value.status == Status.BAD_PAYLOAD_CRC
    with pytest.raises(ImageError) as e:
        f.verify()
    assert e.value.status == Status.BAD_PAYLOAD_CRC
    with pytest.raises(ImageError) as e:
        engine.open_file(path, verify="full")
    assert e.value.status == Status.BAD_PAYLOAD_CRC
    with pytest.raises(ImageError) as e:
        engine.open_file(path, lock=[(1, 0)])  # a locked expert is verified at open
    assert e.value.status == Status.BAD_PAYLOAD_CRC
    m = colibri.Model(path)  # opens; the on_route callback verifies each expert the first time it is routed to
    many = np.random.default_rng(2).standard_normal((400, 8)).astype(np.float32)
    with pytest.raises(ImageError) as e:
        m.forward(many)
    assert e.value.status == Status.BAD_PAYLOAD_CRC
    assert colibri.Model(path, verify="none").forward(_x()).shape == (3, 3)


def test_cli_verify_and_run_use_the_file(paged: bytes, tmp_path: Path) -> None:
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    np.save(tmp_path / "x.npy", _x())
    cli = [str(Path(sys.executable).parent / "colibri")]
    out = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok (format v3" in out.stdout, out.stderr
    out = subprocess.run([*cli, "run", str(path), "-i", str(tmp_path / "x.npy")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    np.testing.assert_allclose(np.loadtxt(out.stdout.splitlines(), delimiter=","), reference.run(image.read(paged), _x()),
                               rtol=1e-5, atol=1e-5)
    bad = bytearray(paged)
    bad[_tensors(paged)[3][0]] ^= 1
    path.write_bytes(bad)
    out = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "CRC" in out.stderr and "Traceback" not in out.stderr


# ---- hot model swap ----------------------------------------------------------------------------


def test_replace_by_rename_keeps_serving_then_reopen_picks_up(tmp_path: Path) -> None:
    old = image.write(export(_model(0), None, max_batch=4).graph, page_aligned=True)
    new = image.write(export(_model(7), None, max_batch=4).graph, page_aligned=True)
    path = tmp_path / "model.clb"
    write_atomically(path, old)
    x = _x()
    serving = colibri.Model(path)
    before = serving.forward(x)
    write_atomically(path, new)  # tmp file, fsync, rename over: the safe update
    assert serving.file.replaced()
    assert serving.file.check() == 0
    np.testing.assert_array_equal(serving.forward(x), before)  # the old mapping stays valid
    reopened = colibri.Model(path)
    assert not reopened.file.replaced()
    np.testing.assert_array_equal(reopened.forward(x), colibri.Model(new).forward(x))
    assert not np.array_equal(reopened.forward(x), before)


def test_truncation_in_place_detected_before_forward(paged: bytes, tmp_path: Path) -> None:
    path = tmp_path / "model.clb"
    path.write_bytes(paged)
    m = colibri.Model(path)
    m.forward(_x())
    os.truncate(path, len(paged) // 2)
    with pytest.raises(ModelFileError) as e:
        m.forward(_x())
    assert e.value.status == Status.FILE_CHANGED
    assert m.file.check() == Status.FILE_CHANGED


def test_truncation_under_a_running_reader_is_sigbus(paged: bytes, tmp_path: Path) -> None:
    """What the safe procedure avoids: a reader touching pages past the new end of a file truncated
    in place dies of SIGBUS (in a child process); the rename procedure above never does."""
    path = tmp_path / "model.clb"
    path.write_bytes(paged)
    code = textwrap.dedent(f"""
        import os
        from colibri.runtime import engine
        f = engine.open_file({str(path)!r}, verify="none")
        view = memoryview(f.raw)
        os.truncate({str(path)!r}, 4096)
        print(sum(view[len(view) - 1 : len(view)]), flush=True)  # a page past the end
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -7, (out.returncode, out.stderr)  # SIGBUS


# ---- the same from C (plain and ASan + UBSan) ----------------------------------------------------


def test_c_driver(c_drivers: Path, paged: bytes, tmp_path: Path) -> None:
    """tests/c/colibri_file_test.c: open statuses, forward_ex with colibri_file_on_route over the mapping
    (bit for bit colibri_init's), per-expert verification of a corrupted expert, lock and verify options."""
    good, bad = tmp_path / "good.clb", tmp_path / "bad.clb"
    good.write_bytes(paged)
    f = engine.open_file(good)
    off, size = f.expert_range(1, 4)
    del f
    corrupted = bytearray(paged)
    corrupted[off + size - 7] ^= 0x02
    bad.write_bytes(corrupted)
    out = subprocess.run([str(c_drivers / "colibri_file_test"), str(good), str(bad), "1", "4", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_edge_mmap_bench_runs_small(tmp_path: Path) -> None:
    """bench/edge_mmap.py (make bench-edge-mmap) does not rot: a tiny model, figures printed."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "edge_mmap.py"), "--layers", "1", "--experts", "4",
                          "--d", "64", "--hidden", "64", "--tokens", "4", "--skew", "0.5", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "time to first output, cold cache" in out.stdout and out.stdout.count("major faults/token") == 3
    # ONNX Runtime on the same weights (the bench extra): both engines' memory, and the same outputs.
    if "ONNX Runtime peak RSS: NOT MEASURED: " not in out.stdout:
        for engine in ("Colibri (mapped, verify on use)", "ONNX Runtime (external data)"):
            assert f"4 tokens, {engine}: peak RSS " in out.stdout, out.stdout
        assert "mapped from the weights file" in out.stdout and "(outputs agree to " in out.stdout
    assert list(tmp_path.iterdir()) == []  # the model file is removed


def test_python_on_route_over_a_mapped_file_still_verifies(paged: bytes, tmp_path: Path) -> None:
    """Model.forward(x, on_route=...) (the caller's callback) on a mapped file: the file layer's
    advice and per-expert verification run first, then the caller's callback."""
    path = tmp_path / "m.clb"
    f = None
    path.write_bytes(paged)
    f = engine.open_file(path)
    off, size = f.expert_range(1, 0)
    del f
    bad = bytearray(paged)
    bad[off + size // 2] ^= 0x08
    path.write_bytes(bad)
    seen: list[int] = []
    many = np.random.default_rng(2).standard_normal((400, 8)).astype(np.float32)
    with pytest.raises(ImageError) as e:
        colibri.Model(path).forward(many, on_route=lambda layer, experts, tokens: seen.append(layer))
    assert e.value.status == Status.BAD_PAYLOAD_CRC and seen
    path.write_bytes(paged)
    x = _x()
    got = colibri.Model(path).forward(x, on_route=lambda layer, experts, tokens: None)
    np.testing.assert_array_equal(got, colibri.Model(paged).forward(x))


def test_open_reads_no_expert_page(paged: bytes, tmp_path: Path) -> None:
    """From a cold page cache, opening (structure check, non-expert tensors verified) leaves every
    expert's pages unread (mincore); a forward pass reads only the routed experts'; verify() reads all."""
    path = tmp_path / "m.clb"
    path.write_bytes(paged)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    f = engine.open_file(path, verify="none")
    ranges = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    expert_pages = sum((size + PAGE - 1) // PAGE for _, size in ranges) * PAGE
    del f
    if engine.open_file(path, verify="none").resident() > len(paged) - expert_pages:
        pytest.skip("posix_fadvise(DONTNEED) did not drop this file's pages (tmpfs?)")
    m = colibri.Model(path)  # verify on use: the non-expert tensors are read at open
    assert m.file.resident() <= len(paged) - expert_pages + PAGE
    m.forward(_x(1))  # one token: top-2 of each MoE layer
    assert m.file.resident() <= len(paged) - expert_pages + PAGE + 4 * max(s for _, s in ranges) + 4 * PAGE
    m.file.verify()
    assert m.file.resident() >= len(paged) - PAGE


def test_cli_info_reads_the_tables_not_the_weights(paged: bytes, tmp_path: Path) -> None:
    """`colibri info` maps the file and checks its structure: a corrupted payload still gets `info`
    (and fails `verify`), and from a cold page cache `info` leaves every expert page unread."""
    path = tmp_path / "m.clb"
    cli = [str(Path(sys.executable).parent / "colibri")]
    bad = bytearray(paged)
    bad[max(_tensors(paged), key=lambda t: t[1])[0]] ^= 1  # a weight of the largest tensor: an expert's
    path.write_bytes(bad)
    out = subprocess.run([*cli, "info", "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    described = json.loads(out.stdout)
    assert described["image_bytes"] == len(paged) and described["routed_experts"] == 12
    out = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "CRC" in out.stderr

    path.write_bytes(paged)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    f = engine.open_file(path, verify="none")
    ranges = [f.expert_range(layer, e) for layer, n in enumerate(f.experts()) for e in range(n)]
    expert_pages = {p for off, size in ranges for p in range(off // PAGE, (off + size + PAGE - 1) // PAGE)}
    if f.resident() > len(paged) - len(expert_pages) * PAGE:
        pytest.skip("posix_fadvise(DONTNEED) did not drop this file's pages (tmpfs?)")
    out = subprocess.run([*cli, "info", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "routed experts 12" in out.stdout, out.stderr
    assert f.resident() <= len(paged) - len(expert_pages) * PAGE


def test_edge_jitter_bench_runs_small(tmp_path: Path) -> None:
    """bench/edge_jitter.py (make bench-edge-jitter) does not rot: a tiny model, p50/p99 with and without
    mlock printed, and the memory-pressure runs either made in a cgroup (v2 or v1, named) or skipped
    with the reason."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "edge_jitter.py"), "--layers", "1", "--experts", "8",
                          "--d", "64", "--hidden", "64", "--tokens", "6", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pinned: the 2 most used experts" in out.stdout
    for run in ("no pressure, no lock: p50 ", "no pressure, mlock'd: p50 "):
        assert run in out.stdout, out.stdout
    pressured = [line for line in out.stdout.splitlines() if line.startswith("  in the cgroup, ")]
    if "under memory pressure: SKIPPED: " in out.stdout:
        assert pressured == []
    else:
        assert "under memory pressure: cgroup v" in out.stdout, out.stdout
        assert [line.split(":")[0] for line in pressured] == [
            f"  in the cgroup, {run}" for run in ("no lock, WILLNEED", "no lock, no advice",
                                                  "mlock'd, WILLNEED", "mlock'd, no advice")]
        assert all(" p50 " in line and " p99 " in line and "group peak usage" in line for line in pressured)
        # The group is removed: the cgroup line names it.
        group = Path(out.stdout.split("under memory pressure: cgroup v")[1].split()[1].rstrip(","))
        assert group.name.startswith("colibri-jitter-") and not group.exists()
    assert "ONNX Runtime peak RSS: " in out.stdout
    assert list(tmp_path.iterdir()) == []


def _jitter_bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import edge_jitter
    finally:
        sys.path.pop(0)
    return edge_jitter


# A hybrid hierarchy as this machine has it: the memory controller on cgroup v1, v2 mounted without it.
HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / {memory} rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "9:name=systemd:/\n4:memory:/jobs/abc\n1:cpu:/\n0::/\n"


def test_jitter_finds_the_v1_memory_group_when_v2_lacks_the_controller(tmp_path: Path) -> None:
    bench = _jitter_bench()
    unified, memory = tmp_path / "unified", tmp_path / "memory"
    (memory / "jobs" / "abc").mkdir(parents=True)
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpu io\n")
    mountinfo = HYBRID_MOUNTINFO.format(memory=memory, unified=unified)
    found, why = bench.locate_v2(mountinfo, HYBRID_CGROUP)
    assert found is None and "memory controller is not available" in why and "cgroup v1" in why
    parents, why = bench.locate_v1(mountinfo, HYBRID_CGROUP)
    # Under this process's own memory group first, the hierarchy's root second.
    assert parents == [memory / "jobs" / "abc", memory] and why == ""
    # A cgroup namespace mounts the hierarchy at the process's own group: it is the root there.
    nested = mountinfo.replace(" / " + str(memory), " /jobs/abc " + str(memory))
    assert bench.locate_v1(nested, HYBRID_CGROUP) == ([memory], "")
    assert bench.locate_v1(mountinfo.replace("rw,memory", "rw,pids"), HYBRID_CGROUP)[0] == []
    assert "no memory group" in bench.locate_v1(mountinfo, "0::/\n")[1]


def test_jitter_checks_which_group_the_child_joined(tmp_path: Path) -> None:
    bench = _jitter_bench()
    v1 = tmp_path / "memory" / "jobs" / "colibri-jitter-1"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert bench.joined(v1, "4:memory:/jobs/colibri-jitter-1\n0::/\n")
    assert not bench.joined(v1, "4:memory:/jobs\n0::/\n")  # still in the parent
    assert not bench.joined(v1, "4:pids:/jobs/colibri-jitter-1\n0::/\n")  # another controller's group
    v2 = tmp_path / "unified" / "colibri-jitter-2"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    assert bench.joined(v2, "0::/colibri-jitter-2\n")
    assert not bench.joined(v2, "0::/\n")
    group, why = bench.cgroup_for_pressure(tmp_path)
    assert group is None and "neither memory.max (v2) nor memory.limit_in_bytes (v1)" in why
    group, why = bench.cgroup_for_pressure(v1)
    assert group is None and "cgroup.procs is not writable" in why
    (v1 / "cgroup.procs").write_text("")
    group, why = bench.cgroup_for_pressure(v1)
    assert group is not None and group.version == 1 and group.limit_file == "memory.limit_in_bytes"


def test_bench_router_skew_concentrates_the_routing() -> None:
    """bench/edge_mmap.py's build(skew=...): the router bias makes the low-numbered experts the most
    used (what makes pinning the hottest pay off in bench/edge_jitter.py); skew 0 has no bias."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import edge_mmap
    finally:
        sys.path.pop(0)
    assert edge_mmap.build(1, 8, 32, 32).layers[1].router_bias is None
    x = np.random.default_rng(5).standard_normal((400, 16)).astype(np.float32)
    shares = []
    for skew in (0.0, 2.0):
        counts = np.zeros(8, np.int64)

        def count(layer: int, experts: list[int], tokens: list[int]) -> None:
            for e, n in zip(experts, tokens):
                counts[e] += n

        colibri.Model(image.write(edge_mmap.build(1, 8, 32, 32, skew=skew))).forward(x, on_route=count)
        shares.append(counts[:2].sum() / counts.sum())
    assert shares[0] < 0.5 and shares[1] > 0.8, shares
