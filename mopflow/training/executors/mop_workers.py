"""The MOP coordinator's view of its Dask workers on a volatile cluster.

Partitions live on workers, so every worker that leaves or joins moves them: a worker gone
while idle hands its partitions to the survivors, a new (restarted) one takes some from the
busiest (``training/executors/scheduler.py``). A worker that got a spot notice is ``leaving``
and takes no more units; one that died without notice (SIGKILL) is seen missing within the
driver's poll (+ ``REAP_GRACE_S``) and its unit is redone from the model's last finished unit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from mopflow.training.compute.workers import cluster_workers, declares
from mopflow.training.executors.scheduler import MopScheduler, Unit

log = logging.getLogger(__name__)

REAP_GRACE_S = 2.0  # a worker missing this long with its unit unanswered died without notice
WORKER_WAIT_S = 120.0  # how long to wait for a replacement when no worker is left
FETCH_POLL_S = 5.0  # how often a unit's result being fetched checks that its worker is still there
# How long the driver's loop goes on the membership it last read: each read is a round trip to
# the scheduler (about a millisecond of the coordinator's CPU, taken from the workers on a small
# machine), and the loop turns once or twice per unit; a worker lost or joined is seen at most
# this much later, well inside REAP_GRACE_S.
MEMBERSHIP_S = 0.25

# Records a unit's lost work: (unit, worker, kind, seconds to redo).
Account = Callable[[Unit, str, str, float], None]


class UnitResultLost(RuntimeError):
    """A unit finished on a worker that died before its result was fetched (the result died with it)."""


def fetch_unit_result(client: Any, future: Any, worker: str, poll_s: float = FETCH_POLL_S) -> Any:
    """The result of a unit sent to ``worker``.

    A worker that stops answering without closing its connection (cut off) would leave the call
    waiting for ever: raises ``UnitResultLost`` once ``worker`` has left the cluster.
    """
    while True:
        try:
            return future.result(timeout=poll_s)
        except TimeoutError:
            if worker not in cluster_workers(client):
                raise UnitResultLost(f"worker {worker} left before its unit's result was fetched") from None


class WorkerWatch:
    """Which workers take units, and what happens to the units and partitions of those that go."""

    def __init__(
        self,
        client: Any,
        scheduler: MopScheduler,
        account: Account,
        resources: Mapping[str, float] | None = None,
    ) -> None:
        self.client, self.scheduler, self.account = client, scheduler, account
        self.resources = dict(resources or {})  # what a worker declares to take units (a GPU)
        self.leaving: set[str] = set()  # workers that said they are being preempted
        self._missing_since: dict[str, float] = {}
        self._no_worker_since: float | None = None
        self._members: tuple[float, frozenset[str]] | None = None  # (when read, workers)
        self._unreachable: dict[str, float] = {}  # worker -> when a call to it failed to connect

    def connected(self, max_age_s: float = 0.0) -> set[str]:
        """The workers in the cluster that may take units (those declaring the units' resources):
        asked of the scheduler now, or, with ``max_age_s``, as read at most that many seconds ago."""
        now = time.monotonic()
        if self._members is None or now - self._members[0] >= max_age_s:
            members = cluster_workers(self.client)
            held = {a for a, w in members.items() if declares(w, self.resources)}
            self._members = (now, frozenset(held))
        return set(self._members[1])

    def alive(self, connected: set[str] | None = None) -> list[str]:
        """Workers that can take units: ``connected`` (default: asked of the scheduler now), less
        those leaving on a notice and those a call failed to reach within ``REAP_GRACE_S``."""
        return sorted((self.connected() if connected is None else connected) - self.leaving - self._shunned())

    def unreachable(self, worker: str) -> None:
        """A call to ``worker`` could not reach it (a killed worker's connection is closed at once,
        before the scheduler has seen it go): it takes no unit for ``REAP_GRACE_S``, and its
        partitions move; if it is still there then, it takes partitions again as a new worker."""
        self._unreachable[worker] = time.monotonic()

    def _shunned(self) -> set[str]:
        now = time.monotonic()
        self._unreachable = {w: t for w, t in self._unreachable.items() if now - t < REAP_GRACE_S}
        return set(self._unreachable)

    def reconcile(self, connected: set[str]) -> list[str]:
        """Follow the cluster: partitions of workers gone while idle move to survivors; a new
        (restarted) worker takes partitions from the busiest. Returns the workers that take units."""
        alive = self.alive(connected)
        for holder in sorted(set(self.scheduler.placement.values()) - set(alive)):
            if holder not in self.scheduler.running and alive:
                self.scheduler.lose_worker(holder, alive)
        for worker in alive:
            moved = self.scheduler.add_worker(worker)
            if moved:
                log.info("mop: worker %s joined; it takes partition(s) %s", worker, ", ".join(moved))
        self.leaving &= connected  # a worker that has left is forgotten
        return alive

    def reap_dead(
        self, in_flight: dict[Any, tuple[str, Unit]], submitted: dict[Any, float], connected: set[str]
    ) -> None:
        """Units whose worker vanished without answering (SIGKILL: no notice): cancel and requeue
        them; the model goes on from its last finished unit."""
        now = time.monotonic()
        for worker in {w for w, _ in in_flight.values()} - connected:
            self._missing_since.setdefault(worker, now)
        for future, (worker, unit) in list(in_flight.items()):
            if future not in in_flight:  # the unit ahead of a worker lost just now: requeued with it
                continue
            missing = self._missing_since.get(worker)
            if worker in connected or missing is None or now - missing < REAP_GRACE_S:
                continue
            if future.done():  # its answer arrived after all: handled with the done futures
                continue
            lost = self.lost_seconds(submitted.pop(future, time.time()))
            future.cancel()
            del in_flight[future]
            log.warning("mop: worker %s died running %s (no notice); the unit is redone", worker, unit)
            self.account(unit, worker, "killed", lost)
            self.lose(worker, in_flight)
        self._missing_since = {w: t for w, t in self._missing_since.items() if w not in connected}

    @staticmethod
    def lost_seconds(started_at: float) -> float:
        """Seconds a unit ran on a worker that never finished it: from when it started (sent, or,
        queued behind another, when that one finished) until now."""
        return max(0.0, time.time() - started_at)

    def wait_for_a_worker(self, alive: list[str]) -> None:
        """Nothing runs: fail when no worker has been there for ``WORKER_WAIT_S``."""
        if alive:
            self._no_worker_since = None
            return
        now = time.monotonic()
        self._no_worker_since = self._no_worker_since or now
        if now - self._no_worker_since > WORKER_WAIT_S:
            raise RuntimeError(f"no Dask worker left to run MOP units (waited {WORKER_WAIT_S:.0f}s)")

    def lose(
        self,
        worker: str,
        in_flight: dict[Any, tuple[str, Unit]],
        saved: bool = False,
        unit: Unit | None = None,
    ) -> None:
        """Requeue ``worker``'s units and move its partitions, waiting for a replacement if none is
        left; its units still in ``in_flight`` (one queued ahead) are cancelled. A ``unit`` that
        failed on a worker still there is requeued alone."""
        if worker in self.alive():  # the unit failed but its worker is fine: requeue it in place
            self.scheduler.requeue(worker, saved, unit)
            return
        deadline = time.monotonic() + WORKER_WAIT_S
        survivors = [w for w in self.alive() if w != worker]
        while not survivors:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Dask worker left to run MOP units (waited {WORKER_WAIT_S:.0f}s)")
            time.sleep(0.2)
            survivors = [w for w in self.alive() if w != worker]
        self.scheduler.lose_worker(worker, survivors, saved=saved)
        for future, (holder, _) in list(in_flight.items()):
            if holder == worker:
                future.cancel()
                del in_flight[future]
