"""A small growing run for the tests of the growing-workers study (``benchmarks/studies/growing.py``)."""

from __future__ import annotations

import torch
from studies.growing import GrowingConfig

from mopflow.training.models.builtin import ArchSpec
from mopflow.training.volatile.price_trace import PriceTrace
from mopflow.training.volatile.schedules import WorkerSchedule

ARCH = ArchSpec("mlp", {"width": 8, "depth": 1}, 6, 3)
TRACE = PriceTrace((0.0, 10.0, 20.0, 30.0), (1.0, 3.0, 9.0, 1.0), end=200.0)


def growing_data(rows: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A small seeded classification task for :data:`ARCH`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, ARCH.input_dim, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def growing_config(**overrides: object) -> GrowingConfig:
    """6 iterations on n_j = 1, 2, 4, 4, 4, 4 workers (``overrides`` replace fields)."""
    base: dict[str, object] = {
        "schedule": WorkerSchedule(kind="exponential", eta=2.0, n_max=4),
        "iterations": 6,
        "batch_size": 4,
        "base_lr": 0.05,
    }
    base.update(overrides)
    return GrowingConfig.model_validate(base)


def volatile_growing_config(**overrides: object) -> GrowingConfig:
    """4 iterations of 10 s (one :data:`TRACE` slot each) on 2 static workers."""
    return growing_config(
        schedule=WorkerSchedule(kind="static", n_max=2), iterations=4, iteration_seconds=10.0, **overrides
    )
