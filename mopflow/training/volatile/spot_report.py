"""What a spot price replay recorded: the workers' events, the run's account, and its tracking.

:class:`~mopflow.training.volatile.spot_replay.SpotReplay` produces a :class:`SpotReport`; :func:`log_replay`
writes it to MLflow through the :class:`~mopflow.base.tracking.Tracker` protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mopflow.base.tracking import Tracker
from mopflow.training.volatile.run_account import RunAccount, log_run_account

EventKind = Literal["notice", "exit", "killed", "start", "joined"]


@dataclass(frozen=True)
class SpotEvent:
    """Something that happened to a worker during the replay."""

    worker: str
    kind: EventKind
    wall: float  # time.time()
    trace_t: float  # trace seconds (unwrapped: keeps growing when the trace repeats)
    price: float
    address: str = ""
    pid: int | None = None
    busy: bool = False  # notice: the worker was running a task


@dataclass(frozen=True)
class SpotReport:
    """A replay's record and account."""

    workers: tuple[str, ...]
    bids: tuple[float, ...]
    speed: float
    trace_start: float
    wall_start: float
    wall_stop: float
    intervals: dict[str, tuple[tuple[float, float], ...]]  # billed, trace seconds, per worker
    events: tuple[SpotEvent, ...]
    account: RunAccount
    ideal_cost: float  # the bids' bill over the same span, switching exactly at price changes
    source: str = ""
    error: str = ""  # why the replay thread stopped early, if it did

    def pids(self, worker: str) -> list[int]:
        """Process ids the worker had, in order (one per start)."""
        return [e.pid for e in self.events if e.worker == worker and e.kind == "joined" and e.pid is not None]

    def addresses(self, worker: str) -> list[str]:
        """Addresses the worker had, in order."""
        return [e.address for e in self.events if e.worker == worker and e.kind == "joined"]

    def count(self, kind: EventKind) -> int:
        """How many events of this kind the replay recorded."""
        return sum(1 for e in self.events if e.kind == kind)

    def billed_workers_history(self) -> list[tuple[int, float]]:
        """(trace seconds from the start, workers billed) after each exit and start during the run."""
        running, history = len(self.workers), []
        for e in self.events:
            if e.kind in ("exit", "start") and e.wall <= self.wall_stop:
                running += -1 if e.kind == "exit" else 1
                history.append((int(round(e.trace_t - self.trace_start)), float(running)))
        return history


def notice_to_exit_seconds(events: Sequence[SpotEvent], stop: float) -> float:
    """Wall seconds workers spent between a spot notice and their exit: checkpointing and leaving,
    work lost to preemption. A worker still leaving at ``stop`` counts until then."""
    wasted = 0.0
    last_notice: dict[str, float] = {}
    for e in events:
        if e.kind == "notice":
            last_notice[e.worker] = e.wall
        elif e.kind == "exit" and e.worker in last_notice:
            wasted += e.wall - last_notice.pop(e.worker)
    for at in last_notice.values():  # still leaving when the run ended
        wasted += stop - at
    return wasted


def log_replay(tracker: Tracker, run_id: str, report: SpotReport) -> dict[str, float]:
    """Log a replay to MLflow: the ``spot_*`` account (:func:`log_run_account`), the ideal cost, the
    notices and restarts, the billed workers over trace time, and the events as ``spot/replay.json``."""
    metrics = log_run_account(
        tracker,
        run_id,
        report.account,
        bids=report.bids,
        extra_params={"spot_speed": report.speed, "spot_trace": report.source or "(in memory)"},
    )
    extra = {
        "spot_ideal_cost": report.ideal_cost,
        "spot_notices": float(report.count("notice")),
        "spot_restarts": float(report.count("start")),
        "spot_kills": float(report.count("killed")),
    }
    tracker.log_metrics(run_id, extra)
    if report.error:
        tracker.set_tags(run_id, {"mopflow.spot_replay_error": report.error[:4000]})
    history = report.billed_workers_history()
    if history:
        tracker.log_metric_history(run_id, "spot_billed_workers", history)
    tracker.log_dict(
        run_id,
        {
            "workers": list(report.workers),
            "bids": list(report.bids),
            "speed": report.speed,
            "intervals": {k: [list(iv) for iv in v] for k, v in report.intervals.items()},
            "events": [e.__dict__ for e in report.events],
            "ideal_cost": report.ideal_cost,
        },
        "spot/replay.json",
    )
    return metrics | extra
