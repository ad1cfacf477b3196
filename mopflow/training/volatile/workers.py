"""Worker schedules and step-size scaling for training on volatile workers (pure functions).

Zhang, Wang, Joshi, Joe-Wong (INFOCOM 2020) show that a number of workers growing over training,
``n_j = min(eta^(j-1), n_max)``, reaches the error of ``n_max`` static workers for far fewer
worker-hours: early iterations tolerate noisy gradients, late ones need many workers. Here:

* static: ``n_j = n_max``;
* step: ``n_j = min(n_start + increment * floor((j-1) / period), n_max)``;
* exponential: ``n_j = min(ceil(eta^(j-1)), n_max)``. Rounding rule: ceil, with values within a
  relative 1e-9 of an integer taken as that integer (so ``2^3`` is 8 despite float round-off).

``j`` counts iterations or epochs from 1 (``unit``); :func:`workers_at_iteration` maps an iteration
to its epoch when the schedule is per epoch. The step size follows the workers (linear / sqrt / none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ScheduleKind = Literal["static", "step", "exponential"]
ScalingRule = Literal["linear", "sqrt", "none"]


class WorkerSchedule(BaseModel):
    """How many workers iteration (or epoch) j uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ScheduleKind = "exponential"
    n_max: int = Field(16, ge=1, le=100_000, description="the most workers ever used")
    eta: float = Field(1.0004, ge=1.0, le=1e6, allow_inf_nan=False, description="exponential growth ratio")
    n_start: int = Field(1, ge=1, description="step: workers in the first period")
    increment: int = Field(1, ge=0, description="step: workers added each period")
    period: int = Field(1000, ge=1, description="step: iterations (or epochs) per period")
    unit: Literal["iteration", "epoch"] = "iteration"

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSchedule:
        if self.kind == "step" and self.n_start > self.n_max:
            raise ValueError(f"step schedule: n_start={self.n_start} exceeds n_max={self.n_max}")
        return self


def _ceil_tolerant(x: float) -> int:
    nearest = round(x)
    if abs(x - nearest) <= 1e-9 * max(1.0, abs(x)):
        return int(nearest)
    return math.ceil(x)


def workers_at(schedule: WorkerSchedule, j: int) -> int:
    """n_j for iteration (or epoch) j >= 1."""
    if j < 1:
        raise ValueError(f"j counts from 1, got {j}")
    if schedule.kind == "static":
        return schedule.n_max
    if schedule.kind == "step":
        return min(schedule.n_start + schedule.increment * ((j - 1) // schedule.period), schedule.n_max)
    # Compare in log space first: eta^(j-1) overflows a float long before j is large.
    if schedule.eta == 1.0:
        return 1
    if (j - 1) * math.log(schedule.eta) >= math.log(schedule.n_max):
        return schedule.n_max
    return min(_ceil_tolerant(schedule.eta ** (j - 1)), schedule.n_max)


def workers_at_iteration(schedule: WorkerSchedule, iteration: int, iterations_per_epoch: int = 1) -> int:
    """n for a given iteration (from 1): per-epoch schedules hold n for a whole epoch."""
    if iteration < 1:
        raise ValueError(f"iteration counts from 1, got {iteration}")
    if schedule.unit == "iteration":
        return workers_at(schedule, iteration)
    if iterations_per_epoch < 1:
        raise ValueError(f"iterations_per_epoch must be >= 1, got {iterations_per_epoch}")
    return workers_at(schedule, (iteration - 1) // iterations_per_epoch + 1)


def schedule_values(schedule: WorkerSchedule, count: int, iterations_per_epoch: int = 1) -> tuple[int, ...]:
    """n_1..n_count per iteration (epochs expanded to their iterations)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return tuple(workers_at_iteration(schedule, i, iterations_per_epoch) for i in range(1, count + 1))


def worker_iterations(schedule: WorkerSchedule, iterations: int, iterations_per_epoch: int = 1) -> int:
    """Sum of n_j over the run: worker-iterations, proportional to worker-hours at a fixed iteration time."""
    return sum(schedule_values(schedule, iterations, iterations_per_epoch))


def worker_hours(workers: Sequence[int], iteration_seconds: Sequence[float]) -> float:
    """Worker-hours of a run from each iteration's worker count and duration."""
    if len(workers) != len(iteration_seconds):
        raise ValueError(
            f"need one duration per iteration: {len(workers)} worker counts, {len(iteration_seconds)} durations"
        )
    return sum(n * s for n, s in zip(workers, iteration_seconds, strict=True)) / 3600.0


def saving_vs_static(schedule: WorkerSchedule, iterations: int, iterations_per_epoch: int = 1) -> float:
    """Fraction of worker-iterations saved against n_max static workers over the same iterations."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    static = schedule.n_max * iterations
    return 1.0 - worker_iterations(schedule, iterations, iterations_per_epoch) / static


def scaled_step_size(base: float, workers: int, rule: ScalingRule, reference_workers: int = 1) -> float:
    """Step size for ``workers`` workers, given ``base`` tuned for ``reference_workers``.

    linear: ``base * n / n_ref`` (the paper's alpha = 0.03 n; keeps the per-sample step with larger
    aggregated batches), sqrt: ``base * sqrt(n / n_ref)`` (keeps the gradient noise scale), none: base.
    """
    if not base > 0 or not math.isfinite(base):
        raise ValueError(f"base step size must be finite and > 0, got {base}")
    if workers < 1 or reference_workers < 1:
        raise ValueError(f"worker counts must be >= 1, got workers={workers}, reference={reference_workers}")
    ratio = workers / reference_workers
    if rule == "linear":
        return base * ratio
    if rule == "sqrt":
        return base * math.sqrt(ratio)
    if rule == "none":
        return base
    raise ValueError(f"step-size rule must be one of linear, sqrt, none; got {rule!r}")
