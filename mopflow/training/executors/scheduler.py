"""The Model Hopper Parallelism scheduler (Cerebro, VLDB 2020), as a pure, seeded state machine.

Per epoch every active model must visit every partition exactly once. A queue holds the
(model, partition) units still to run; whenever a worker is idle it is given one of the units
whose model is idle and whose partition it holds. Which one is the schedule's choice
(:data:`SCHEDULES`):

* ``fixed`` (the default): each epoch has a plan (:func:`fixed_plan`), a function of the seed and
  of which models and partitions there are, after Cerebro's randomized schedule: the models and
  the partitions are shuffled and model row ``i`` visits partition column ``(i + k) mod n`` at
  sub-epoch ``k``, ``n`` the number of partitions. A model visits the partitions in its row's
  order whatever the timings, so a sweep trains the same models the same way on every run; a
  worker that frees early takes the earliest planned unit that is ready on it (its model idle,
  and that partition its model's next), or waits. The shuffles do not change from one epoch to
  the next, so a model goes on round its cycle of partitions (with two, it alternates workers)
  until a model joins or leaves the sweep.
* ``greedy``: the queue is shuffled and, of the units the worker can take, the one whose model
  has the most units left in the epoch goes first (then the longest, by its measured seconds per
  unit; ties go to the first in the shuffled order). Starting the models with the most left first
  keeps the epoch's last units short and spread over the workers. The order follows which worker
  frees first, so two runs can train a model over its partitions in different orders.

Under both, a model never runs on two workers at once and a worker runs one unit at a time. A
worker may hold one more unit *ahead*, queued behind the one it runs (:meth:`MopScheduler.assign_ahead`):
it starts that unit as soon as the running one ends, without a round trip to the coordinator. A
unit ahead is chosen by the same rule and counts as its model's unit in flight. A
unit lost with its worker goes back to the queue (its partition moves to a surviving worker); one
that stopped mid-pass with a checkpoint (a spot notice) is its model's next unit, so the pass is
finished before the model moves on. A new (restarted) worker takes partitions from the busiest.
The plan names partitions, never workers: lost, restarted or added workers change where and when
a unit runs, not the order in which a model visits the partitions.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

MopScheduleName = Literal["fixed", "greedy"]


@dataclass(frozen=True, order=True)
class Unit:
    """One sub-epoch: ``model`` trains one pass over ``partition``, in the ``epoch``-th epoch of
    its round (a round may hold several epochs, :meth:`MopScheduler.start_epoch`)."""

    model: str
    partition: str
    epoch: int = 0


def fixed_plan(seed: int, models: Iterable[str], partitions: Iterable[str]) -> list[list[Unit]]:
    """One epoch's sub-epochs after Cerebro's randomized schedule, seeded by ``seed``.

    The models (rows, in an order drawn per model from the seed) and the partitions (columns) are
    shuffled; sub-epoch ``k`` of ``n`` (the number of partitions) trains row ``i`` on column
    ``(i + k) mod n``. Every (model, partition) comes once and no model twice in a sub-epoch. With
    fewer models than partitions some partitions rest each sub-epoch (a Latin square's rows); with
    more, the rows start on every column in turn, so each partition has ``models / n`` models,
    give or take one, waiting at every sub-epoch (a square of ``max(models, n)`` sub-epochs would
    start most models on one column). The result depends on its arguments alone, and not on the
    epoch: while the models stay, each starts an epoch on the column after the one it ended the
    last on. A plan drawn anew each epoch would start half the models (with two partitions) on the
    worker they just left, and bunch them: in a 2-worker sweep of 4 models, workers then waited
    for a model busy on the other one about a tenth of the time.
    """
    columns = sorted(set(partitions))
    random.Random(f"mop-plan:{seed}").shuffle(columns)  # a str seed is hashed the same in every process
    rows = sorted(set(models), key=lambda model: (_row_key(seed, model), model))
    n = len(columns)
    return [[Unit(model, columns[(i + k) % n]) for i, model in enumerate(rows)] for k in range(n)]


def _row_key(seed: int, model: str) -> str:
    """A model's place among the rows: drawn from the seed and its name alone, so a model keeps
    its place relative to the others as models join and leave."""
    return hashlib.sha256(f"mop-plan:{seed}:{model}".encode()).hexdigest()


class UnitChoice(Protocol):
    """A schedule: which unit an idle worker takes (None: it waits)."""

    def start_epoch(
        self, epoch: int, models: Sequence[str], partitions: Sequence[str], epochs: int = 1
    ) -> None:
        """A new round of ``epochs`` epochs (from ``epoch``) of these models over these partitions begins."""
        ...

    def pick(self, scheduler: MopScheduler, worker: str) -> Unit | None:
        """The unit for the idle ``worker``, among ``scheduler.runnable(worker, ...)``."""
        ...

    def openings(
        self, scheduler: MopScheduler, models: Sequence[str], next_round: Sequence[str] | None = None
    ) -> list[Unit]:
        """Where ``models`` would start their next epoch, in a next round of ``next_round``'s
        models (None: this round's): their candidate first units, those to prefer first."""
        ...

    def opens_with(self, scheduler: MopScheduler, unit: Unit) -> bool:
        """Whether the round just started lets ``unit`` be its model's first."""
        ...


class FixedPlan:
    """Each model visits the partitions in its row's order of the epoch's :func:`fixed_plan`; an
    idle worker takes the earliest planned unit that is ready on it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.position: dict[Unit, tuple[int, int]] = {}  # unit -> (sub-epoch, place in it)

    def start_epoch(
        self, epoch: int, models: Sequence[str], partitions: Sequence[str], epochs: int = 1
    ) -> None:
        plan = fixed_plan(self.seed, models, partitions)  # every epoch of the round alike
        self.position = {
            Unit(unit.model, unit.partition, e): (e * len(plan) + k, i)
            for e in range(epochs)
            for k, units in enumerate(plan)
            for i, unit in enumerate(units)
        }

    def pick(self, scheduler: MopScheduler, worker: str) -> Unit | None:
        following: dict[str, Unit] = {}  # model -> its next unit in the plan
        for unit in sorted(scheduler.open_units(), key=self._planned):
            following.setdefault(unit.model, unit)
        return min(scheduler.runnable(worker, following.values()), key=self._planned, default=None)

    def openings(
        self, scheduler: MopScheduler, models: Sequence[str], next_round: Sequence[str] | None = None
    ) -> list[Unit]:
        # a plan depends on its models and partitions alone, never on the epoch
        rows = {u.model for u in self.position} if next_round is None else next_round
        chosen = set(models)
        return [u for u in fixed_plan(self.seed, rows, sorted(scheduler.placement))[0] if u.model in chosen]

    def opens_with(self, scheduler: MopScheduler, unit: Unit) -> bool:
        return self.position.get(unit, (-1, 0))[0] == 0

    def _planned(self, unit: Unit) -> tuple[int, int, Unit]:
        """Where ``unit`` comes in the plan (a unit the plan does not name, after every planned one)."""
        k, i = self.position.get(unit, (len(self.position), 0))
        return k, i, unit


class GreedyQueue:
    """The shuffled queue: the unit whose model has the most work left this epoch goes first."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def start_epoch(
        self, epoch: int, models: Sequence[str], partitions: Sequence[str], epochs: int = 1
    ) -> None:
        return None

    def pick(self, scheduler: MopScheduler, worker: str) -> Unit | None:
        self._rng.shuffle(scheduler.queue)
        candidates = scheduler.runnable(worker, scheduler.open_units())
        if not candidates:
            return None
        return max(candidates, key=_work_left(scheduler))  # max keeps the first of equals

    def openings(
        self, scheduler: MopScheduler, models: Sequence[str], next_round: Sequence[str] | None = None
    ) -> list[Unit]:
        # no plan: a model may start an epoch on any partition, the longest models first
        cost = scheduler.cost
        order = sorted(models, key=lambda m: (-cost.get(m, 0.0), m))
        return [Unit(m, p) for m in order for p in sorted(scheduler.placement)]

    def opens_with(self, scheduler: MopScheduler, unit: Unit) -> bool:
        return True


def _work_left(scheduler: MopScheduler) -> Callable[[Unit], tuple[int, float]]:
    """The work each model still has this epoch: its units left (they run one after another),
    then its seconds per unit (longest first, so the epoch ends on short units)."""
    left = Counter(u.model for u in scheduler.queue)
    known = [c for c in scheduler.cost.values() if c > 0]
    default = sum(known) / len(known) if known else 1.0
    return lambda unit: (left[unit.model], scheduler.cost.get(unit.model, default))


# schedule name -> its choice of units, made from the seed
SCHEDULES: dict[str, Callable[[int], UnitChoice]] = {"fixed": FixedPlan, "greedy": GreedyQueue}
if set(SCHEDULES) != set(get_args(MopScheduleName)):
    raise ImportError("mopflow.training.executors.scheduler: SCHEDULES and MopScheduleName disagree")


@dataclass
class MopScheduler:
    """Assigns units to idle workers; every method is deterministic for a given seed."""

    placement: dict[str, str]  # partition -> worker holding it
    seed: int = 0
    schedule: str = "fixed"  # a name in SCHEDULES
    queue: list[Unit] = field(default_factory=list)
    running: dict[str, Unit] = field(default_factory=dict)  # worker -> unit
    ahead: dict[str, Unit] = field(default_factory=dict)  # worker -> unit queued behind its running one
    done: list[Unit] = field(default_factory=list)
    resume: dict[str, str] = field(default_factory=dict)  # model -> partition it stopped mid-pass on
    cost: dict[str, float] = field(default_factory=dict)  # model -> seconds per unit, as measured

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown MOP schedule {self.schedule!r}; expected one of {sorted(SCHEDULES)}")
        self.choice = SCHEDULES[self.schedule](self.seed)

    def start_epoch(self, models: Iterable[str], epoch: int = 0, epochs: int = 1) -> None:
        """Queue every (model, partition) unit of a new round of ``epochs`` epochs (``epoch``: the
        first, for the plan). A model's units of one epoch all come before its next epoch's: the
        epochs of a round follow each other per model, without waiting for the other models."""
        if self.queue or self.running or self.ahead:
            raise RuntimeError("the previous epoch has not finished")
        self.done = []
        names, partitions = sorted(models), sorted(self.placement)
        self.queue = [Unit(m, p, e) for e in range(epochs) for m in names for p in partitions]
        self.choice.start_epoch(epoch, names, partitions, epochs)

    @property
    def busy_models(self) -> set[str]:
        """Models with a unit on a worker (running or ahead)."""
        return {u.model for u in (*self.running.values(), *self.ahead.values())}

    def open_units(self) -> list[Unit]:
        """Queued units a model may run next: those of its current epoch, and a model that stopped
        mid-pass finishes that pass first."""
        current: dict[str, int] = {}
        for u in (*self.queue, *self.running.values(), *self.ahead.values()):
            current[u.model] = min(current.get(u.model, u.epoch), u.epoch)
        return [
            u
            for u in self.queue
            if u.epoch == current[u.model] and self.resume.get(u.model, u.partition) == u.partition
        ]

    def runnable(self, worker: str, units: Iterable[Unit]) -> list[Unit]:
        """Those of ``units`` that ``worker`` can run now: it holds the partition and the model is idle."""
        busy = self.busy_models
        return [u for u in units if u.model not in busy and self.placement.get(u.partition) == worker]

    def assign(self, idle_workers: Iterable[str]) -> list[tuple[str, Unit]]:
        """Units for the idle workers (at most one each), as the schedule chooses."""
        return self._give([w for w in sorted(idle_workers) if w not in self.running], self.running)

    def assign_ahead(self, busy_workers: Iterable[str]) -> list[tuple[str, Unit]]:
        """A unit to queue behind the running one of each of ``busy_workers`` that has none yet,
        as the schedule chooses: the worker starts it without waiting for the coordinator."""
        waiting = [w for w in sorted(busy_workers) if w in self.running and w not in self.ahead]
        return self._give(waiting, self.ahead)

    def _give(self, workers: list[str], slot: dict[str, Unit]) -> list[tuple[str, Unit]]:
        """Take the schedule's unit for each of ``workers`` (those it has one for) out of the
        queue into ``slot`` (running or ahead)."""
        assignments: list[tuple[str, Unit]] = []
        for worker in workers:
            unit = self.choice.pick(self, worker)
            if unit is None:
                continue
            self.queue.remove(unit)
            slot[worker] = unit
            assignments.append((worker, unit))
        return assignments

    def choice_openings(self, models: Sequence[str], next_round: Sequence[str] | None = None) -> list[Unit]:
        """Where ``models`` would start their next epoch, in a next round of ``next_round``'s models
        (None: this one's; ``UnitChoice.openings``): candidate units per model, preferred first."""
        return self.choice.openings(self, models, next_round)

    def adopt(self, worker: str, unit: Unit) -> bool:
        """Take ``unit``, queued in the round just started, as sent to ``worker`` already (it was
        started there ahead of the round): when ``worker`` holds its partition and has a free
        place, its model has no other unit out, and the schedule starts the model with it."""
        if (
            unit not in self.open_units()
            or self.placement.get(unit.partition) != worker
            or unit.model in self.busy_models
            or not self.choice.opens_with(self, unit)
        ):
            return False
        slot = (
            self.running if worker not in self.running else self.ahead if worker not in self.ahead else None
        )
        if slot is None:
            return False
        self.queue.remove(unit)
        slot[worker] = unit
        return True

    def units_on(self, worker: str) -> list[Unit]:
        """The units given to ``worker``: the running one, then the one ahead."""
        return [u for u in (self.running.get(worker), self.ahead.get(worker)) if u is not None]

    def record_cost(self, model: str, seconds: float) -> None:
        """A unit of ``model`` took ``seconds`` (kept as a running estimate of its unit time)."""
        if seconds <= 0:
            return
        previous = self.cost.get(model)
        self.cost[model] = seconds if previous is None else 0.5 * (previous + seconds)

    def complete(self, worker: str, unit: Unit | None = None) -> Unit:
        """``unit`` (default: the running one) on ``worker`` finished; the one ahead runs now."""
        unit = self._take(worker, unit)
        if unit is None:
            raise KeyError(f"no unit on worker {worker!r}")
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

    def requeue(self, worker: str, saved: bool = False, unit: Unit | None = None) -> Unit | None:
        """Put ``unit`` (default: every unit on ``worker``) back in the queue; ``saved``: the running
        one stopped mid-pass with a checkpoint and is its model's next. Returns the running unit."""
        if unit is not None:
            was_running = self.running.get(worker) == unit
            taken = self._take(worker, unit)
            if taken is not None:
                self._back(taken, saved and was_running)
            return taken
        running, ahead = self.running.pop(worker, None), self.ahead.pop(worker, None)
        if running is not None:
            self._back(running, saved)
        if ahead is not None:
            self._back(ahead, False)
        return running

    def _back(self, unit: Unit, saved: bool) -> None:
        self.queue.append(unit)
        if saved:
            self.resume[unit.model] = unit.partition

    def _take(self, worker: str, unit: Unit | None) -> Unit | None:
        """Remove ``unit`` (default: the running one) from ``worker``; the one ahead moves up."""
        if unit is not None and self.ahead.get(worker) == unit and self.running.get(worker) != unit:
            return self.ahead.pop(worker)
        if unit is not None and self.running.get(worker) != unit:
            return None
        taken = self.running.pop(worker, None)
        if worker in self.ahead:
            self.running[worker] = self.ahead.pop(worker)
        return taken

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
            running = {u.partition for u in (*self.running.values(), *self.ahead.values())}
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
        return not self.queue and not self.running and not self.ahead


def round_robin(partitions: Iterable[str], workers: Iterable[str]) -> dict[str, str]:
    """Place partitions on workers in turn (the data is partitioned once, never replicated)."""
    ws = sorted(workers)
    if not ws:
        raise ValueError("no workers to place partitions on")
    return {p: ws[i % len(ws)] for i, p in enumerate(sorted(partitions))}
