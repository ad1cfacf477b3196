"""The Model Hopper Parallelism scheduler (Cerebro, VLDB 2020), as a pure, seeded state machine.

Per epoch every active model must visit every partition exactly once. A queue holds the
(model, partition) units still to run; whenever a worker is idle the queue is shuffled and,
of the units whose model is idle and whose partition that worker holds, the one whose model
has the most units left in the epoch is given to it (then the longest, by its measured
seconds per unit); ties go to the first in the shuffled order. A model's units run one after another, so
starting the models with the most left first keeps the epoch's last units short and spread
over the workers (the pure "first in the shuffled queue" rule leaves a worker idle at the end
of an epoch whenever all its remaining units belong to models running elsewhere). A
model never runs on two workers at once and a worker runs one unit at a time. A unit lost
with its worker goes back to the queue (its partition moves to a surviving worker); one that
stopped mid-pass with a checkpoint (a spot notice) is its model's next unit, so the pass is
finished before the model moves on. A new (restarted) worker takes partitions from the busiest.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Unit:
    """One sub-epoch: ``model`` trains one pass over ``partition``."""

    model: str
    partition: str


@dataclass
class MopScheduler:
    """Assigns units to idle workers; every method is deterministic for a given seed."""

    placement: dict[str, str]  # partition -> worker holding it
    seed: int = 0
    queue: list[Unit] = field(default_factory=list)
    running: dict[str, Unit] = field(default_factory=dict)  # worker -> unit
    done: list[Unit] = field(default_factory=list)
    resume: dict[str, str] = field(default_factory=dict)  # model -> partition it stopped mid-pass on
    cost: dict[str, float] = field(default_factory=dict)  # model -> seconds per unit, as measured

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def start_epoch(self, models: Iterable[str]) -> None:
        """Queue every (model, partition) unit of a new epoch."""
        if self.queue or self.running:
            raise RuntimeError("the previous epoch has not finished")
        self.done = []
        self.queue = [Unit(m, p) for m in sorted(models) for p in sorted(self.placement)]

    @property
    def busy_models(self) -> set[str]:
        return {u.model for u in self.running.values()}

    def assign(self, idle_workers: Iterable[str]) -> list[tuple[str, Unit]]:
        """Units for the idle workers (at most one each), following the randomized rule."""
        assignments: list[tuple[str, Unit]] = []
        for worker in sorted(idle_workers):
            if worker in self.running:
                continue
            self._rng.shuffle(self.queue)
            busy = self.busy_models
            candidates = [
                unit
                for unit in self.queue
                if unit.model not in busy
                and self.placement[unit.partition] == worker
                and self.resume.get(unit.model, unit.partition) == unit.partition
            ]
            if not candidates:
                continue
            unit = max(candidates, key=self._work_left())  # max keeps the first of equals
            self.queue.remove(unit)
            self.running[worker] = unit
            assignments.append((worker, unit))
        return assignments

    def _work_left(self) -> Callable[[Unit], tuple[int, float]]:
        """The work each model still has this epoch: its units left (they run one after
        another), then its seconds per unit (longest first, so the epoch ends on short units)."""
        left = Counter(u.model for u in self.queue)
        known = [c for c in self.cost.values() if c > 0]
        default = sum(known) / len(known) if known else 1.0
        return lambda unit: (left[unit.model], self.cost.get(unit.model, default))

    def record_cost(self, model: str, seconds: float) -> None:
        """A unit of ``model`` took ``seconds`` (kept as a running estimate of its unit time)."""
        if seconds <= 0:
            return
        previous = self.cost.get(model)
        self.cost[model] = seconds if previous is None else 0.5 * (previous + seconds)

    def complete(self, worker: str) -> Unit:
        """The unit on ``worker`` finished."""
        unit = self.running.pop(worker)
        self.done.append(unit)
        if self.resume.get(unit.model) == unit.partition:
            del self.resume[unit.model]
        return unit

    def lose_worker(self, worker: str, survivors: Iterable[str], saved: bool = False) -> Unit | None:
        """``worker`` is gone: requeue its unit and move its partitions to the least-loaded survivors.

        ``saved``: the unit checkpointed mid-pass before it left; it is its model's next unit.
        """
        alive = sorted(set(survivors) - {worker})
        if not alive:
            raise RuntimeError("no worker is left to take over the lost worker's partitions")
        unit = self.requeue(worker, saved)
        for partition, holder in sorted(self.placement.items()):
            if holder == worker:
                load = {w: sum(1 for h in self.placement.values() if h == w) for w in alive}
                self.placement[partition] = min(alive, key=lambda w: (load[w], w))
        return unit

    def requeue(self, worker: str, saved: bool = False) -> Unit | None:
        """Put the unit running on ``worker`` back in the queue (``saved``: it is its model's next)."""
        unit = self.running.pop(worker, None)
        if unit is not None:
            self.queue.append(unit)
            if saved:
                self.resume[unit.model] = unit.partition
        return unit

    def add_worker(self, worker: str) -> list[str]:
        """A worker that holds no partition (a restarted one) takes partitions from the busiest
        holders, those not running a unit first, until it is no less loaded than they; returns them."""
        moved: list[str] = []
        if worker in self.placement.values():
            return moved
        while True:
            load: dict[str, int] = {}
            for holder in self.placement.values():
                load[holder] = load.get(holder, 0) + 1
            busiest = max(sorted(load), key=lambda w: load[w])
            if load[busiest] - 1 < len(moved) + 1:
                return moved
            running = {u.partition for u in self.running.values()}
            mine = sorted(p for p, h in self.placement.items() if h == busiest)
            partition = min(mine, key=lambda p: (p in running, p))
            self.placement[partition] = worker
            moved.append(partition)

    def drop_model(self, model: str) -> None:
        """Stop a model between units: its remaining units of this epoch are dropped."""
        self.queue = [u for u in self.queue if u.model != model]
        self.resume.pop(model, None)

    @property
    def epoch_finished(self) -> bool:
        return not self.queue and not self.running


def round_robin(partitions: Iterable[str], workers: Iterable[str]) -> dict[str, str]:
    """Place partitions on workers in turn (the data is partitioned once, never replicated)."""
    ws = sorted(workers)
    if not ws:
        raise ValueError("no workers to place partitions on")
    return {p: ws[i % len(ws)] for i, p in enumerate(sorted(partitions))}


def check_invariants(
    records: Iterable[Mapping[str, object]], models: Iterable[str], partitions: Iterable[str]
) -> None:
    """Raise AssertionError unless an epoch's unit records (model, partition, worker, start, end)
    visit each (model, partition) exactly once, never overlap for one model, never overlap on one worker."""
    recs = list(records)
    seen = sorted((str(r["model"]), str(r["partition"])) for r in recs)
    expected = sorted((m, p) for m in models for p in partitions)
    assert seen == expected, f"units run {seen} differ from every (model, partition) once {expected}"
    for key in ("model", "worker"):
        groups: dict[str, list[tuple[float, float]]] = {}
        for r in recs:
            groups.setdefault(str(r[key]), []).append((float(r["start"]), float(r["end"])))  # type: ignore[arg-type]
        for name, spans in groups.items():
            spans.sort()
            for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
                assert start >= end, f"{key} {name} ran two units at once"
