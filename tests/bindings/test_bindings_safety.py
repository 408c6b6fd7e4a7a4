"""Issue 25, the binding's half: one colibri.LM shared by threads answers exactly what it answers
alone (or refuses with an error), memory the binding lends a callback cannot be used after it is
gone, a Context that was never initialised raises instead of crashing, and integer parameters
refuse floats as Python's own do. docs/threading.md is the contract these tests hold."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import colibri
from colibri import image, reference
from colibri import nn as cnn
from colibri.frontends.exporter import export

from helpers.lmmodels import token_model

CHILD_TIMEOUT = 120


def _child(code: str, *args) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter: a crash there is a failed assertion here."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, f"child exited {r.returncode} (negative: killed by that signal)\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def lm_image() -> bytes:
    return image.write(token_model(5, max_seq_len=40))


@pytest.fixture(scope="module")
def feature_image() -> bytes:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), cnn.MoE(16, 4, 24, top_k=2), torch.nn.Linear(16, 3)).eval()
    return export(net, None, max_batch=4).image


# ---- one LM, several threads -------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 3], [30, 31, 5, 5, 9]]
SAMPLING = [dict(), dict(temperature=0.8, top_k=5, seed=3), dict(temperature=1.3, top_p=0.9, seed=11)]


def test_generate_from_four_threads_and_a_resetting_one_gives_the_single_thread_tokens(lm_image: bytes) -> None:
    lm = colibri.LM(lm_image)
    want = {(p, s): lm.generate(PROMPTS[p], 12, **SAMPLING[s]) for p in range(3) for s in range(3)}
    stop = threading.Event()

    def resetter() -> int:
        n = 0
        while not stop.is_set():
            lm.reset()
            lm.forward_tokens([4, 4])  # a sequence of its own, cut in wherever it can
            n += 1
        return n

    def worker(k: int) -> list[tuple[tuple[int, int], list[int]]]:
        got = []
        for i in range(30):
            key = ((k + i) % 3, (k * 7 + i) % 3)
            got.append((key, lm.generate(PROMPTS[key[0]], 12, **SAMPLING[key[1]])))
        return got

    with ThreadPoolExecutor(5) as pool:
        resets = pool.submit(resetter)
        results = [pool.submit(worker, k) for k in range(4)]
        answers = [a for r in results for a in r.result()]
        stop.set()
        assert resets.result() > 0
    wrong = [(key, got) for key, got in answers if got != want[key]]
    assert len(answers) == 120 and not wrong, f"{len(wrong)} of {len(answers)} generations differ: {wrong[:3]}"


def test_forward_tokens_calls_from_threads_are_each_whole(lm_image: bytes) -> None:
    """forward_tokens appends all its ids or none, under the lock: sequences of 3-token calls from 4
    threads always leave a position that is a multiple of 3, and each call's logits are those of the
    position it got."""
    lm = colibri.LM(lm_image)
    ref = reference.LMState(image.read(lm_image))
    ids = np.array([3, 9, 27])

    def worker(_: int) -> int:
        calls = 0
        for _ in range(3):
            lm.forward_tokens(ids)
            calls += 1
        return calls

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(worker, range(4))) == 12
    assert lm.position == 36
    ref_logits = [ref.forward_tokens(ids) for _ in range(12)][-1]
    lm.reset()
    for _ in range(11):
        lm.forward_tokens(ids)
    np.testing.assert_allclose(lm.forward_tokens(ids), ref_logits, rtol=1e-4, atol=1e-4)


def test_a_stream_refuses_to_go_on_after_another_call_changed_its_sequence(lm_image: bytes) -> None:
    lm = colibri.LM(lm_image)
    whole = list(lm.stream([1, 2, 3], 6))
    for cut_in in (lambda: lm.reset(), lambda: lm.forward_tokens([5]), lambda: lm.generate([9, 9], 2),
                   lambda: next(lm.stream([8], 3))):
        s = lm.stream([1, 2, 3], 6)
        assert [next(s), next(s)] == whole[:2]
        cut_in()
        with pytest.raises(RuntimeError, match="changed this LM's sequence"):
            next(s)
    assert list(lm.stream([1, 2, 3], 6)) == whole  # untouched, a stream runs to the end


# ---- integers are integers ----------------------------------------------------------------------

BAD_INTEGERS = [dict(max_new_tokens=2.7), dict(max_new_tokens=2.0), dict(top_k=1.5), dict(top_k=2.0),
                dict(seed=1.5), dict(seed="3"), dict(max_new_tokens=None)]


@pytest.mark.parametrize("bad", BAD_INTEGERS, ids=lambda d: ",".join(f"{k}={v!r}" for k, v in d.items()))
def test_a_float_where_an_integer_is_meant_is_a_type_error(lm_image: bytes, bad: dict) -> None:
    lm, ref = colibri.LM(lm_image), reference.LMState(image.read(lm_image))
    args = dict(max_new_tokens=3, temperature=0.5, top_k=4, seed=1) | bad
    name = next(iter(bad))
    for what, call in (("LM.generate", lambda: lm.generate([1, 2], **args)),
                       ("LM.stream", lambda: lm.stream([1, 2], **args)),
                       ("LMState.generate", lambda: ref.generate([1, 2], **args))):
        with pytest.raises(TypeError, match=f"{name} must be an integer"):
            call()
    if name != "max_new_tokens":
        with pytest.raises(TypeError, match=f"{name} must be an integer"):
            reference.sample(np.zeros(8, np.float32), 0.5, args["top_k"], 1.0, reference.Rng(args["seed"]))


def test_integer_types_other_than_int_are_accepted(lm_image: bytes) -> None:
    lm = colibri.LM(lm_image)
    want = lm.generate([1, 2], 3, temperature=0.5, top_k=4, seed=1)
    assert lm.generate([1, 2], np.int64(3), temperature=0.5, top_k=np.uint8(4), seed=np.int32(1)) == want
    assert reference.LMState(image.read(lm_image)).generate([1, 2], np.int16(3), temperature=0.5, top_k=4, seed=True) == \
        lm.generate([1, 2], 3, temperature=0.5, top_k=4, seed=1)


# ---- a Context made without __init__ ------------------------------------------------------------


def test_an_uninitialised_context_raises_bad_context_for_every_call() -> None:
    r = _child("""
        import numpy as np
        from colibri.runtime import _engine
        from colibri.model.format import Status
        ctx = _engine.Context.__new__(_engine.Context)
        f32, i32 = np.zeros(64, np.float32), np.zeros(4, np.int32)
        calls = {
            "forward": lambda: ctx.forward(f32, f32, 1),
            "forward_ex": lambda: ctx.forward_ex(f32, f32, 1, None, None),
            "kernels": lambda: ctx.kernels(),
            "lm_reset": lambda: ctx.lm_reset(),
            "lm_position": lambda: ctx.lm_position(),
            "lm_forward": lambda: ctx.lm_forward(i32, f32, 1),
            "lm_sample": lambda: ctx.lm_sample(f32, 0.0, 0, 1.0, 0),
            "lm_generate": lambda: ctx.lm_generate(i32, 3, 0.0, 0, 1.0, 0),
        }
        for name, call in calls.items():
            try:
                call()
            except _engine.EngineError as exc:
                assert exc.args[0] == Status.BAD_CONTEXT, (name, exc.args)
                print("refused", name)
            else:
                raise AssertionError(name + " did not raise")
        info = ctx.info()
        assert info["input_size"] == 0 and info["arena_size"] == 0
        # __init__ failing half-way (not a model) leaves the same safe object
        bad = _engine.Context.__new__(_engine.Context)
        try:
            bad.__init__(b"not a model at all, not even close to 80 bytes" * 2)
        except _engine.EngineError:
            pass
        try:
            bad.lm_generate(i32, 3, 0.0, 0, 1.0, 0)
        except _engine.EngineError as exc:
            assert exc.args[0] == Status.BAD_CONTEXT
            print("refused after a failed __init__")
    """)
    assert r.stdout.count("refused") == 9, r.stdout


# ---- memory lent to a callback ------------------------------------------------------------------


def test_rows_kept_by_an_expert_hook_cannot_reach_freed_memory(feature_image: bytes) -> None:
    r = _child("""
        import gc, sys
        import numpy as np
        import colibri
        from colibri.runtime import _engine
        image = bytes.fromhex(sys.argv[1])
        x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)

        # The ExpertCall a hook keeps: its rows are gone once the call returned.
        kept = []
        m = colibri.Model(image)
        want = m.forward(x)
        def keep_call(call):
            kept.append(call)
            return False
        assert np.array_equal(m.forward(x, expert=keep_call), want)
        for name in ("x", "y", "gate", "x_rows", "y_rows"):
            try:
                getattr(kept[0], name)
            except ValueError as exc:
                assert "valid during the call only" in str(exc)
            else:
                raise AssertionError(name)
        print("ExpertCall rows refused")

        # The raw views a hook keeps: released when the call returns, so any use raises.
        views = []
        ctx = _engine.Context(image)
        out = np.empty((4, 3), np.float32)
        def keep_views(layer, record, kind, act, d, hidden, offsets, n, vx, x_rows, gate, vy, y_rows):
            views.extend(v for v in (vx, x_rows, gate, vy, y_rows) if v is not None)
            return False
        ctx.forward_ex(x, out, 4, None, keep_views)
        assert np.array_equal(out, want)
        for v in views:
            try:
                v.tobytes()
            except ValueError:
                pass
            else:
                raise AssertionError("a kept view still reads")
        print("views released:", len(views))

        # An array the hook made from a view keeps the memory it views alive: written after the model
        # is gone, and after more models came and went, it writes memory nobody else uses.
        arrays = []
        def keep_arrays(call):
            arrays.append(call.y)
            arrays.append(call.x)
            return False
        m = colibri.Model(image)
        m.forward(x, expert=keep_arrays)
        del m
        gc.collect()
        others = [colibri.Model(image) for _ in range(8)]
        answers = [o.forward(x) for o in others]
        for a in arrays:
            if a.flags.writeable:
                a[...] = 123.0
            _ = float(a.sum())
        assert all(np.array_equal(o.forward(x), want) for o in others)
        print("kept arrays harmless:", len(arrays))
    """, feature_image.hex())
    assert "ExpertCall rows refused" in r.stdout and "views released:" in r.stdout, r.stdout
    assert "kept arrays harmless" in r.stdout, r.stdout
