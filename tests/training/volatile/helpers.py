"""Shared test helpers for the volatile-worker wing: a recording tracker and a small growing run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mopflow.training.models.builtin import ArchSpec
from mopflow.training.volatile.growing import GrowingConfig
from mopflow.training.volatile.price_trace import PriceTrace
from mopflow.training.volatile.prices import UniformPrices
from mopflow.training.volatile.spot_plan_model import SpotPlanConfig
from mopflow.training.volatile.workers import WorkerSchedule

UNIFORM = UniformPrices(low=0.1, high=1.2)
ARCH = ArchSpec("mlp", {"width": 8, "depth": 1}, 6, 3)
# slots of 10 s: price 1 (both bids active), 3 (only the 4.0 bid), 9 (none: idle), 1, 1, ...
TRACE = PriceTrace((0.0, 10.0, 20.0, 30.0), (1.0, 3.0, 9.0, 1.0), end=200.0)


class RecordingTracker:
    """Keeps what is logged (a Tracker for tests; the product uses MlflowTracker)."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}

    def find_run(self, tags: Mapping[str, str]) -> str | None:
        return None

    def start_run(self, name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str:
        return "run"

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_metric_history(self, run_id: str, key: str, values: Iterable[tuple[int, float]]) -> None:
        self.history[key] = list(values)

    def log_dict(self, run_id: str, obj: Any, artifact_file: str) -> None: ...

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None: ...

    def end_run(self, run_id: str, status: str = "FINISHED") -> None: ...


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


def plan_config(**kw: object) -> SpotPlanConfig:
    """Uniform prices on [0.1, 1.2], a 3 h deadline, error target 0.05, up to 16 workers, on-demand at 1."""
    base: dict[str, object] = {
        "prices": UNIFORM,
        "deadline_hours": 3.0,
        "error_target": 0.05,
        "n_max": 16,
        "on_demand_price": 1.0,
    }
    return SpotPlanConfig.model_validate({**base, **kw})
