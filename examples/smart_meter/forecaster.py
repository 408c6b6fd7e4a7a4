"""Day-ahead load forecasting for a smart meter / substation: a 3-expert MoE
against a seasonal-naive baseline and a dense MLP of the same flash budget.

Data: half-hourly electricity demand of England and Wales, 5 June – 27 August
2000 (Taylor 2003), shipped inside the `pmdarima` package — 12 weeks, 4,032
readings in MW. Each sample looks at the last 24 hours and the same 24 hours
one week earlier, plus the calendar, and forecasts the next 24 hours (48
half-hours). The last 3 weeks are held out: forecasts issued at midnight of
each held-out day are scored by mean absolute error (MW).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from colibri import nn as cnn

STEPS_PER_DAY = 48
WEEK = 7 * STEPS_PER_DAY
HORIZON = STEPS_PER_DAY
TEST_DAYS = 21
N_FEATURES = 2 * STEPS_PER_DAY + 7 + 2  # last day, same day last week, weekday one-hot, time of day


@dataclass
class Dataset:
    x_train: np.ndarray  # [n, N_FEATURES]
    y_train: np.ndarray  # [n, HORIZON], scaled
    x_test: np.ndarray  # midnight origins of the held-out days
    y_test: np.ndarray  # MW
    naive_test: np.ndarray  # seasonal naive (same day last week), MW
    mean: float
    std: float


def load_series() -> np.ndarray:
    from pmdarima.datasets import load_taylor

    return load_taylor(as_series=False).astype(np.float32)


def features(series: np.ndarray, t: int, mean: float, std: float) -> np.ndarray:
    """Inputs for a forecast issued at step t (the first step forecast is t)."""
    day = (t // STEPS_PER_DAY) % 7  # the series starts on a Monday
    phase = 2 * np.pi * (t % STEPS_PER_DAY) / STEPS_PER_DAY
    return np.concatenate([
        (series[t - STEPS_PER_DAY : t] - mean) / std,
        (series[t - WEEK : t - WEEK + HORIZON] - mean) / std,
        np.eye(7, dtype=np.float32)[day],
        np.array([np.sin(phase), np.cos(phase)], dtype=np.float32),
    ]).astype(np.float32)


def dataset(series: np.ndarray | None = None) -> Dataset:
    series = load_series() if series is None else series
    split = len(series) - TEST_DAYS * STEPS_PER_DAY
    mean, std = float(series[:split].mean()), float(series[:split].std())
    # Training origins: every half-hour whose whole target lies before the split.
    train_t = range(WEEK, split - HORIZON + 1)
    x_train = np.stack([features(series, t, mean, std) for t in train_t])
    y_train = np.stack([(series[t : t + HORIZON] - mean) / std for t in train_t]).astype(np.float32)
    test_t = range(split, len(series) - HORIZON + 1, STEPS_PER_DAY)  # midnight of each held-out day
    x_test = np.stack([features(series, t, mean, std) for t in test_t])
    y_test = np.stack([series[t : t + HORIZON] for t in test_t])
    naive = np.stack([series[t - WEEK : t - WEEK + HORIZON] for t in test_t])
    return Dataset(x_train, y_train, x_test, y_test, naive, mean, std)


def build_moe(seed: int = 0) -> torch.nn.Module:
    """The smart meter's model: 3 SwiGLU experts, top-2 (Mixtral routing), in a residual block."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 32),
        cnn.Residual(cnn.MoE(32, 3, 48, top_k=2, routing="topk_softmax", gated=True, activation="silu")),
        torch.nn.Linear(32, HORIZON),
    )


def build_dense(seed: int = 0) -> torch.nn.Module:
    """A dense MLP with about the same number of weights (the same flash)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 80), torch.nn.GELU(), torch.nn.Linear(80, 80), torch.nn.GELU(),
        torch.nn.Linear(80, HORIZON),
    )


def n_weights(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train(model: torch.nn.Module, data: Dataset, *, steps: int = 3000, seed: int = 0, progress: bool = False) -> torch.nn.Module:
    from rich.progress import track

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    for _ in track(range(steps), description=f"training {type(model).__name__}", disable=not progress, transient=True):
        idx = torch.randint(0, len(x), (128,), generator=gen)
        loss = torch.nn.functional.l1_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


def mae_mw(pred_scaled: np.ndarray, data: Dataset) -> float:
    return float(np.abs(pred_scaled * data.std + data.mean - data.y_test).mean())


def naive_mae(data: Dataset) -> float:
    return float(np.abs(data.naive_test - data.y_test).mean())
