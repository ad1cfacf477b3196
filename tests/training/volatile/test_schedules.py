"""Worker schedules n_j for volatile workers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from mopflow.training.volatile.schedules import WorkerSchedule, workers_at


def test_exponential_schedule_values() -> None:
    s = WorkerSchedule(kind="exponential", eta=2.0, n_max=10)
    assert [workers_at(s, j) for j in range(1, 8)] == [1, 2, 4, 8, 10, 10, 10]  # 2^3 = 8 exactly, not 9
    s15 = WorkerSchedule(kind="exponential", eta=1.5, n_max=100)
    # ceil(1.5^(j-1)): 1, 1.5, 2.25, 3.375, 5.0625
    assert [workers_at(s15, j) for j in range(1, 6)] == [1, 2, 3, 4, 6]
    assert workers_at(WorkerSchedule(eta=1.0, n_max=8), 1000) == 1


def test_paper_schedule_reaches_n_max_where_eta_power_does() -> None:
    s = WorkerSchedule(kind="exponential", eta=1.0004, n_max=16)
    j16 = 1 + math.ceil(math.log(15) / math.log(1.0004))  # first j with 1.0004^(j-1) > 15
    assert workers_at(s, j16 - 1) == 15 and workers_at(s, j16) == 16
    assert workers_at(s, 10**15) == 16  # no float overflow for huge j


def test_static_and_step_schedules() -> None:
    assert [workers_at(WorkerSchedule(kind="static", n_max=4), j) for j in (1, 2, 3)] == [4, 4, 4]
    step = WorkerSchedule(kind="step", n_start=2, increment=3, period=2, n_max=9)
    assert [workers_at(step, j) for j in range(1, 9)] == [2, 2, 5, 5, 8, 8, 9, 9]


def test_bad_schedule_inputs_are_named() -> None:
    with pytest.raises(ValidationError, match="eta"):
        WorkerSchedule(eta=0.5)
    with pytest.raises(ValidationError, match="n_start=5 exceeds n_max=4"):
        WorkerSchedule(kind="step", n_start=5, n_max=4)
    with pytest.raises(ValidationError):
        WorkerSchedule(kind="linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="j counts from 1, got 0"):
        workers_at(WorkerSchedule(), 0)


def test_training_volatile_does_not_import_airflow() -> None:
    code = "import sys, mopflow.training.volatile.schedules; print('airflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
