"""Worker schedules for training on volatile workers (pure functions).

Zhang, Wang, Joshi, Joe-Wong (INFOCOM 2020) show that a number of workers growing over training,
``n_j = min(eta^(j-1), n_max)``, reaches the error of ``n_max`` static workers for far fewer
worker-hours: early iterations tolerate noisy gradients, late ones need many workers. Here:

* static: ``n_j = n_max``;
* step: ``n_j = min(n_start + increment * floor((j-1) / period), n_max)``;
* exponential: ``n_j = min(ceil(eta^(j-1)), n_max)``. Rounding rule: ceil, with values within a
  relative 1e-9 of an integer taken as that integer (so ``2^3`` is 8 despite float round-off).

``j`` counts iterations or epochs from 1 (``unit``). The growing-workers benchmark's helpers
(schedules over a run, worker-hours, step-size scaling) are in ``benchmarks/studies/schedules.py``.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ScheduleKind = Literal["static", "step", "exponential"]


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
