"""Shared test helpers for the volatile-worker wing: a recording tracker and spot-plan configs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mopflow.training.volatile.prices import UniformPrices
from mopflow.training.volatile.spot_plan_model import SpotPlanConfig

UNIFORM = UniformPrices(low=0.1, high=1.2)
# slots of 10 s: price 1 (both bids active), 3 (only the 4.0 bid), 9 (none: idle), 1, 1, ...


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
