"""A model packed as a C array (colibri pack --c-array) links into the runner and forecasts on target."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import colibri
from colibri.target.device import Device
from colibri.frontends.exporter import export
from colibri.target.pack import c_array
from colibri.target.qemu import Qemu

from helpers.build import ROOT, make

sys.path.insert(0, str(ROOT / "examples" / "smart_meter"))
import forecaster as F  # noqa: E402

pytestmark = [pytest.mark.qemu, pytest.mark.cross]


def test_linked_in_model_answers_like_the_host(tmp_path) -> None:
    data = F.dataset()
    image = export(F.build_moe(seed=3), None, max_batch=7, dtype="q8").image
    packed = c_array(image, tmp_path / "gen")
    r = make("-C", str(ROOT / "firmware" / "runner"), "BOARD=mps2_an500", f"MODEL_C={packed.source}")
    assert r.returncode == 0, r.stdout + r.stderr
    elf = ROOT / "firmware" / "runner" / "build" / "mps2_an500-builtin" / "runner.elf"
    host = colibri.Model(image)
    with Qemu(elf) as q, Device(q.url) as dev:
        info = dev.model_info()  # no upload: the model is in the firmware
        assert (info.input_size, info.output_size, info.image_size) == (F.N_FEATURES, F.HORIZON, len(image))
        assert dev.slot_info().running == "built-in"
        got, work = dev.forward(data.x_test[:7])
    want = host.forward(data.x_test[:7])
    assert np.abs(got - want).max() <= 1e-5 * (1 + np.abs(want).max())
    assert work.count > 0
