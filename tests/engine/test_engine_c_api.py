"""The public C API's argument checks, run natively and under ASan + UBSan."""
from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from colibri import nn as cnn
from colibri.frontends.exporter import export


def test_api_statuses(c_drivers: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), cnn.Residual(cnn.MoE(8, 3, 8, routing="dense")),
                                torch.nn.Linear(8, 2))
    path = tmp_path / "m.clb"
    export(model, path, max_batch=5)
    r = subprocess.run([str(c_drivers / "colibri_api_test"), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "API OK" in r.stdout and "FAIL" not in r.stdout
