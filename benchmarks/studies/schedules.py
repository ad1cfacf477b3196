"""A worker schedule over a whole run, its worker-hours and the step size that follows the
workers (linear / sqrt / none): the growing-workers benchmark's arithmetic
(``benchmarks/volatile.py``, :mod:`studies.growing`) on :class:`~mopflow.training.volatile.schedules.WorkerSchedule`.
:func:`workers_at_iteration` maps an iteration to its epoch when the schedule is per epoch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from mopflow.training.volatile.schedules import WorkerSchedule, workers_at

ScalingRule = Literal["linear", "sqrt", "none"]


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
