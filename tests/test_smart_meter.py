"""The smart meter example: real data, and a briefly trained MoE beats the seasonal-naive baseline."""
from __future__ import annotations

import sys

import numpy as np
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "smart_meter"))
import forecaster as F  # noqa: E402


def test_data_is_the_taylor_series() -> None:
    series = F.load_series()
    assert series.shape == (4032,) and 18_000 < series.min() and series.max() < 40_000
    data = F.dataset(series)
    assert data.x_train.shape[1] == F.N_FEATURES and data.y_test.shape == (F.TEST_DAYS, F.HORIZON)
    # No leakage: the last training target ends before the first held-out day.
    assert len(data.x_train) == len(series) - F.TEST_DAYS * F.STEPS_PER_DAY - F.HORIZON + 1 - F.WEEK


def test_moe_beats_seasonal_naive_and_fits_the_budget() -> None:
    torch.set_num_threads(1)
    data = F.dataset()
    moe = F.train(F.build_moe(), data, steps=1500)
    with torch.no_grad():
        pred = moe(torch.from_numpy(data.x_test)).numpy()
    assert F.mae_mw(pred, data) < 0.9 * F.naive_mae(data)
    assert abs(F.n_weights(moe) - F.n_weights(F.build_dense())) < 0.05 * F.n_weights(moe)  # same flash budget
    assert np.isfinite(pred).all()
