"""`make bench-lm-scale`'s harness (bench/lm_scale.py) at a CI size: the tiny model through every step
(the bf16 folder, the streamed exports, the decode runs in a memory cgroup, the targets), beside
llama.cpp wherever it is built; the disk plan and its refusal; and memory pressure on a small model:
slower tokens, never a wrong one. Timings are printed by the bench, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import lm_scale as bench  # noqa: E402
import lm_vs_llama_cpp as peer  # noqa: E402


def _group_or_skip():
    """A memory cgroup made for the test (the caller removes it), or the test skipped saying why."""
    group, why = bench.cgroup_for_pressure(None)
    if group is None:
        pytest.skip(f"no writable memory cgroup here: {why}")
    return group


def _cgroup_or_skip() -> None:
    group = _group_or_skip()
    if group.created:
        group.path.rmdir()


def _check_runs(out: dict, engines: set[str]) -> None:
    runs = out["runs"]
    assert {r["engine"] for r in runs} == engines
    for r in runs:
        assert r["finished"], r  # the tiny model fits every limit
        res = r["result"]
        assert len(res["tokens"]) == bench.DECODE + 1 and len(res["times"]) == bench.DECODE
        assert all(0 <= t < bench.SIZES["tiny"].vocab for t in res["tokens"])
        assert res["first_token_s"] >= res["open_s"] > 0
        if r["engine"] == "colibri":  # the bytes read from storage per step, and the open's read-ahead requests
            assert len(res["read_bytes"]) == bench.DECODE and res["open_read_bytes"] >= 0
            assert res["requests"] > 0 and res["request_bytes"] >= 4096
    limited = [r for r in runs if r["limit_mib"] is not None]
    assert limited, "no run inside a limit"
    for r in limited:  # the same tokens as the engine's unlimited run at the same threads
        (free,) = [f for f in runs if f["limit_mib"] is None and f["lock"] == "none"
                   and (f["engine"], f["dtype"], f["threads"]) == (r["engine"], r["dtype"], r["threads"])]
        assert r["result"]["tokens"] == free["result"]["tokens"], (r["engine"], r["dtype"], r["limit_mib"])
    locked = [r for r in runs if r["lock"] != "none"]
    assert locked and all(r["engine"] == "colibri" for r in locked)
    assert "dense" in {r["lock"] for r in locked} and len({r["lock"] for r in locked}) >= 2  # hot experts, dense
    (tokens,) = [t for t in out["targets"] if t["target"].startswith("tokens under a limit")]
    assert tokens["met"] is True


@pytest.mark.slow
def test_the_tiny_size_runs_every_colibri_step(tmp_path, capsys):
    _cgroup_or_skip()
    out = bench.main(["--size", "tiny", "--engines", "colibri", "--out", str(tmp_path)])
    for name in ("generate", "colibri q4", "colibri q8"):
        assert out["steps"][name]["seconds"] > 0
    assert out["steps"]["colibri q4"]["bytes"] == (tmp_path / "colibri" / "model-q4.clb").stat().st_size
    _check_runs(out, {"colibri"})
    printed = capsys.readouterr().out
    assert "== targets (issue 27)" in printed and "disk: the steps still to run need" in printed
    if bench.INT8_BLOCKS:  # x86-64: the files carry int8 activation blocks, and the table says so
        assert "int8 activation blocks on every layer" in printed
        info = subprocess.run([str(Path(sys.executable).parent / "colibri"), "info",
                               str(tmp_path / "colibri" / "model-q4.clb")], capture_output=True, text=True)
        assert info.returncode == 0 and "int8-blocks" in info.stdout
    assert json.loads((tmp_path / "results.json").read_text())["targets"] == out["targets"]
    # A rerun reuses every step's files (the stamps) and measures again.
    again = bench.main(["--size", "tiny", "--engines", "colibri", "--out", str(tmp_path), "--threads", "1"])
    assert all(s.get("reused") for s in again["steps"].values())


@pytest.mark.slow
@pytest.mark.skipif(not peer.llama_built(), reason=peer.SETUP_HINT)
def test_the_tiny_size_beside_llama_cpp(tmp_path):
    _cgroup_or_skip()
    # Colibri's q4 from llama-quantize --pure Q4_0 (the folder's q4 export runs in the test above).
    out = bench.main(["--size", "tiny", "--q4-from", "gguf", "--out", str(tmp_path)])
    for name in ("gguf bf16", "llama-quantize Q4_0", "llama-quantize Q4_0 pure", "llama-quantize Q8_0",
                 "colibri q4 from Q4_0", "colibri q8"):
        assert out["steps"][name]["bytes"] > 0
    assert "Q4_0 -> q4" in (tmp_path / "logs" / "colibri_q4_from_Q4_0.log").read_text()  # the blocks carried
    # Intermediates deleted once used.
    assert not (tmp_path / "gguf" / "model-bf16.gguf").exists()
    assert not (tmp_path / "gguf" / "model-Q4_0-pure.gguf").exists()
    _check_runs(out, {"colibri", "llama.cpp"})
    measured = {t["target"]: t for t in out["targets"]}
    assert all(t["met"] is not None for name, t in measured.items() if "no limit" in name)


def test_the_model_is_7_b_parameters_and_the_disk_plan_says_what_it_needs(tmp_path):
    plan = bench.Plan("7b", tmp_path, {"colibri", "llama.cpp"})
    assert plan.size.params == 7_027_001_344
    peak, lines = plan.disk_needed()
    # The folder, Colibri q4, the bf16 GGUF and both quantised GGUFs at once; Colibri q8 after the bf16 is gone.
    p = plan.size.params
    want = int(2 * p) + int(2 * p) + 2 * int(p * 18 / 32 * 1.03) + int(p * 34 / 32 * 1.03)
    assert peak == want and 42e9 < peak < 45e9
    assert len(lines) == 6 and "after that deletion" in lines[-1]


def test_the_medium_size_keeps_the_7_b_layers_and_its_limits_below_the_q4_file():
    big, medium = bench.SIZES["7b"], bench.SIZES["medium"]
    assert (medium.hidden, medium.intermediate, medium.heads, medium.kv_heads, medium.vocab) == (
        big.hidden, big.intermediate, big.heads, big.kv_heads, big.vocab)
    assert 2.3e9 < medium.params < 2.5e9
    for first, second in zip(big.limits_mib[:2], medium.limits_mib[:2]):  # the same ratios to the model
        assert second / medium.params == pytest.approx(first / big.params, rel=0.05)
    assert medium.limits_mib[1] * bench.MiB < medium.params * bench.BYTES_PER_PARAM["q4"]  # below the q4 file
    assert medium.limits_mib[2] is None


def test_too_little_disk_is_refused_with_the_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.shutil, "disk_usage", lambda path: type("U", (), {"free": 10**9})())
    with pytest.raises(SystemExit, match=r"not enough disk: [1-9]\d\.\d GB needed, 1\.0 GB free"):
        bench.main(["--size", "7b", "--engines", "colibri,llama.cpp" if peer.llama_built() else "colibri",
                    "--out", str(tmp_path)])
    assert not any(tmp_path.glob("hf*")), "nothing is written before the check"


def test_bf16_bits_round_to_nearest_even_as_torch_does():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float32) * np.float32(0.02)
    x[:4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, 65504.0]  # ties go to even; signs and large values kept
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bench.to_bf16_bits(x), want)


def test_the_decode_driver_refuses_bad_arguments(tmp_path):
    bench.peer.OUT = tmp_path
    driver = bench.colibri_decode_driver(tmp_path)
    junk = tmp_path / "junk.clb"
    junk.write_bytes(b"not a model" * 16)
    for args, message in ((["decode", str(junk), "1", "1,x", "4", "none"], "IDS must be comma-separated"),
                          (["decode", str(junk), "1", "1,2", "4", "0:1;2"], "LOCK must be none, dense or L:E"),
                          (["hot", str(junk), ""], "IDS is empty")):
        r = subprocess.run([str(driver), *args], capture_output=True, text=True)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    r = subprocess.run([str(driver), "decode", str(junk), "1", "1,2", "4", "none"], capture_output=True, text=True)
    assert r.returncode == 1 and "junk.clb" in r.stderr


PRESSURE = bench.Size(hidden=256, layers=4, intermediate=1024, heads=4, kv_heads=2, vocab=1024,
                      shard_bytes=20_000_000, limits_mib=(None,), lock_mib=1)


@pytest.mark.slow
def test_memory_pressure_gives_slower_tokens_never_a_wrong_one(tmp_path, monkeypatch):
    """A 27 MB q8 model decoding in a cgroup whose limit leaves room for 40% of it beside the process's own
    memory: the kernel must evict the file's pages while the tokens run (the limit is hit, pages fault
    in again), and every token equals the unlimited run's."""
    group = _group_or_skip()
    monkeypatch.setitem(bench.SIZES, "pressure", PRESSURE)
    try:
        out = bench.main(["--size", "pressure", "--engines", "colibri", "--dtypes", "q8", "--threads", "1",
                          "--out", str(tmp_path), "--steps-only"])
        image = tmp_path / "colibri" / "model-q8.clb"
        assert out["steps"]["colibri q8"]["bytes"] == image.stat().st_size > 20 * bench.MiB
        driver = bench.colibri_decode_driver(tmp_path)
        ids = bench.prompt_ids(PRESSURE.vocab, 0)
        free = bench.execute(bench.Run("colibri", "q8", 1, None), image, ids, group, {"colibri": driver})
        assert free.finished, free.error
        own = free.result["rss_anon_kib"] * 1024
        limit_mib = (own + int(0.4 * image.stat().st_size)) // bench.MiB + 4
        tight = bench.execute(bench.Run("colibri", "q8", 1, limit_mib), image, ids, group, {"colibri": driver})
        assert tight.finished, tight.error or "OOM-killed"
        assert tight.group["limit_hits"] > 0, tight.group  # the pressure was real
        assert tight.group["peak_bytes"] <= limit_mib * bench.MiB
        assert sum(tight.result["faults"]) > sum(free.result["faults"])  # pages were read again
        assert tight.result["tokens"] == free.result["tokens"]
    finally:
        if group.created:
            group.path.rmdir()
