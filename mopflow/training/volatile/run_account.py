"""A run's cost account on volatile workers: what it cost, where its time went, and its tracking.

:class:`RunAccount` is what every accounting in :mod:`mopflow.training.volatile.cost` returns (a record of
work replayed against a price trace, task-parallel units, or a replay's real billed intervals);
:func:`log_run_account` writes it through an injected :class:`~mopflow.base.tracking.Tracker`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mopflow.base.tracking import Tracker
from mopflow.training.volatile.prices import SECONDS_PER_HOUR


@dataclass(frozen=True)
class RunAccount:
    """What a run on volatile workers cost and where its time went (seconds; money per the trace's unit)."""

    cost: float
    worker_costs: tuple[float, ...]
    wall_seconds: float
    active_seconds: float  # at least one provisioned worker active
    idle_seconds: float  # no provisioned worker active: the run waits
    billed_worker_seconds: float
    useful_worker_seconds: float  # work that went into completed units
    wasted_worker_seconds: float  # work lost to preemption
    units: int
    failed_attempts: int  # unit attempts lost because every worker was preempted
    workers_per_unit: tuple[int, ...]  # active workers that completed each unit (y_j)

    @classmethod
    def from_totals(
        cls,
        *,
        worker_costs: Sequence[float],
        wall_seconds: float,
        idle_seconds: float,
        billed_worker_seconds: float,
        useful_worker_seconds: float,
        wasted_worker_seconds: float,
        units: int,
        failed_attempts: int,
        workers_per_unit: Sequence[int] = (),
    ) -> RunAccount:
        """The account of a run's totals: its cost is the workers' costs summed, and it is active
        whenever it is not idle."""
        costs = tuple(worker_costs)
        return cls(
            cost=sum(costs),
            worker_costs=costs,
            wall_seconds=wall_seconds,
            active_seconds=wall_seconds - idle_seconds,
            idle_seconds=idle_seconds,
            billed_worker_seconds=billed_worker_seconds,
            useful_worker_seconds=useful_worker_seconds,
            wasted_worker_seconds=wasted_worker_seconds,
            units=units,
            failed_attempts=failed_attempts,
            workers_per_unit=tuple(workers_per_unit),
        )

    def metrics(self, prefix: str = "spot_") -> dict[str, float]:
        """Flat metrics (hours for times) for tracking."""
        h = SECONDS_PER_HOUR
        mean_workers = (
            sum(self.workers_per_unit) / len(self.workers_per_unit) if self.workers_per_unit else 0.0
        )
        values = {
            "cost": self.cost,
            "wall_hours": self.wall_seconds / h,
            "active_hours": self.active_seconds / h,
            "idle_hours": self.idle_seconds / h,
            "billed_worker_hours": self.billed_worker_seconds / h,
            "useful_worker_hours": self.useful_worker_seconds / h,
            "wasted_worker_hours": self.wasted_worker_seconds / h,
            "waiting_worker_hours": max(
                0.0, self.billed_worker_seconds - self.useful_worker_seconds - self.wasted_worker_seconds
            )
            / h,
            "units": float(self.units),
            "failed_attempts": float(self.failed_attempts),
            "mean_active_workers": mean_workers,
        }
        return {prefix + k: float(v) for k, v in values.items()}


def log_run_account(
    tracker: Tracker,
    run_id: str,
    account: RunAccount,
    bids: Sequence[float] | None = None,
    prefix: str = "spot_",
    extra_params: Mapping[str, object] | None = None,
) -> dict[str, float]:
    """Log a run's cost account to the tracker (MLflow in production); returns the metrics logged."""
    metrics = account.metrics(prefix)
    params: dict[str, object] = dict(extra_params or {})
    if bids is not None:
        params[prefix + "bids"] = ",".join(f"{b:g}" for b in bids)
        params[prefix + "workers"] = len(bids)
    if params:
        tracker.log_params(run_id, params)
    tracker.log_metrics(run_id, metrics)
    if account.workers_per_unit:
        tracker.log_metric_history(
            run_id, prefix + "active_workers", list(enumerate(float(y) for y in account.workers_per_unit))
        )
    return metrics
