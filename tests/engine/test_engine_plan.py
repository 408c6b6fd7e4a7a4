"""The plan built once at init: colibri_forward parses no record of the image.

tests/c/colibri_plan runs each image, corrupts every record byte of its private
copy (header, the four tables, each Q8_PARAMS payload's 8-byte header),
runs the same context again and requires bit-identical outputs. The images
cover every layer op, every routing mode, pruned experts, shared experts with
and without a gate, and f32, f16, q8 (with compensation) and q8 with int8
activations. colibri_check sizes each one too: one byte short of
colibri_model_size is ARENA_TOO_SMALL, exactly that initialises and runs.

The arena grows by the plan only: one more layer, expert or MoE layer grows it by exactly the entry
sizes scripts/measure.py reports (and docs/measured.md shows) for the 64-bit host.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import colibri
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.model.format import Status
from helpers.build import ROOT
from helpers.randmodels import random_model
from helpers.c_drivers import check
from helpers.quant_models import quickstart_model


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


def _arena(*, experts_b: int = 2, extra_layer: bool = False, extra_moe: bool = False) -> int:
    """A model with two MoE layers (4 and experts_b experts, the same top_k and hidden), so adding an
    expert to the second one changes no other arena dimension."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 10), cnn.MoE(10, 4, 12, top_k=2, routing="topk_softmax"),
              cnn.MoE(10, experts_b, 12, top_k=2, routing="topk_softmax")]
    if extra_moe:
        layers.append(cnn.MoE(10, 1, 12, top_k=1, routing="top1"))
    layers.append(torch.nn.Linear(10, 3))
    if extra_layer:
        layers.append(torch.nn.ReLU())
    return colibri.arena_size(export(torch.nn.Sequential(*layers).eval(), None, max_batch=3).image)


def test_arena_grows_by_the_plan_entries() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import measure

    size = measure.plan_entry_bytes("gcc", "nm")

    def piece(count: int, entry: int) -> int:  # each arena piece is rounded up to 8 bytes
        return (count * entry + 7) // 8 * 8

    def grows(kind: str, before: int) -> int:
        return piece(before + 1, size[kind]) - piece(before, size[kind])

    base = _arena()  # 4 layers, 2 MoE layers, 6 experts
    assert _arena(extra_layer=True) - base == grows("layer", 4)
    assert _arena(experts_b=3) - base == grows("expert", 6)
    assert _arena(extra_moe=True) - base == grows("layer", 4) + grows("moe", 2) + grows("expert", 6)


@pytest.mark.cross
def test_model_format_quotes_the_plan_entry_sizes() -> None:
    """docs/model-format.md "Arena" gives each plan entry's bytes on both word sizes: they are the
    compilers' layouts (gcc for the host, arm-none-eabi-gcc with the engine's Cortex-M7 flags)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import measure

    host = measure.plan_entry_bytes("gcc", "nm")
    m7 = measure.plan_entry_bytes("arm-none-eabi-gcc", "arm-none-eabi-nm", "-mcpu=cortex-m7", "-mthumb",
                                  "-mfpu=fpv5-d16", "-mfloat-abi=hard")
    doc = (ROOT / "docs" / "model-format.md").read_text()
    rows = {"layer": "| layers |", "moe": "| MoE layers |", "expert": "| experts |"}
    for kind, start in rows.items():
        (row,) = [line for line in doc.splitlines() if line.startswith(start)]
        assert row.split("|")[3:5] == [f" {host[kind]} ", f" {m7[kind]} "], row
    formula = (f"`{host['layer']}·L + {host['moe']}·M + {host['expert']}·E` bytes on a 64-bit host "
               f"(`{m7['layer']}·L + {m7['moe']}·M + {m7['expert']}·E` on a 32-bit target")
    assert formula in " ".join(doc.split()), "the plan's byte formula in docs/model-format.md is stale"
