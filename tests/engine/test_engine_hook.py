"""The accelerator hook (colibri_exec.expert, include/colibri.h; docs/accelerator.md) through the CPython
binding, `colibri.Model.forward(x, expert=fn)`, with genuine implementations:

- a numpy "device" that runs every expert itself from the image's weights in place (f32, f16 and int8
  with its companion's scales, bias and compensation) and must match the engine within TOLERANCE;
- a hook that declines every expert: the engine runs them all and the output is bit for bit the
  plain forward's; one that declines chosen experts and runs the rest;
- a hook that fails on a chosen expert: its exception propagates, and the context stays correct.

What the hook is shown is checked too: the engine's own rows (no copies, the same buffers for every
expert of a layer), the tokens and gates on_route announced."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

import colibri
from colibri import nn as cnn
from colibri import reference
from colibri.frontends.exporter import export
from colibri.model.ir import F16Weight, Q4Weight, Q8Weight, dense

from helpers.build import build_c_tests
from helpers.hook_models import BATCH, DTYPES, TOLERANCE, hook_net


@pytest.fixture(scope="module", params=list(DTYPES))
def model(request) -> tuple[str, colibri.Model]:
    image = bytes(export(hook_net(), None, max_batch=BATCH, **DTYPES[request.param]).image)
    return request.param, colibri.Model(image)


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal((BATCH, 10)) * 2).astype(np.float32)


def _dense(w) -> np.ndarray:
    """A weight of the image as f32 [rows, cols]: a view for f32, widened f16, dequantised int8."""
    if isinstance(w, F16Weight):
        return w.data.astype(np.float32)
    if isinstance(w, Q8Weight):
        return w.q.astype(np.float32) * w.scale.astype(np.float32)[:, None] + w.compensation()
    if isinstance(w, Q4Weight):
        return dense(w)
    return w


def _linear(v: np.ndarray, w, b: np.ndarray | None) -> np.ndarray:
    y = v @ _dense(w).T
    if isinstance(w, (Q8Weight, Q4Weight)) and w.bias is not None:  # the bias travels in the companion
        y += w.bias.astype(np.float32)
    return y if b is None else y + b


def numpy_device(call: colibri.runtime.engine.ExpertCall) -> bool:
    """Runs the expert with numpy, as a device would: y[y_row(i)] += gate[i] · expert(x[x_row(i)])."""
    e = call.spec
    if e.int8_act:
        return False  # this device has no int8-activation path: the engine runs it
    rows = np.arange(call.n) if call.x_rows is None else call.x_rows
    v = call.x[rows]
    h = reference.activation(e.act, _linear(v, e.w1, e.b1))
    if e.w3 is not None:
        h = h * _linear(v, e.w3, e.b3)
    out = _linear(h, e.w2, e.b2)
    if call.gate is not None:
        out *= call.gate[:, None]
    # A ring lists each token once, so the fancy-index add touches every output row once.
    call.y[np.arange(call.n) if call.y_rows is None else call.y_rows] += out
    return True


def _within(got: np.ndarray, want: np.ndarray) -> float:
    """The error in units of the tolerance's scale."""
    return float(np.max(np.abs(got - want)) / (1.0 + np.max(np.abs(want))))


def test_numpy_device_matches_the_engine(model, x) -> None:
    dtype, m = model
    calls = []

    def device(call):
        ran = numpy_device(call)
        calls.append((call.layer, call.expert, call.n, ran))
        return ran

    want = m.forward(x)
    got = m.forward(x, expert=device)
    err = _within(got, want)
    print(f"{dtype}: numpy device vs engine {m.kernels}: max|d| / (1 + max|y|) = {err:.3g}")
    assert err <= TOLERANCE, (dtype, err)
    assert not np.array_equal(got, want)  # it really ran elsewhere (different rounding)
    # Layer 0: the routed experts that got tokens (2 per token) and the shared one over the batch.
    assert sum(n for layer, e, n, _ in calls if layer == 0) == BATCH * 2 + BATCH
    assert sum(n for layer, e, n, _ in calls if layer == 1) == BATCH
    # Only the int8-activation experts (MoE layer 0's routed ones, records 0..4) go back to the engine.
    declined = {e for _, e, _, ran in calls if not ran}
    assert declined == ({e for _, e, _, _ in calls if e < 5} if dtype == "q8-int8act" else set())
    # Beyond max_batch the pass runs in chunks, each offered to the hook.
    big = np.concatenate([x, x[::-1], x[:3]])
    assert _within(m.forward(big, expert=numpy_device), m.forward(big)) <= TOLERANCE


def test_reference_kernels_match_the_numpy_device(x) -> None:
    m = colibri.Model(bytes(export(hook_net(), None, max_batch=BATCH).image), reference_kernels=True)
    err = _within(m.forward(x, expert=numpy_device), m.forward(x))
    print(f"f32 reference kernels vs numpy device: {err:.3g}")
    assert err <= TOLERANCE


