"""A growing run after the fact: cost over time, the cost of a prefix, and its tracking."""

from __future__ import annotations

from pathlib import Path

import pytest
from studies.growing import Volatility, train_growing
from studies.growing_report import account_prefix, cost_curve, log_growing_run

from mopflow.training.volatile.prices import SECONDS_PER_HOUR
from tests.benchmarks.growing_helpers import ARCH, TRACE, growing_data, volatile_growing_config


def test_the_cost_curve_adds_each_slots_price_times_its_active_workers() -> None:
    cfg = volatile_growing_config()
    volatility = Volatility(TRACE, (4.0, 2.0))
    result = train_growing(cfg, ARCH, growing_data(), volatility=volatility)
    curve = cost_curve(result, volatility, cfg)
    # slots: 2 workers at 1, 1 worker at 3, idle at 9 (free), 2 at 1, 2 at 1; 10 s each
    expected = [20.0, 50.0, 50.0, 70.0, 90.0]
    assert curve == pytest.approx([c / SECONDS_PER_HOUR for c in expected])
    assert result.account is not None and curve[-1] == pytest.approx(result.account.cost)
    for rec, cost in zip(result.records, curve, strict=True):
        if rec.active:  # after iteration j: the account of the first j iterations
            assert cost == pytest.approx(account_prefix(result, volatility, cfg, rec.iteration).cost)
    later = Volatility(TRACE, (4.0, 2.0), start=10.0)  # starts at the price-3 slot
    shifted = train_growing(cfg, ARCH, growing_data(), volatility=later)
    assert cost_curve(shifted, later, cfg)[:2] == pytest.approx([30 / SECONDS_PER_HOUR] * 2)


@pytest.mark.slow
def test_the_run_and_its_cost_are_logged_to_a_real_mlflow_store(tmp_path: Path) -> None:
    from mopflow.base.tracking import MlflowTracker

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "growing", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("growing", {"stage": "growing"})
    cfg = volatile_growing_config()
    x, y = growing_data()
    result = train_growing(cfg, ARCH, (x, y), eval_data=(x, y), volatility=Volatility(TRACE, (4.0, 2.0)))
    log_growing_run(tracker, run_id, cfg, result)
    tracker.end_run(run_id)

    data = tracker.client.get_run(run_id).data
    assert data.params["growing_schedule_kind"] == "static"
    assert data.params["growing_scaling"] == "linear"
    assert data.params["spot_bids"] == "4,2"
    assert data.metrics["spot_idle_hours"] == pytest.approx(10.0 / SECONDS_PER_HOUR)
    assert data.metrics["spot_cost"] == pytest.approx(90.0 / SECONDS_PER_HOUR)
    assert data.metrics["growing_idle_slots"] == 1.0
    assert data.metrics["growing_worker_iterations"] == 7.0
    active = tracker.client.get_metric_history(run_id, "growing_active_workers")
    assert [(m.step, m.value) for m in sorted(active, key=lambda m: m.step)] == [
        (0, 2.0),
        (1, 1.0),
        (2, 0.0),
        (3, 2.0),
        (4, 2.0),
    ]
    losses = tracker.client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in losses) == [0, 1, 3, 4]  # none for the idle slot
