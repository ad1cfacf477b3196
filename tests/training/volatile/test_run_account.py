"""A run's cost account: its totals, metrics and tracking."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopflow.training.volatile.cost import account_run
from mopflow.training.volatile.price_trace import PriceTrace
from mopflow.training.volatile.run_account import RunAccount, log_run_account
from tests.training.volatile.helpers import RecordingTracker

H = 3600.0


def test_an_account_from_totals_sums_the_costs_and_is_active_when_not_idle() -> None:
    acc = RunAccount.from_totals(
        worker_costs=[1.5, 0.5],
        wall_seconds=2 * H,
        idle_seconds=0.5 * H,
        billed_worker_seconds=3 * H,
        useful_worker_seconds=2 * H,
        wasted_worker_seconds=0.5 * H,
        units=3,
        failed_attempts=1,
        workers_per_unit=[2, 1, 2],
    )
    assert acc.cost == 2.0 and acc.worker_costs == (1.5, 0.5) and acc.workers_per_unit == (2, 1, 2)
    assert acc.active_seconds == pytest.approx(1.5 * H)
    metrics = acc.metrics("x_")
    assert metrics["x_waiting_worker_hours"] == pytest.approx(0.5)
    assert metrics["x_mean_active_workers"] == pytest.approx(5 / 3)


def test_log_run_account_logs_cost_times_and_active_workers() -> None:
    trace = PriceTrace((0.0, H, 1.5 * H, 2 * H), (0.5, 1.2, 3.0, 0.8), end=3 * H)
    acc = account_run(trace, [1.5, 1.0], [0.5 * H, H, 0.5 * H])
    tracker = RecordingTracker()
    log_run_account(tracker, "run", acc, bids=[1.5, 1.0])
    assert tracker.metrics["spot_cost"] == pytest.approx(2.4)
    assert tracker.metrics["spot_idle_hours"] == pytest.approx(0.5)
    assert tracker.metrics["spot_wasted_worker_hours"] == pytest.approx(0.5)
    assert tracker.params == {"spot_bids": "1.5,1", "spot_workers": 2}
    assert tracker.history["spot_active_workers"] == [(0, 2.0), (1, 1.0), (2, 2.0)]


@pytest.mark.slow
def test_log_run_account_to_a_real_mlflow(tmp_path: Path) -> None:
    from mopflow.base.tracking import MlflowTracker

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "cost", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("spot", {"stage": "cost"})
    trace = PriceTrace((0.0, 600.0, 1200.0), (1.0, 5.0, 1.0), end=4000.0)
    log_run_account(tracker, run_id, account_run(trace, [2.0, 2.0], [1000.0]), bids=[2.0, 2.0])
    data = tracker.client.get_run(run_id).data
    assert data.metrics["spot_cost"] == pytest.approx(3200 / H)
    assert data.metrics["spot_failed_attempts"] == 1.0
    assert data.params["spot_bids"] == "2,2"
