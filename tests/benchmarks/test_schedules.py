"""A worker schedule over a run, its worker-hours and step-size scaling (the growing-workers
benchmark's arithmetic, ``benchmarks/studies/schedules.py``)."""

from __future__ import annotations

import pytest
from studies.schedules import (
    saving_vs_static,
    scaled_step_size,
    schedule_values,
    worker_hours,
    worker_iterations,
    workers_at_iteration,
)

from mopflow.training.volatile.schedules import WorkerSchedule


def test_the_paper_schedule_saves_most_worker_iterations() -> None:
    s = WorkerSchedule(kind="exponential", eta=1.0004, n_max=16)
    # about 44% of the worker-iterations of 16 static workers over 10,000 iterations
    assert saving_vs_static(s, 10_000) == pytest.approx(0.436, abs=0.002)
    assert worker_iterations(s, 10_000) == sum(schedule_values(s, 10_000))


def test_static_and_step_schedules() -> None:
    assert schedule_values(WorkerSchedule(kind="static", n_max=4), 3) == (4, 4, 4)
    step = WorkerSchedule(kind="step", n_start=2, increment=3, period=2, n_max=9)
    assert schedule_values(step, 8) == (2, 2, 5, 5, 8, 8, 9, 9)
    assert saving_vs_static(WorkerSchedule(kind="static", n_max=4), 10) == 0.0


def test_per_epoch_schedule_holds_n_for_an_epoch() -> None:
    s = WorkerSchedule(kind="exponential", eta=2.0, n_max=16, unit="epoch")
    assert schedule_values(s, 7, iterations_per_epoch=3) == (1, 1, 1, 2, 2, 2, 4)
    assert workers_at_iteration(s, 10, iterations_per_epoch=3) == 8
    per_iter = WorkerSchedule(kind="exponential", eta=2.0, n_max=16)
    assert workers_at_iteration(per_iter, 4, iterations_per_epoch=3) == 8  # epochs ignored
    with pytest.raises(ValueError, match="iterations_per_epoch"):
        workers_at_iteration(WorkerSchedule(unit="epoch"), 1, 0)


def test_step_size_rules() -> None:
    assert scaled_step_size(0.03, 4, "linear") == pytest.approx(0.12)  # the paper's alpha = 0.03 n
    assert scaled_step_size(0.1, 16, "sqrt", reference_workers=4) == pytest.approx(0.2)
    assert scaled_step_size(0.1, 16, "none") == 0.1
    with pytest.raises(ValueError, match="linear, sqrt, none; got 'cubic'"):
        scaled_step_size(0.1, 2, "cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers=0"):
        scaled_step_size(0.1, 0, "linear")


def test_worker_hours() -> None:
    assert worker_hours([1, 2, 4], [1800.0, 1800.0, 3600.0]) == pytest.approx(5.5)
    with pytest.raises(ValueError, match="one duration per iteration"):
        worker_hours([1, 2], [1.0])
