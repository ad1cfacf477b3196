"""A replay's report: the time from notice to exit, the billed workers over time, and its tracking."""

from __future__ import annotations

import pytest

from mopflow.training.volatile.run_account import RunAccount
from mopflow.training.volatile.spot_report import (
    EventKind,
    SpotEvent,
    SpotReport,
    log_replay,
    notice_to_exit_seconds,
)
from tests.training.volatile.helpers import RecordingTracker


def event(worker: str, kind: EventKind, wall: float, busy: bool = False) -> SpotEvent:
    # trace time runs at 60x from wall 100 (trace 0)
    return SpotEvent(worker, kind, wall, (wall - 100.0) * 60.0, 0.5, busy=busy)


EVENTS = (
    event("0", "joined", 100.0),
    event("1", "joined", 100.0),
    event("1", "notice", 101.0, busy=True),
    event("1", "exit", 104.0),
    event("1", "start", 110.0),
    event("1", "joined", 112.0),
    event("0", "notice", 118.0),
)


def report() -> SpotReport:
    account = RunAccount.from_totals(
        worker_costs=[0.2, 0.1],
        wall_seconds=1200.0,
        idle_seconds=0.0,
        billed_worker_seconds=2000.0,
        useful_worker_seconds=1500.0,
        wasted_worker_seconds=300.0,
        units=4,
        failed_attempts=1,
    )
    return SpotReport(
        workers=("0", "1"),
        bids=(1.0, 0.5),
        speed=60.0,
        trace_start=0.0,
        wall_start=100.0,
        wall_stop=120.0,
        intervals={"0": ((0.0, 1200.0),), "1": ((0.0, 240.0), (600.0, 1200.0))},
        events=EVENTS + (event("0", "exit", 121.0), event("0", "start", 122.0)),  # after the run
        account=account,
        ideal_cost=0.25,
        source="prices.csv",
    )


def test_notice_to_exit_time_counts_workers_still_leaving_until_the_stop() -> None:
    assert notice_to_exit_seconds(EVENTS, 120.0) == pytest.approx(3.0 + 2.0)
    assert notice_to_exit_seconds(EVENTS[:3], 102.5) == pytest.approx(1.5)
    assert notice_to_exit_seconds((), 120.0) == 0.0


def test_the_report_counts_events_and_the_billed_workers_during_the_run() -> None:
    r = report()
    assert r.count("notice") == 2 and r.count("exit") == 2
    assert r.pids("1") == [] and r.addresses("1") == ["", ""]
    assert r.billed_workers_history() == [(240, 1.0), (600, 2.0)]  # events after wall_stop left out


def test_log_replay_logs_the_account_the_events_and_the_billed_workers() -> None:
    tracker = RecordingTracker()
    metrics = log_replay(tracker, "run", report())
    assert metrics["spot_cost"] == pytest.approx(0.3) and metrics["spot_ideal_cost"] == 0.25
    assert metrics["spot_notices"] == 2.0 and metrics["spot_restarts"] == 2.0 and metrics["spot_kills"] == 0.0
    assert tracker.params["spot_trace"] == "prices.csv" and tracker.params["spot_speed"] == 60.0
    assert tracker.history["spot_billed_workers"] == [(240, 1.0), (600, 2.0)]
