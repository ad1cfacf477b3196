"""Task parallelism on Dask (each model trains on one worker over all the data) and the
sequential baseline (one model after another, in this process).

Volatile workers: an epoch whose worker got a spot notice comes back as ``UnitPreempted`` with
its state at the last batch boundary and is submitted again from there; one whose worker died
(SIGKILL) is run again from the epoch's start by Dask. ``redone_unit_seconds`` sums the work
lost (the scheduler's record of the spans that never finished, less what a notice saved).

In batches (``batches=True``, the search's ``trial_batches``) the run does not depend on which
epoch finishes first: new models start only once every model of the previous batch is done, and
a batch trains in step, each model's epoch result held until every model of the batch has one,
then handed to the controller in the order the models started, before their next epochs are
submitted. The controller (its sampler and pruner) so sees the same reports in the same order
whatever the timings.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from mopflow.infra.base import stopping
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, Executor, ModelOutcome, OneModelAtATime
from mopflow.training.executors.stop_notice import StopNotice
from mopflow.training.executors.units import evaluate_state, init_state, train_pass, train_pass_and_validate
from mopflow.training.trainable.state import StateFormatError, global_step, partial_meta
from mopflow.training.trainable.unit import ModelSpec
from mopflow.training.volatile.preempt import UnitPreempted, lost_spans, redone_seconds, task_story

# How long an epoch handed back by a spot notice waits for its worker to leave before it is
# submitted anyway (the worker leaves within its grace period, MOPFLOW_PREEMPT_GRACE_S).
LEAVE_WAIT_S = 60.0

log = logging.getLogger(__name__)


class Admission(Protocol):
    """Who decides when another model may start (``training/volatile/scaling.py``'s rounds of n_j)."""

    def may_start(self, in_flight: int) -> bool: ...

    def started(self) -> None: ...


class TaskExecutor(Executor):
    """Task parallelism: each model trains an epoch per Dask task over all training shards, one
    model per worker at a time; the ``task`` strategy of the search.

    At most ``slots`` models (default: the workers present) are active at once, or as many as
    ``admission`` allows (worker rounds). A freed slot goes to the controller's next model at
    once, or, in ``batches``, once every active model is done (see the module docstring). Every
    worker that trains loads the full training set once (its storage footprint is the data times
    the number of workers), the cost MOP avoids.
    """

    name = "task"
    stops_on_its_own = True  # a stop lets the epochs in flight checkpoint first

    def __init__(
        self,
        client: Any,
        data: DataRef,
        shard_names: Sequence[str],
        checkpoint_root: str = "",
        slots: int | None = None,
        admission: Admission | None = None,
        batches: bool = False,
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.shards = sorted(shard_names)
        self.slots = slots or len(client.scheduler_info()["workers"]) or 1
        self.admission = admission
        self.batches = batches
        self.started_at: dict[str, float] = {}

    def may_start(self, active: int) -> bool:
        """Whether another model may start while ``active`` models train."""
        if self.admission is not None:
            return self.admission.may_start(active)
        return active < self.slots

    def _train(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        from distributed import wait

        run = _TaskRun(self, epochs, controller, waiting=list(models))
        notice = StopNotice(self.client, "task", "epoch")  # asked to stop: epochs in flight checkpoint
        run.admit()
        while run.in_flight or run.deferred:
            done = set()
            if not run.in_flight:  # only epochs waiting for a leaving worker to go
                time.sleep(0.5)
            else:
                with contextlib.suppress(TimeoutError):
                    done, _ = wait(list(run.in_flight), timeout=0.5, return_when="FIRST_COMPLETED")
            if stopping.stop_requested():  # the epochs in flight checkpoint at their next batch and come back
                notice.give(len(run.in_flight))
            for future in done:
                run.collect(future)
            if stopping.stop_requested():
                run.deferred.clear()  # they wait in their checkpoints for the resume
            run.release()
            if not stopping.stop_requested():
                run.submit_deferred()
                run.admit()
        notice.withdraw()
        stopping.raise_if_stopped()
        for mid, outcome in run.outcomes.items():
            outcome.state = run.states.get(mid, outcome.state)
            outcome.checkpoint_uri = self.kept_checkpoint(mid)
        return run.outcomes

    def account(self, mid: str, epoch: int, worker: str, kind: str, redone: float) -> None:
        """Record work lost with an interrupted epoch (a notice or a killed worker)."""
        self.record_interruption(redone, model=mid, epoch=epoch, worker=worker, kind=kind)
        log.warning(
            "task: %s epoch %d interrupted (%s%s): %.2f unit-seconds to redo, %.2f in all",
            mid,
            epoch + 1,
            kind,
            f" on {worker}" if worker else "",
            redone,
            self.redone_unit_seconds,
        )


class _TaskRun:
    """The bookkeeping of one :meth:`TaskExecutor.run`: active models, their states and epochs."""

    def __init__(
        self, executor: TaskExecutor, epochs: int, controller: Controller, waiting: list[ModelSpec]
    ) -> None:
        self.x, self.epochs, self.controller = executor, epochs, controller
        self.waiting = waiting  # models to start, before the controller's new ones
        self.outcomes: dict[str, ModelOutcome] = {}
        self.specs: dict[str, ModelSpec] = {}
        self.states: dict[str, bytes] = {}
        self.next_epoch: dict[str, int] = {}
        self.active: set[str] = set()
        self.in_flight: dict[Any, str] = {}
        self.leaving: set[str] = set()  # workers that said they are being preempted
        self.deferred: dict[str, float] = {}  # model -> deadline: waiting for a leaving worker to go
        self.held: dict[str, EpochReport] = {}  # in batches: epochs waiting for the rest of their batch
        self.started: dict[str, int] = {}  # model -> when it (last) started, counted in models

    def admit(self) -> None:
        """Start models while there are slots (or the admission says so): the waiting ones first,
        then the controller's; in batches, only once the previous batch is done."""
        if self.x.batches and self.active:
            return
        while True:
            if not self.waiting and not self.active:
                # ask before admitting: with nothing active, admission may open a new round
                # of workers, which only a model to start should do
                self.waiting.extend(self.controller.new_models(1))
                if not self.waiting:
                    return
            if not self.x.may_start(len(self.active)):
                return
            spec = self.waiting.pop(0) if self.waiting else next(iter(self.controller.new_models(1)), None)
            if spec is None:
                return
            if self.x.admission is not None:
                self.x.admission.started()
            self.start(spec)

    def start(self, spec: ModelSpec) -> None:
        """Take a model in: from its checkpoint when it has one (a restarted coordinator's retried
        trial, its finished epochs handed to the controller again), then its next epoch."""
        mid = spec.model_id
        self.specs[mid], self.outcomes[mid] = spec, ModelOutcome(spec)
        self.x.started_at[mid] = time.time()
        self.started[mid] = max(self.started.values(), default=-1) + 1
        keep = True
        try:
            found = self.x.load_checkpoint(mid)
        except StateFormatError as exc:  # a damaged or tampered checkpoint: never loaded
            self.fail(mid, f"{type(exc).__name__}: {exc}")
            return
        if found is not None:
            state, meta = found
            stopped_mid_epoch = partial_meta(state) is not None
            epoch = int(meta.get("epoch", -1)) + (0 if stopped_mid_epoch else 1)
            self.states[mid], self.next_epoch[mid] = state, epoch
            self.x.resumed[mid] = {"epoch": epoch - 1, "step": global_step(state)}
            log.info(
                "task: %s resumes at epoch %d (step %d) from its checkpoint",
                mid,
                epoch + 1,
                global_step(state),
            )
            keep = self.x.replay_history(self.outcomes[mid], epoch - 1, self.controller)
        self.active.add(mid)
        if keep and self.next_epoch.get(mid, 0) < self.epochs:
            self.submit(mid)
        else:
            self.finish(mid, stopped_early=not keep)

    def submit(self, mid: str) -> None:
        """Submit the model's next epoch; while a worker given a spot notice is still connected, the
        epoch waits (:meth:`submit_deferred`) so that it does not land on that worker. (Restricting
        it to the other workers instead can strand it: when those die too, Dask keeps a task
        restricted to workers that are gone unrunnable, even with loose restrictions.)"""
        if self._leaving_still_here():
            self.deferred.setdefault(mid, time.monotonic() + LEAVE_WAIT_S)
            return
        self._submit_now(mid)

    def _leaving_still_here(self) -> bool:
        if not self.leaving:
            return False
        self.leaving &= set(self.x.client.scheduler_info()["workers"])  # the gone ones are forgotten
        return bool(self.leaving)

    def submit_deferred(self) -> None:
        """Submit the deferred epochs once the leaving workers are gone (or waited long enough)."""
        if not self.deferred:
            return
        gone = not self._leaving_still_here()
        for mid, deadline in list(self.deferred.items()):
            if gone or time.monotonic() > deadline:
                del self.deferred[mid]
                self._submit_now(mid)

    def _submit_now(self, mid: str) -> None:
        spec = self.specs[mid]
        epoch = self.next_epoch.get(mid, 0)
        state = self.states.get(mid) or init_state(spec, self.x.data)
        future = self.x.client.submit(
            _train_and_validate,
            spec,
            state,
            self.x.data,
            self.x.shards,
            epoch,
            self.epochs,
            pure=False,
            key=f"task-{mid}-e{epoch}-{time.monotonic_ns()}",
            resources=spec.device.resources() or None,
        )
        self.in_flight[future] = mid

    def collect(self, future: Any) -> None:
        """Take in one finished epoch task: report it, then the model's next epoch or its end."""
        mid = self.in_flight.pop(future)
        epoch = self.next_epoch.get(mid, 0)
        try:
            state, record, val_acc = future.result()
        except UnitPreempted as exc:  # a spot notice: the epoch goes on from its batch elsewhere
            # an attempt on a worker killed before this one is work redone too
            self._account_killed(mid, epoch, future)
            self._preempted(mid, epoch, exc)
            return
        except Exception as exc:
            log.warning("task: %s failed at epoch %d: %s", mid, epoch + 1, exc)
            self.fail(mid, f"{type(exc).__name__}: {exc}")
            return
        finally:  # the result is here now: the worker need not keep it (nor hand it off)
            future.release()
        if self._account_killed(mid, epoch, future):  # Dask ran the epoch again from its start
            self.x.resumed[mid] = {"epoch": epoch - 1, "step": global_step(self.states.get(mid))}
        self.states[mid] = state
        self.x.records.append(record)
        self.x.save_checkpoint(mid, state)
        report = EpochReport(mid, epoch, val_acc, float(record["train_loss"]), float(record["lr_end"]))
        self.next_epoch[mid] = epoch + 1
        if epoch == 0 or (epoch + 1) % 10 == 0 or epoch + 1 == self.epochs:
            log.info(
                "task: %s epoch %d/%d val_acc=%.4f on %s",
                mid,
                epoch + 1,
                self.epochs,
                val_acc,
                record["worker"],
            )
        if self.x.batches:
            self.held[mid] = report  # handed over with the rest of its batch (:meth:`release`)
        else:
            self.deliver(report)

    def deliver(self, report: EpochReport) -> None:
        """Hand a model's epoch to the controller, then submit its next epoch or end it."""
        mid = report.model_id
        keep = self.x.report_epoch(self.outcomes[mid], report, self.controller)
        if keep and report.epoch + 1 < self.epochs:
            if stopping.stop_requested():  # the run stops: the next epoch starts on resume
                return
            self.submit(mid)
        else:
            self.finish(mid, stopped_early=not keep)

    def release(self) -> None:
        """In batches: the held epochs, in the order their models started, once every active model
        has one (a failed model has left the batch), or once nothing else can come (the run stops)."""
        if not self.held:
            return
        if not self.active <= set(self.held) and (self.in_flight or self.deferred):
            return
        held, self.held = self.held, {}
        for mid in sorted(held, key=self.started.__getitem__):
            self.deliver(held[mid])

    def _account_killed(self, mid: str, epoch: int, future: Any) -> bool:
        """Record the work of attempts of this epoch lost with a killed worker (from the
        scheduler's story of its task); whether there were any."""
        lost = redone_seconds(lost_spans(task_story(self.x.client, str(future.key))))
        if lost > 0:
            self.x.account(mid, epoch, "", "killed", lost)
        return lost > 0

    def _preempted(self, mid: str, epoch: int, exc: UnitPreempted) -> None:
        """An epoch stopped by a spot notice: its state is checkpointed and it goes on from that
        batch on another worker (or waits in its checkpoint when the run stops)."""
        if exc.state is not None:
            self.states[mid] = exc.state
            self.x.save_checkpoint(mid, exc.state)
            self.x.resumed[mid] = {
                "epoch": epoch - 1,
                "step": global_step(exc.state),
                "after_notice": True,
            }
        if stopping.stop_requested():  # the run stops: the model waits in its checkpoint
            log.info(
                "task: %s saved at batch %d of epoch %d",
                mid,
                int(exc.record.get("batches", 0)),
                epoch + 1,
            )
            return
        worker = str(exc.record.get("worker", ""))
        self.leaving.add(worker)  # forgotten once it has left (a restarted one has a new address)
        self.x.account(
            mid,
            epoch,
            worker,
            "notice",
            max(0.0, float(exc.record["end"]) - float(exc.record["saved_at"])),
        )
        self.submit(mid)

    def fail(self, mid: str, error: str) -> None:
        self.outcomes[mid].error = error
        self.finish(mid, stopped_early=False)

    def finish(self, mid: str, stopped_early: bool) -> None:
        """The model is done: its outcome to the controller (which may add a model in its slot)."""
        self.active.discard(mid)
        outcome = self.outcomes[mid]
        outcome.stopped_early = stopped_early
        outcome.state = self.states.get(mid)
        outcome.checkpoint_uri = self.x.kept_checkpoint(mid)
        self.controller.on_model_done(outcome)


def _train_and_validate(
    spec: ModelSpec, state: bytes, data: DataRef, shards: Sequence[str], epoch: int, epochs: int
) -> tuple[bytes, dict[str, Any], float]:
    """One epoch over all shards, then validation, on the same worker (one round trip per epoch)."""
    new_state, record, val_acc = train_pass_and_validate(
        spec, state, data, shards, epoch, epochs, 0, validate=True
    )
    assert val_acc is not None
    return new_state, record, val_acc


class SequentialExecutor(OneModelAtATime):
    """The baseline: models one after another in this process, each epoch over all shards in order."""

    name = "sequential"

    def __init__(self, data: DataRef, shard_names: Sequence[str], checkpoint_root: str = "") -> None:
        super().__init__(data, checkpoint_root)
        self.shards = sorted(shard_names)

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
