"""The plan built once at init: colibri_forward parses no record of the image.

tests/c/colibri_plan runs each image, corrupts every record byte of its private
copy (header, the four tables, each Q8_PARAMS payload's nnz and reserved words),
runs the same context again and requires bit-identical outputs. The images
cover every layer op, every routing mode, pruned experts, shared experts with
and without a gate, and f32, f16, q8 (with compensation) and q8 with int8
activations. colibri_check sizes each one too: one byte short of
colibri_model_size is ARENA_TOO_SMALL, exactly that initialises and runs.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from colibri import nn as cnn
from colibri.exporter import export
from colibri.format import Status
from randmodels import random_model
from test_robustness import check
from test_quantize import quickstart_model


def _images() -> dict[str, bytes]:
    images: dict[str, bytes] = {}
    quick = quickstart_model()
    for dtype in ("f32", "f16", "q8"):
        images[f"quickstart-{dtype}"] = export(quick, None, max_batch=5, dtype=dtype).image
    images["quickstart-q8-int8act"] = export(quick, None, max_batch=5, dtype="q8",
                                             int8_act=["layers.0", "layers.3.experts.*"]).image
    images["quickstart-pruned"] = export(quick, None, max_batch=3, prune=[1]).image
    for routing in cnn.ROUTINGS:
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 10), torch.nn.GELU(),
            cnn.Residual(torch.nn.LayerNorm(10), cnn.MoE(10, 5, 12, top_k=2 if routing != "top1" else 1,
                                                       routing=routing, num_shared=1, shared_hidden=4)),
            torch.nn.Linear(10, 3)).eval()
        images[f"routing-{routing}"] = export(model, None, max_batch=4).image
    for seed in range(6):
        model, _, max_batch = random_model(seed)
        images[f"random-{seed}"] = export(model, None, max_batch=max_batch).image
    return images


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plan")
    paths = {}
    for name, data in _images().items():
        paths[name] = folder / f"{name}.clb"
        paths[name].write_bytes(data)
    return paths


def test_forward_reads_no_record(c_drivers: Path, images: dict[str, Path]) -> None:
    r = subprocess.run([str(c_drivers / "colibri_plan"), *map(str, images.values())],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ok = [line for line in r.stdout.splitlines() if line.startswith("plan OK ")]
    assert len(ok) == len(images), r.stdout
    # Every image had records to corrupt: the header at least, and its tables.
    assert all(int(line.rsplit(": ", 1)[1].split()[0]) > 80 for line in ok), r.stdout


def test_arena_is_exact_for_every_image_kind(c_drivers: Path, images: dict[str, Path]) -> None:
    results = check(c_drivers, [p.read_bytes() for p in images.values()])
    for name, f in zip(images, results):
        assert f["short"] == str(int(Status.ARENA_TOO_SMALL)), (name, f)
        assert f["init"] == "0" and f["fwd1"] == "0" and f["fwdN"] == "0", (name, f)
