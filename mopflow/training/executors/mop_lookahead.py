"""MOP's lookahead over a round's end: a model's next epoch starts before the round's decisions.

Why: a round ends where the controller may stop models (a pruner's report, ASHA's rung). Its
last units leave workers with nothing of the round to run, since a model's units run one after
another; then the coordinator's main thread hears every model's epoch, tells Optuna and asks for
new trials while every worker waits. In the small-units benchmark (passes of about 15 ms, two
workers) the gaps between two rounds were 11.8 ms per worker and round, 19% of the workers'
time, against 4% for every gap within the rounds.

How: a worker that has no unit of the round left to take, and a free place (nothing running, or
nothing queued behind its running unit), starts the first unit of a model's next epoch: a model
whose epoch in this round is done, on the partition the round's plan would start it on. The
unit is *speculative* until the next round starts. It is adopted as that round's unit when its
model is still active, with the same state, and the new round's plan starts the model there. It
is then the very unit the model would have trained anyway, so a sweep trains its models the same
way whatever the timings. Otherwise (the model was stopped, or a model joined or left and the plan
moved it) it is dropped: its worker ends it at its next batch, or before it starts
(``mop_service.drop_units``), so the round's units wait at most a batch behind it. A round's own
unit never waits behind a speculative one otherwise, except where a fault moves partitions.

At a cohort's end (every model in its last epoch) no model has a next epoch: the trials that take
their slots are asked during that round, between its units (``MopModels.ask_ahead``, the search
key ``mop_ask_ahead``), and their first units are offered like the others, from no state (the
worker builds the model's seeded first one), where the next round's plan starts them. The
finished models' trials are told while the next round runs (``MopModels.tell_done``).

A speculative unit's faults are its adopted unit's: the driver collects it like any other (a
spot notice's state, a killed worker's closed connection). A dropped unit's outcome is ignored.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mopflow.training.executors.scheduler import MopScheduler, Unit

log = logging.getLogger(__name__)

PLACES_PER_WORKER = 2  # the running unit and the one queued behind it (MopScheduler.assign_ahead)


class RoundModels(Protocol):
    """What the lookahead reads of a run's models (``mop_models.MopModels``)."""

    epochs: int
    active: dict
    joining: dict
    states: dict[str, bytes]
    visited: dict[str, list[str]]
    next_epoch: dict[str, int]

    def epoch_complete(self, model_id: str) -> bool: ...

    def next_round(self) -> list[str]: ...


@dataclass(frozen=True)
class Speculative:
    """A unit of a model's next epoch, sent before the round that holds it started."""

    worker: str
    unit: Unit  # the next round's unit (its first epoch: ``unit.epoch == 0``)
    epoch: int  # the model's epoch it trains
    state: bytes | None  # the model's state it started from (None: a joining model's first)
    token: str = ""  # what its worker knows it by, to drop it
    sent: float = field(default_factory=time.time)  # wall clock, as the driver's ``submitted``


@dataclass
class Lookahead:
    """The speculative units in flight (in the order they were sent) and what became of them."""

    sent: dict[concurrent.futures.Future, Speculative] = field(default_factory=dict)
    adopted: int = 0
    dropped: int = 0

    def running(self) -> list[concurrent.futures.Future]:
        """The speculative units not yet answered (the driver wakes when one is)."""
        return [future for future in self.sent if not future.done()]

    def _places_taken(self, worker: str) -> int:
        return sum(1 for future in self.running() if self.sent[future].worker == worker)

    def driver_may_pause(self, scheduler: MopScheduler, workers: Sequence[str]) -> bool:
        """Whether the driver may spend a few milliseconds (a trial told, 5-15 ms on a busy
        machine) without a worker running out of units: each of ``workers`` has a unit queued
        behind the one it runs (the round's, or one started ahead), or the round has none left
        to queue (where workers outnumber models no unit waits, and the told wait no longer)."""
        places = {w: len(scheduler.units_on(w)) + self._places_taken(w) for w in workers}
        return not scheduler.queue or all(n >= PLACES_PER_WORKER for n in places.values())

    def offers(
        self, run: RoundModels, scheduler: MopScheduler, workers: Sequence[str]
    ) -> list[tuple[str, Unit, int]]:
        """(worker, unit, epoch) to send now: for each of ``workers`` with a free place and no
        unit of the round left to take, the next epoch's first unit of a model whose epoch is done,
        or a joining model's first, where the next round's plan would start it (as far as its
        models are known), earliest in the plan first."""
        queued_on = {scheduler.placement.get(u.partition) for u in scheduler.queue}  # the round's
        places = {  # the workers the round has no unit left for, and their free places
            w: PLACES_PER_WORKER - len(scheduler.units_on(w)) - self._places_taken(w)
            for w in workers
            if w not in queued_on
        }
        if not any(free > 0 for free in places.values()):
            return []  # mid-round, the usual case: no plan to compute
        waiting = {u.model for u in scheduler.queue} | scheduler.busy_models
        speculated = {s.unit.model for s in self.sent.values()}
        ready = [
            mid
            for mid in sorted(run.active)
            if mid not in waiting
            and mid not in speculated
            and mid in run.states
            and run.epoch_complete(mid)
            and run.next_epoch.get(mid, 0) + 1 < run.epochs
        ]
        epoch = {mid: run.next_epoch.get(mid, 0) + 1 for mid in ready}
        epoch |= {mid: 0 for mid in sorted(run.joining) if mid not in speculated}
        openings = scheduler.choice_openings(list(epoch), run.next_round()) if epoch else []
        given: list[tuple[str, Unit, int]] = []
        for worker, free in places.items():
            while free > 0:
                unit = next((u for u in openings if scheduler.placement.get(u.partition) == worker), None)
                if unit is None:
                    break
                openings = [u for u in openings if u.model != unit.model]  # one unit a model
                given.append((worker, unit, epoch[unit.model]))
                free -= 1
        return given

    def note_sent(self, future: concurrent.futures.Future, spec: Speculative) -> None:
        """``spec`` was sent; ``future`` is its call."""
        self.sent[future] = spec

    def take(
        self, run: RoundModels, scheduler: MopScheduler, alive: Iterable[str]
    ) -> tuple[list[tuple[concurrent.futures.Future, Speculative]], dict[str, list[str]]]:
        """At a new round's start (its units queued): the speculative units it adopts, in the
        order they were sent, each placed on its worker (running, or queued behind); and the
        tokens of those dropped that have not answered yet, per worker (to be told)."""
        alive = set(alive)
        adopted: list[tuple[concurrent.futures.Future, Speculative]] = []
        for future, spec in self.sent.items():
            mid = spec.unit.model
            if (
                mid in run.active
                and run.states.get(mid) is spec.state
                and run.next_epoch.get(mid, 0) == spec.epoch
                and not run.visited.get(mid)
                and spec.worker in alive
                and scheduler.adopt(spec.worker, spec.unit)
            ):
                adopted.append((future, spec))
            else:
                log.info("mop: %s's unit on %s started ahead is dropped", mid, spec.unit.partition)
        for future, _ in adopted:
            del self.sent[future]
        self.adopted += len(adopted)
        return adopted, self.drop_all()

    def drop_all(self) -> dict[str, list[str]]:
        """Drop every unit still held (the run ends, or no round took it): the tokens of those
        not answered yet, per worker (to be told)."""
        dropped: dict[str, list[str]] = {}
        for future in self.running():
            spec = self.sent[future]
            dropped.setdefault(spec.worker, []).append(spec.token)
        self.dropped += len(self.sent)
        self.sent.clear()
        return dropped
