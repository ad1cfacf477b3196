"""ASHA's rungs with promotions (asynchronous successive halving, Li et al. 2020).

A rung is an epoch count: ``min_resource * reduction_factor**k``, below the epoch budget. A model
that reaches a rung goes on at once when it ranks in the top ``1/reduction_factor`` of every
model that reached that rung so far. Otherwise it *waits* there: it stops, and it is promoted
later (it resumes from its checkpoint) once enough weaker models reached the rung to put it in
that top fraction. Without waiting, an early model could only be kept or stopped for good, so
each new best among the first few at a rung ran to the end (Optuna's ``SuccessiveHalvingPruner``
keeps the best so far while a rung holds fewer than ``2 * reduction_factor`` results).

Pure bookkeeping: the search controller (``training/search/controller.py``) feeds it every
model's value at each rung and asks it which waiting models to promote when a slot frees up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mopflow.training.search.algorithms import rung_epochs

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

PROMOTED_ATTR = "mopflow_promoted_from"  # a trial that continues a model stopped at a rung
WAITS_ATTR = "mopflow_waits_with"  # the checkpoint a model stopped at a rung waits with


@dataclass
class Rungs:
    """Every model's value at each rung it reached, and which models went on from each rung."""

    min_resource: int
    reduction_factor: int
    max_epochs: int
    values: dict[int, dict[str, float]] = field(default_factory=dict)  # rung -> model -> value
    promoted: dict[int, set[str]] = field(default_factory=dict)  # rung -> models that went on

    def epochs(self) -> list[int]:
        """The epoch count of each rung, first to last (all below ``max_epochs``)."""
        return rung_epochs(self.min_resource, self.max_epochs, self.reduction_factor)

    def rung_at(self, epochs_done: int) -> int | None:
        """The rung a model reaches after ``epochs_done`` epochs (None between rungs, and at or
        past the last epoch, where there is nothing left to decide)."""
        rungs = self.epochs()
        return rungs.index(epochs_done) if epochs_done in rungs else None

    def top(self, rung: int) -> set[str]:
        """The models in the top ``1/reduction_factor`` at ``rung`` (ties: the earlier id)."""
        ranked = sorted(self.values.get(rung, {}).items(), key=lambda item: (-item[1], item[0]))
        return {model for model, _ in ranked[: len(ranked) // self.reduction_factor]}

    def reach(self, rung: int, model_id: str, value: float) -> bool:
        """Record ``model_id`` at ``rung``; True (and it is promoted) when it goes on now."""
        self.values.setdefault(rung, {})[model_id] = value
        if model_id in self.top(rung):
            self.promoted.setdefault(rung, set()).add(model_id)
            return True
        return False

    def highest_rung(self, model_id: str) -> int | None:
        """The highest rung ``model_id`` reached (None before the first)."""
        reached = [rung for rung, models in self.values.items() if model_id in models]
        return max(reached) if reached else None

    def promotable(self, waiting: Iterable[str]) -> list[str]:
        """The waiting models now in the top of the rung they wait at, highest rung first (ASHA
        promotes from the top down), then by value."""
        ready, tops = [], {rung: self.top(rung) for rung in self.values}
        for model in waiting:
            rung = self.highest_rung(model)
            if rung is not None and model not in self.promoted.get(rung, set()) and model in tops[rung]:
                ready.append((-rung, -self.values[rung][model], model))
        return [model for _, _, model in sorted(ready)]

    def promote(self, model_id: str) -> None:
        """``model_id`` goes on from the rung it waits at."""
        rung = self.highest_rung(model_id)
        if rung is not None:
            self.promoted.setdefault(rung, set()).add(model_id)


def current(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """``trials`` without those a promotion continued (their model's trial is the promotion)."""
    continued = {int(t.user_attrs[PROMOTED_ATTR]) for t in trials if PROMOTED_ATTR in t.user_attrs}
    return [t for t in trials if t.number not in continued]
