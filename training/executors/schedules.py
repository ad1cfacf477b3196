"""The MOP schedules: which unit an idle worker takes (:data:`SCHEDULES`), and whether the models
train in rounds. ``training/executors/scheduler.py`` is the state machine that asks them.

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
* ``rolling``: no rounds. A model trains its epochs up to the controller's next possible decision
  on it, each reported as soon as it ends (in the order the epochs end), goes on at once when the
  controller keeps it, and a freed slot takes the controller's next model at once; within an epoch a model may visit its partitions in any order,
  and an idle worker takes the unit of the model that has waited longest. No worker waits for a
  slow model to end a round, but the sampler and the pruner hear the reports in the order the
  timings give, so two runs with one seed can differ (as ``task`` without ``trial_batches``).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, get_args

if TYPE_CHECKING:
    from mopflow.training.executors.scheduler import MopScheduler

MopScheduleName = Literal["fixed", "greedy", "rolling"]


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
    """A schedule: which unit an idle worker takes (None: it waits), and whether the models train
    in rounds (``rounds``: every model waits for the round's end, where the controller hears the
    reports in model order) or each goes on alone."""

    rounds: bool

    def start_epoch(
        self, epoch: int, models: Sequence[str], partitions: Sequence[str], epochs: int = 1
    ) -> None:
        """A new round of ``epochs`` epochs (from ``epoch``) of these models over these partitions begins."""
        ...

    def pick(self, scheduler: MopScheduler, worker: str) -> Unit | None:
        """The unit for the idle ``worker``, among ``scheduler.runnable(worker, ...)``."""
        ...


class FixedPlan:
    """Each model visits the partitions in its row's order of the epoch's :func:`fixed_plan`; an
    idle worker takes the earliest planned unit that is ready on it."""

    rounds = True

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

    def _planned(self, unit: Unit) -> tuple[int, int, Unit]:
        """Where ``unit`` comes in the plan (a unit the plan does not name, after every planned one)."""
        k, i = self.position.get(unit, (len(self.position), 0))
        return k, i, unit


class GreedyQueue:
    """The shuffled queue: the unit whose model has the most work left this epoch goes first."""

    rounds = True

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


def _work_left(scheduler: MopScheduler) -> Callable[[Unit], tuple[int, float]]:
    """The work each model still has this epoch: its units left (they run one after another),
    then its seconds per unit (longest first, so the epoch ends on short units)."""
    left = Counter(u.model for u in scheduler.queue)
    known = [c for c in scheduler.cost.values() if c > 0]
    default = sum(known) / len(known) if known else 1.0
    return lambda unit: (left[unit.model], scheduler.cost.get(unit.model, default))


class Rolling:
    """No rounds: an idle worker takes, of the units it can run, that of the model that has waited
    longest (since its last unit ended, or since it joined), in any order of its partitions."""

    rounds = False

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def start_epoch(
        self, epoch: int, models: Sequence[str], partitions: Sequence[str], epochs: int = 1
    ) -> None:
        return None

    def pick(self, scheduler: MopScheduler, worker: str) -> Unit | None:
        candidates = scheduler.runnable(worker, scheduler.open_units())
        return min(candidates, key=lambda u: (scheduler.waiting_since.get(u.model, -1), u), default=None)


# schedule name -> its choice of units, made from the seed
SCHEDULES: dict[str, Callable[[int], UnitChoice]] = {
    "fixed": FixedPlan,
    "greedy": GreedyQueue,
    "rolling": Rolling,
}
if set(SCHEDULES) != set(get_args(MopScheduleName)):
    raise ImportError("mopflow.training.executors.schedules: SCHEDULES and MopScheduleName disagree")
