"""The MOP driver's view of its workers: how often it asks the scheduler who is there."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mopflow.training.executors import mop_workers
from mopflow.training.executors.mop_workers import WorkerWatch
from mopflow.training.executors.scheduler import MopScheduler


class _Scheduler:
    """A client whose scheduler's identity lists a set of workers the test changes, counting the
    reads."""

    def __init__(self, workers: set[str]) -> None:
        self.workers, self.reads = workers, 0
        self.scheduler = self

    def sync(self, call: Any, **kwargs: Any) -> Any:
        return call(**kwargs)

    def identity(self, n_workers: int = 0) -> dict[str, Any]:
        self.reads += 1
        return {"workers": {w: {} for w in self.workers}}


def test_the_loop_reuses_a_fresh_membership_and_a_direct_ask_reads_it_again() -> None:
    """Expected: within ``max_age_s`` the membership read last is reused (one round trip for
    many turns of the driver's loop); a worker lost is seen once the window has passed, and at
    once by an ask without ``max_age_s`` (what handling a lost unit does)."""
    client = _Scheduler({"w1", "w2"})
    watch = WorkerWatch(client, MopScheduler({"p0": "w1", "p1": "w2"}), lambda *a: None)

    assert [watch.connected(max_age_s=5.0) for _ in range(10)] == [{"w1", "w2"}] * 10
    assert client.reads == 1
    client.workers.discard("w2")
    assert watch.connected(max_age_s=5.0) == {"w1", "w2"}  # still the read of a moment ago
    assert watch.alive() == ["w1"] and client.reads == 2  # asked now: w2 is gone
    assert watch.connected(max_age_s=5.0) == {"w1"}  # and the loop goes on from that read

    client.workers.add("w3")
    time.sleep(0.06)
    assert watch.connected(max_age_s=0.05) == {"w1", "w3"} and client.reads == 3


def test_a_worker_a_call_could_not_reach_takes_no_unit_for_the_grace_then_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expected: a worker whose connection failed (killed, not yet seen gone by the scheduler) is
    left out of the workers that take units, its partitions move to the others; still there once
    ``REAP_GRACE_S`` has passed, it takes units and partitions again."""
    monkeypatch.setattr(mop_workers, "REAP_GRACE_S", 0.2)
    client = _Scheduler({"w1", "w2"})
    scheduler = MopScheduler({"p0": "w1", "p1": "w2"})
    watch = WorkerWatch(client, scheduler, lambda *a: None)
    watch.unreachable("w2")
    assert watch.alive() == ["w1"]
    assert watch.reconcile(watch.connected()) == ["w1"]
    assert set(scheduler.placement.values()) == {"w1"}  # p1 moved to w1
    time.sleep(0.25)
    assert watch.reconcile(watch.connected()) == ["w1", "w2"]
    assert sorted(scheduler.placement.values()) == ["w1", "w2"]  # w2 holds a partition again