def test_the_hook_sees_the_engines_rows_in_place(model, x) -> None:
    """x and y are the engine's buffers, not copies: one input and one output buffer per layer for all
    its experts, a ring's token indices as x_rows and y_rows alike, the tokens and gates on_route shows."""
    _, m = model
    seen: dict[int, set] = {}
    routed: dict[tuple[int, int], int] = {}

    def on_route(layer, experts, tokens):
        routed.update({(layer, e): t for e, t in zip(experts, tokens)})

    def look(call):
        assert call.x.shape == (BATCH, call.d) and not call.x.flags.writeable and call.y.flags.writeable
        seen.setdefault(call.layer, set()).add((call.x.ctypes.data, call.y.ctypes.data))
        assert routed[(call.layer, call.expert)] == call.n
        if call.x_rows is not None:  # routed: the ring, once per token, in order, gates nonzero
            assert call.y_rows is not None and call.x_rows.ctypes.data == call.y_rows.ctypes.data
            assert np.all(np.diff(call.x_rows.astype(int)) > 0) and call.x_rows[-1] < BATCH
            assert np.all(call.gate != 0)
        else:  # shared: every token, scaled by the shared gate
            assert call.n == BATCH and call.gate.shape == (BATCH,) and np.all((call.gate > 0) & (call.gate < 1))
        return False

    assert m.forward(x, on_route=on_route, expert=look).tobytes() == m.forward(x).tobytes()
    assert sorted(seen) == [0, 1] and all(len(buffers) == 1 for buffers in seen.values())


def test_declining_every_expert_is_the_plain_forward(model, x) -> None:
    _, m = model
    offered = []
    out = m.forward(x, expert=lambda call: offered.append((call.layer, call.expert)) or False)
    assert out.tobytes() == m.forward(x).tobytes()
    assert len(offered) == len(set(offered)) and {layer for layer, _ in offered} == {0, 1}


def test_declining_chosen_experts(model, x) -> None:
    """Odd expert records go back to the engine, the numpy device runs the rest: the result is still the
    engine's within the tolerance, and the declined experts did count (dropping them instead changes it)."""
    dtype, m = model
    declined, ran = set(), set()

    def half(call):
        if call.expert % 2:
            declined.add(call.expert)
            return False
        ran.add(call.expert)
        return numpy_device(call)

    want = m.forward(x)
    assert _within(m.forward(x, expert=half), want) <= TOLERANCE
    assert declined and ran

    def drop_declined(call):
        return True if call.expert % 2 else numpy_device(call)  # claims the odd ones, adds nothing

    assert _within(m.forward(x, expert=drop_declined), want) > 100 * TOLERANCE


class DeviceFault(RuntimeError):
    pass


def test_a_failing_expert_stops_the_pass(model, x) -> None:
    """A hook that fails on a chosen expert: its own exception propagates (the engine's status stops the
    pass at that expert: nothing after it is offered), and the context stays correct."""
    _, m = model
    want = m.forward(x)
    offered = []

    def faulty(call):
        offered.append(call.expert)
        if call.layer == 1:
            raise DeviceFault(f"expert {call.expert}: device timeout")
        return numpy_device(call)

    with pytest.raises(DeviceFault, match="device timeout"):
        m.forward(x, expert=faulty)
    assert offered and sum(1 for e in offered if e >= 6) == 1  # layer 1's records start at 6; only its first ran
    assert m.forward(x).tobytes() == want.tobytes()
    assert _within(m.forward(x, expert=numpy_device), want) <= TOLERANCE


def test_bad_hooks() -> None:
    m = colibri.Model(bytes(export(hook_net(), None, max_batch=BATCH).image))
    with pytest.raises(TypeError, match="expert must be callable"):
        m.forward(np.zeros((1, 10), np.float32), expert=3)


@pytest.fixture(scope="module")
def hook_images(tmp_path_factory) -> list:
    tmp_path = tmp_path_factory.mktemp("hook")
    paths = []
    for name, kw in DTYPES.items():
        paths.append(tmp_path / f"{name}.clb")
        export(hook_net(), paths[-1], max_batch=BATCH, **kw)
    torch.manual_seed(3)  # MLP experts, every activation the exporter writes, no shared expert
    for act in cnn.ACTIVATIONS:
        paths.append(tmp_path / f"mlp-{act}.clb")
        export(torch.nn.Sequential(cnn.MoE(10, 3, 17, top_k=2, routing="softmax_topk", activation=act)), paths[-1],
               max_batch=BATCH)
    return paths


def test_second_thread_device_in_c(c_drivers, hook_images) -> None:
    """tests/c/colibri_hook_test.c: the hook hands each expert to a device thread with its own code (double
    sums from the F32/F16 payloads in place; I8 and I4 declined), single-threaded and over a 2-worker pool, within
    its TOLERANCE (1e-6 of 1 + max|y|); failing on an expert returns the status, the next forward is exact."""
    paths = hook_images
    r = subprocess.run([str(c_drivers / "colibri_hook_test"), *map(str, paths)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert f"hook ok: {len(paths)} images" in r.stdout
    ran = [line for line in r.stdout.splitlines() if "device ran" in line]
    # f32/f16 experts ran on the device (it declines I8 and I4)
    assert all("ran 0 " not in line for line in ran if "q8" not in line and "q4" not in line)
    print(r.stdout.splitlines()[-1])


@pytest.mark.sanitizer
def test_second_thread_device_under_threadsanitizer(hook_images) -> None:
    """The device thread, the pool's workers and the engine share the rows only through the hook's
    handshake: ThreadSanitizer finds no race."""
    r = subprocess.run([str(build_c_tests("tsan") / "colibri_hook_test"), *map(str, hook_images)],
                       capture_output=True, text=True, timeout=900,
                       env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "ThreadSanitizer" not in r.stderr


def test_a_mapped_model_file(tmp_path, x) -> None:
    """A model mapped from its file (weights verified on first use through on_route) offers the mapping's
    payloads to the hook in the same way."""
    path = tmp_path / "m.clb"
    export(hook_net(), path, max_batch=BATCH, dtype="f16")
    m = colibri.Model(path)
    assert m.file is not None
    assert _within(m.forward(x, expert=numpy_device), m.forward(x)) <= TOLERANCE
