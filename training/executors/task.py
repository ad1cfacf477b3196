"""Task parallelism on Dask (each model trains on one worker over all the data) and the
sequential baseline (one model after another, in this process).

Volatile workers: an epoch whose worker got a spot notice comes back as ``UnitPreempted`` with
its state at the last batch boundary and is submitted again from there; one whose worker died
(SIGKILL) is run again from the epoch's start by Dask. ``redone_unit_seconds`` sums the work
lost (the scheduler's record of the spans that never finished, less what a notice saved).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from training.executors.units import (
    DataRef,
    ModelSpec,
    evaluate_state,
    init_state,
    train_pass,
    train_pass_and_validate,
)
from training.preempt import UnitPreempted, lost_spans, redone_seconds, task_story

log = logging.getLogger(__name__)


class TaskExecutor(Executor):
    """One Dask task per model-epoch over all training shards; at most one model per worker.

    Every worker that trains loads the full training set (its storage footprint is the data
    times the number of workers), the cost MOP avoids.
    """

    name = "task"

    def __init__(
        self, client: Any, data: DataRef, shard_names: Sequence[str], checkpoint_root: str = ""
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.shards = sorted(shard_names)
        self.slots = len(client.scheduler_info()["workers"])
        self.redone_unit_seconds = 0.0  # work lost with interrupted epochs, to be done again
        self.interruptions: list[dict[str, Any]] = []

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        from distributed import wait

        controller = controller or TrainAll()
        pending = list(models)
        outcomes: dict[str, ModelOutcome] = {m.model_id: ModelOutcome(m) for m in models}
        next_epoch: dict[str, int] = {}
        states: dict[str, bytes] = {}
        in_flight: dict[Any, str] = {}
        specs = {m.model_id: m for m in models}
        leaving: set[str] = set()  # workers that said they are being preempted

        def submit(mid: str) -> None:
            spec = specs[mid]
            epoch = next_epoch.get(mid, 0)
            state = states.get(mid) or init_state(spec, self.data)
            elsewhere: dict[str, Any] = {}
            if leaving:  # keep off workers on their way out (loosely: any worker if none else)
                others = sorted(set(self.client.scheduler_info()["workers"]) - leaving)
                elsewhere = {"workers": others, "allow_other_workers": True} if others else {}
            future = self.client.submit(
                _train_and_validate,
                spec,
                state,
                self.data,
                self.shards,
                epoch,
                epochs,
                pure=False,
                key=f"task-{mid}-e{epoch}-{time.monotonic_ns()}",
                resources=spec.device.resources() or None,
                **elsewhere,
            )
            in_flight[future] = mid

        for spec in pending:
            found = self.load_checkpoint(spec.model_id)
            if found is not None:
                states[spec.model_id], meta = found
                next_epoch[spec.model_id] = int(meta.get("epoch", -1)) + 1
                log.info(
                    "task: %s resumes at epoch %d from its checkpoint",
                    spec.model_id,
                    next_epoch[spec.model_id] + 1,
                )
        queue = [m.model_id for m in pending if next_epoch.get(m.model_id, 0) < epochs]
        while queue or in_flight:
            while queue and len(in_flight) < self.slots:
                submit(queue.pop(0))
            done, _ = wait(list(in_flight), return_when="FIRST_COMPLETED")
            for future in done:
                mid = in_flight.pop(future)
                try:
                    state, record, val_acc = future.result()
                except UnitPreempted as exc:  # a spot notice: the epoch goes on from its batch
                    if exc.state is not None:
                        states[mid] = exc.state
                    worker = str(exc.record.get("worker", ""))
                    leaving.add(worker)  # forgotten when the restarted worker takes a new address
                    redone = max(0.0, float(exc.record["end"]) - float(exc.record["saved_at"]))
                    self._account(mid, next_epoch.get(mid, 0), worker, "notice", redone)
                    queue.insert(0, mid)
                    continue
                except Exception as exc:
                    log.warning("task: %s failed at epoch %d: %s", mid, next_epoch.get(mid, 0) + 1, exc)
                    outcomes[mid].error = f"{type(exc).__name__}: {exc}"
                    outcomes[mid].state = states.get(mid)
                    controller.on_model_done(outcomes[mid])
                    queue += self._refill(controller, specs, outcomes, epochs, len(queue) + len(in_flight))
                    continue
                finally:  # the result is here now: the worker need not keep it (nor hand it off)
                    future.release()
                epoch = next_epoch.get(mid, 0)
                lost = redone_seconds(lost_spans(task_story(self.client, str(future.key))))
                if lost > 0:  # its worker died: Dask ran the epoch again from its start
                    self._account(mid, epoch, "", "killed", lost)
                states[mid] = state
                self.records.append(record)
                self.save_checkpoint(mid, state)
                report = EpochReport(
                    mid, epoch, val_acc, float(record["train_loss"]), float(record["lr_end"])
                )
                outcomes[mid].history.append(report)
                next_epoch[mid] = epoch + 1
                keep = controller.on_epoch_end(report)
                log.info(
                    "task: %s epoch %d/%d val_acc=%.4f on %s",
                    mid,
                    epoch + 1,
                    epochs,
                    val_acc,
                    record["worker"],
                )
                if keep and epoch + 1 < epochs:
                    queue.append(mid)
                else:
                    outcomes[mid].stopped_early = not keep
                    outcomes[mid].state = state
                    outcomes[mid].checkpoint_uri = self.checkpoint_uri(mid) if self.checkpoint_root else None
                    controller.on_model_done(outcomes[mid])
                    queue += self._refill(controller, specs, outcomes, epochs, len(queue) + len(in_flight))
        for mid, outcome in outcomes.items():
            outcome.state = states.get(mid)
            outcome.checkpoint_uri = self.checkpoint_uri(mid) if self.checkpoint_root else None
        return outcomes

    def _account(self, mid: str, epoch: int, worker: str, kind: str, redone: float) -> None:
        self.redone_unit_seconds += redone
        self.interruptions.append(
            {
                "model": mid,
                "epoch": epoch,
                "worker": worker,
                "kind": kind,
                "redone_s": redone,
                "at": time.time(),
            }
        )
        log.warning(
            "task: %s epoch %d interrupted (%s%s): %.2f unit-seconds to redo, %.2f in all",
            mid,
            epoch + 1,
            kind,
            f" on {worker}" if worker else "",
            redone,
            self.redone_unit_seconds,
        )

    def _refill(
        self,
        controller: Controller,
        specs: dict[str, ModelSpec],
        outcomes: dict[str, ModelOutcome],
        epochs: int,
        busy: int,
    ) -> list[str]:
        added = controller.new_models(max(0, self.slots - busy))
        for spec in added:
            specs[spec.model_id] = spec
            outcomes[spec.model_id] = ModelOutcome(spec)
        return [s.model_id for s in added]


def _train_and_validate(
    spec: ModelSpec, state: bytes, data: DataRef, shards: Sequence[str], epoch: int, epochs: int
) -> tuple[bytes, dict[str, Any], float]:
    """One epoch over all shards, then validation, on the same worker (one round trip per epoch)."""
    new_state, record, val_acc = train_pass_and_validate(
        spec, state, data, shards, epoch, epochs, 0, validate=True
    )
    assert val_acc is not None
    return new_state, record, val_acc


class SequentialExecutor(Executor):
    """The baseline: models one after another in this process, each epoch over all shards in order."""

    name = "sequential"

    def __init__(self, data: DataRef, shard_names: Sequence[str], checkpoint_root: str = "") -> None:
        super().__init__(data, checkpoint_root)
        self.shards = sorted(shard_names)

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        ctl = controller or TrainAll()
        return self._one_model_at_a_time(models, ctl, lambda spec: self._train_one(spec, epochs, ctl))

    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        outcome = ModelOutcome(spec)
        state = init_state(spec, self.data)
        for epoch in range(epochs):
            state, record = train_pass(spec, state, self.data, self.shards, epoch, epochs, 0)
            self.records.append(record)
            report = EpochReport(
                spec.model_id, epoch, evaluate_state(spec, state, self.data), record["train_loss"]
            )
            outcome.history.append(report)
            if not controller.on_epoch_end(report):
                outcome.stopped_early = True
                break
        outcome.state = state
        self.save_checkpoint(spec.model_id, state)
        return outcome
