"""colibri_forward_ex (include/colibri.h): the caller's options (on_route, parallel_for over the POSIX
layer's colibri_pool, the expert hook, struct_size versioning) and colibri_model_size_ex, by the C
driver tests/c/colibri_exec_test.c: every way through gives colibri_forward's bits, with the optimised
and the reference kernels, plain and under ASan+UBSan, and (tests/kernels/test_kernels_aarch64.py style) under qemu-aarch64."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from colibri import nn as cnn
from colibri.frontends.exporter import export

from helpers.build import build_c_tests
from helpers.qemu_user import differential_feature_models

BATCH = 16
VARIANTS = [("f32", {}), ("f16", {"dtype": "f16"}), ("q8", {"dtype": "q8"}),
            ("q8-int8act", {"dtype": "q8", "int8_act": ["layers.0", "layers.2.experts.*", "layers.4"]})]


def _model(routing: str, index: int) -> torch.nn.Module:
    torch.manual_seed(300 + index)
    acts = cnn.ACTIVATIONS
    d_in, d, out = 29, 41, 13
    moe = cnn.MoE(d, 6, 57, top_k=1 if routing == "top1" else 2, routing=routing,
                  activation=acts[index % len(acts)], gated=index % 2 == 1,
                  num_shared=index % 3, shared_hidden=19, shared_gate=index % 3 == 1)
    moe2 = cnn.MoE(d, 3, 23, top_k=1, routing="top1", activation="relu")
    return torch.nn.Sequential(torch.nn.Linear(d_in, d), torch.nn.LayerNorm(d), moe, moe2,
                               torch.nn.Linear(d, out)).eval()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("exec")
    paths = differential_feature_models()
    for i, routing in enumerate(cnn.ROUTINGS):
        name, kw = VARIANTS[i % len(VARIANTS)]
        p = folder / f"{routing}-{name}.clb"
        export(_model(routing, i), p, max_batch=BATCH, **kw)
        paths.append(p)
    # LINEAR layers large enough for colibri_forward_ex to split their tokens across the workers.
    torch.manual_seed(9)
    wide = torch.nn.Sequential(torch.nn.Linear(40, 256), cnn.MoE(256, 4, 24, top_k=2, routing="topk_softmax"),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 7)).eval()
    for name, kw in (("f32", {}), ("q8-int8act", {"dtype": "q8", "int8_act": ["layers.0", "layers.2"]}),
                     ("q4-int8blocks", {"dtype": "q4", "int8_blocks": ["layers.0", "layers.1.experts.*", "layers.2"]})):
        p = folder / f"wide-{name}.clb"
        export(wide, p, max_batch=BATCH, **kw)
        paths.append(p)
    return paths


def test_forward_ex_matches_forward(c_drivers: Path, images: list[Path]) -> None:
    r = subprocess.run([str(c_drivers / "colibri_exec_test"), *map(str, images)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert f"exec ok: {len(images)} images" in r.stdout


@pytest.mark.sanitizer
def test_pool_under_threadsanitizer(images: list[Path]) -> None:
    drivers = build_c_tests("tsan")
    r = subprocess.run([str(drivers / "colibri_exec_test"), *map(str, images)], capture_output=True, text=True,
                       timeout=600, env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "ThreadSanitizer" not in r.stderr


@pytest.mark.qemu
@pytest.mark.cross
@pytest.mark.skipif(shutil.which("qemu-aarch64") is None or shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="needs qemu-user and gcc-aarch64-linux-gnu (scripts/setup.sh)")
def test_forward_ex_matches_forward_on_aarch64(images: list[Path]) -> None:
    drivers = build_c_tests("aarch64")
    r = subprocess.run(["qemu-aarch64", "-cpu", "max", "-L", "/usr/aarch64-linux-gnu",
                        str(drivers / "colibri_exec_test"), *map(str, images)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert f"exec ok: {len(images)} images" in r.stdout


def test_on_route_through_the_binding() -> None:
    """colibri.Model.forward(x, on_route=...) calls back once per MoE layer before its experts run, with
    the expert records about to run and their token counts; the output is forward's; an exception stops it."""
    import numpy as np

    import colibri

    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(12, 20),
                              cnn.MoE(20, 5, 32, top_k=2, routing="topk_softmax", num_shared=1, shared_hidden=8),
                              cnn.MoE(20, 4, 16, top_k=1, routing="top1"), torch.nn.Linear(20, 6)).eval()
    m = colibri.Model(bytes(export(net, None, max_batch=8).image))
    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    calls = []
    out = m.forward(x, on_route=lambda layer, experts, tokens: calls.append((layer, experts, tokens)))
    assert out.tobytes() == m.forward(x).tobytes()
    assert [c[0] for c in calls] == [0, 1]
    (_, e0, t0), (_, e1, t1) = calls
    assert sum(t0[:-1]) == 8 * 2 and t0[-1] == 8 and e0[-1] == 5  # routed records 0..4, the shared one 5
    assert sum(t1) == 8 and all(6 <= e < 10 for e in e1) and e1 == sorted(e1)

    def boom(layer, experts, tokens):
        raise KeyError(layer)

    with pytest.raises(KeyError):
        m.forward(x, on_route=boom)
    assert m.forward(x).tobytes() == out.tobytes()  # the context is still usable
