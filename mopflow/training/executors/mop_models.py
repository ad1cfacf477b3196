"""The models of one MOP run: admission, their state between units, and the end of each round.

A model joins from its checkpoint when it has one (a restarted coordinator's retried trial,
even mid-epoch: the partitions it visited are skipped), carries its latest state from unit to
unit, and reports each epoch to the controller: at once when the round goes on past it (the
controller cannot stop it there), else at the end of the round, where the controller may stop it
or fill the slots freed with new models.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from mopflow.base import stopping
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import (
    Controller,
    EpochReport,
    ModelOutcome,
    RunBookkeeping,
    epochs_before_decision,
)
from mopflow.training.executors.scheduler import MopScheduler
from mopflow.training.executors.units import evaluate_state
from mopflow.training.trainable.state import partial_meta, read_meta
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)


class MopHost(RunBookkeeping, Protocol):
    """What a MOP run's models need from their executor (``MopExecutor``): the cluster, the data,
    the partitions and their scheduler, and how many models train at once."""

    client: Any
    data: DataRef
    partitions: dict[str, list[str]]
    scheduler: MopScheduler
    slots: int


class MopModels:
    """The bookkeeping of one :meth:`MopExecutor.run`: active models, their latest states, the
    partitions each visited in its current epoch and the epoch it trains next."""

    def __init__(
        self, executor: MopHost, epochs: int, controller: Controller, asks_ahead: bool = False
    ) -> None:
        self.executor, self.epochs, self.controller = executor, epochs, controller
        # the finishing models' successors asked within their round, the finished told late (start_round)
        self.asks_ahead = asks_ahead
        self.outcomes: dict[str, ModelOutcome] = {}
        self.states: dict[str, bytes] = {}
        self.visited: dict[str, list[str]] = {}
        self.next_epoch: dict[str, int] = {}
        self.active: dict[str, ModelSpec] = {}
        self.checkpointed: dict[str, float] = {}  # when each model was last checkpointed (or joined)
        self.joining: dict[str, ModelSpec] = {}  # asked ahead: they join at the next round
        self.finishing: set[str] = set()  # active models whose last epoch the current round holds
        self.told_later: list[ModelOutcome] = []  # done at a round's end: told once the next round runs
        self.asks_due = 0  # successors to ask ahead this round (start_round, ask_ahead)

    def admit(self, spec: ModelSpec) -> bool:
        """Take a model in: from its checkpoint when it has one (a restarted coordinator's retried
        trial), its finished epochs handed to the controller again. True (and the model active)
        when it has epochs left."""
        outcome = self.outcomes[spec.model_id] = ModelOutcome(spec)
        self._restore(spec)
        done = self.next_epoch.setdefault(spec.model_id, 0)
        keep = self.executor.replay_history(outcome, done - 1, self.controller) if done else True
        if keep and done < self.epochs:
            self.active[spec.model_id] = spec
            self.checkpointed[spec.model_id] = time.monotonic()
            return True
        outcome.stopped_early = not keep
        outcome.state = self.states.get(spec.model_id)
        outcome.checkpoint_uri = self.executor.kept_checkpoint(spec.model_id)
        self.controller.on_model_done(outcome)
        return False

    def _restore(self, spec: ModelSpec) -> None:
        """The model's state and position from its checkpoint, if it has one."""
        found = self.executor.load_checkpoint(spec.model_id)
        if found is None:
            return
        state, meta = found
        mid, partitions = spec.model_id, self.executor.partitions
        self.states[mid] = state
        epoch = int(meta.get("epoch", -1))
        seen = list(meta.get("visited", []))
        if partial_meta(state) is not None:  # stopped mid-pass on a notice: that unit comes first
            seen = [p for p in seen if p != meta.get("partition")]
            if meta.get("partition") in partitions:
                self.executor.scheduler.resume[mid] = str(meta["partition"])
        if len(seen) >= len(partitions):  # that epoch was complete
            self.next_epoch[mid], self.visited[mid] = epoch + 1, []
        else:
            self.next_epoch[mid], self.visited[mid] = epoch, seen
        self.executor.note_resumed(mid, self.next_epoch[mid] - 1, state)
        log.info("mop: %s resumes at epoch %d from its checkpoint", mid, self.next_epoch[mid] + 1)

    def unit_done(self, model_id: str, state: bytes) -> None:
        """A unit of the model finished: its new state and the partitions it has visited."""
        self.states[model_id] = state
        self.visited[model_id] = list(read_meta(state).get("visited", []))

    def checkpoint_due(self, model_id: str, every_s: float) -> bool:
        """Whether the model's state after its latest unit is to be checkpointed now: at the end
        of its epoch, when the run is asked to stop, or when its last checkpoint is ``every_s``
        seconds old. A restarted coordinator then redoes at most the model's units in flight and
        those of its last ``every_s`` seconds; with short units, a write per unit would cost the
        coordinator more than the unit's trip (``benchmarks/small_units.py``)."""
        now = time.monotonic()
        due = (
            self.epoch_complete(model_id)
            or stopping.stop_requested()
            or now - self.checkpointed.get(model_id, now) >= every_s
        )
        if due:
            self.checkpointed[model_id] = now
        return due

    def start_round(self, epochs: int) -> None:
        """A round of ``epochs`` epochs starts: the models whose last epoch it holds are finishing.
        With ``asks_ahead``, the trials that take their slots are due to be asked in this round
        (:meth:`ask_ahead`), before the round's end tells theirs; they join at the next round, and
        their first units can start on workers the round has no more units for
        (``mop_lookahead.py``). At a cohort's end the workers then train while the coordinator
        tells the finished trials, instead of waiting for it."""
        self.finishing = {m for m in self.active if self.next_epoch.get(m, 0) + epochs >= self.epochs}
        free = self.executor.slots - (len(self.active) - len(self.finishing)) - len(self.joining)
        self.asks_due = free if self.asks_ahead and self.finishing and free > 0 else 0

    def ask_ahead(self, at_most: int | None = None) -> None:
        """Ask (``at_most`` of) the successors due this round, once every model of the last round
        is told. The driver asks one between two units (four at once took 8-18 ms, in which
        workers ran out of units) and the rest before the round's reports, so that asks and tells
        keep their order whatever the timings."""
        if self.asks_due and not self.told_later:
            count = self.asks_due if at_most is None else min(at_most, self.asks_due)
            self.asks_due -= count
            self.joining |= {spec.model_id: spec for spec in self.controller.new_models(count)}

    def tell_done(self, at_most: int | None = None) -> None:
        """Hand the controller (``at_most`` of) the models done in their last epoch at the last
        round's end: with their successors asked ahead, nothing of the next round waits for their
        trials to be told (their bundles written), so the driver tells them one at a time between
        the next round's units while every worker has one queued (``Lookahead.driver_may_pause``),
        and every one before that round's end (whose asks see them all, whatever the timings)."""
        count = len(self.told_later) if at_most is None else at_most
        done, self.told_later = self.told_later[:count], self.told_later[count:]
        for outcome in done:
            self.controller.on_model_done(outcome)

    def next_round(self) -> list[str]:
        """The next round's models as far as known: the active ones not finishing, and those joining
        (the round's decisions may stop more)."""
        return sorted({m for m in self.active if m not in self.finishing} | set(self.joining))

    def spec_of(self, model_id: str) -> ModelSpec:
        """An active or joining model's spec."""
        return self.active.get(model_id) or self.joining[model_id]

    def epochs_before_decision(self) -> int:
        """Epochs every active model trains before the controller may next stop any of them."""
        return min(
            epochs_before_decision(self.controller, self.next_epoch.get(mid, 0), self.epochs)
            for mid in self.active
        )

    def epoch_complete(self, model_id: str) -> bool:
        """Whether the model has visited every partition in its current epoch."""
        return len(self.visited.get(model_id, [])) >= len(self.executor.partitions)

    def end_epoch(self, model_id: str, val_acc: float | None, records: list[dict[str, Any]]) -> None:
        """Report a model's epoch that ended before its round's last: the controller cannot stop
        a model there, so the order of these reports decides nothing."""
        if val_acc is None:  # its last unit did not validate (see _validate)
            val_acc = float(self._validate([model_id])[model_id].result())
        self._end_epoch(model_id, val_acc, records)

    def fail(self, model_id: str, error: str) -> None:
        """The model failed (e.g. a non-finite loss): it leaves the run; the sweep goes on."""
        self.outcomes[model_id].error = error
        self.states.pop(model_id, None)
        self.active.pop(model_id, None)
        self.controller.on_model_done(self.outcomes[model_id])

    def end_round(self, records: list[dict[str, Any]], val_accs: dict[str, float]) -> None:
        """Report every model that finished an epoch, in model order (the pruner's decisions
        depend on the order it hears them, never on which unit finished first); the controller
        may stop or add models."""
        finished = [mid for mid in sorted(self.active) if mid in self.states and self.epoch_complete(mid)]
        missing = self._validate(mid for mid in finished if mid not in val_accs)
        for mid in finished:
            val_acc = val_accs[mid] if mid in val_accs else float(missing[mid].result())
            self._end_epoch(mid, val_acc, records)
        joining, self.joining = list(self.joining.values()), {}  # asked ahead: they come first
        free = max(0, self.executor.slots - len(self.active) - len(joining))
        for spec in [*joining, *self.controller.new_models(free)]:
            if self.admit(spec):
                log.info("mop: %s joins at the next round", spec.model_id)

    def _validate(self, models: Iterable[str]) -> dict[str, Any]:
        """Validation of ``models`` on the cluster (futures of their accuracy): an epoch's last
        unit normally validates its model; one without a figure is validated here."""
        return {
            mid: self.executor.client.submit(
                evaluate_state,
                self.active[mid],
                self.states[mid],
                self.executor.data,
                pure=False,
                resources=self.active[mid].device.resources() or None,
            )
            for mid in models
        }

    def _end_epoch(self, mid: str, val_acc: float, records: list[dict[str, Any]]) -> None:
        """Report the model's finished epoch (``records``: the round's units, of every model);
        it is done when stopped or out of epochs."""
        epoch = self.next_epoch.get(mid, 0)
        records = [r for r in records if r["model"] == mid and int(r["epoch"]) == epoch]
        report = EpochReport(
            mid,
            epoch,
            val_acc,
            float(records[-1]["train_loss"]) if records else float("nan"),
            float(records[-1]["lr_end"]) if records else None,
        )
        outcome = self.outcomes[mid]
        self.next_epoch[mid], self.visited[mid] = epoch + 1, []
        keep = self.executor.report_epoch(outcome, report, self.controller)
        log.info(
            "mop: %s epoch %d/%d val_acc=%.4f%s",
            mid,
            epoch + 1,
            self.epochs,
            report.val_acc,
            "" if keep else " (stopped)",
        )
        if not keep:
            outcome.stopped_early = True
        if not keep or epoch + 1 >= self.epochs:
            outcome.state = self.states[mid]
            outcome.checkpoint_uri = self.executor.kept_checkpoint(mid)
            del self.active[mid]
            if self.asks_ahead and mid in self.finishing:  # in its last epoch: its successor is asked
                self.told_later.append(outcome)
            else:
                self.controller.on_model_done(outcome)  # before its slot is filled again

    def final_outcomes(self) -> dict[str, ModelOutcome]:
        """Every model's outcome, with its latest state."""
        for mid, state in self.states.items():
            self.outcomes[mid].state = state
            self.outcomes[mid].checkpoint_uri = self.executor.kept_checkpoint(mid)
        return self.outcomes
