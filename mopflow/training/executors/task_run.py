"""The bookkeeping of one ``task`` run (``training/executors/task.py``): active models, their
states, and their epochs in flight as *chains*.

A chain is a model's epochs up to the controller's next decision point (ASHA's next rung, or the
end of training), trained in one Dask task with the model kept in memory. Under a controller
that may stop a model after any epoch (the median pruner), a chain runs to the end of training
and the controller decides as each epoch is heard: when it stops the model, the chain's worker
is told to end it at its next batch (``chains.stop_chain``), and what the chain trained past the
decision is dropped, so the model's history and checkpoint end at the epoch it was stopped after.
Without checkpoints (nothing staged to go back to), or in batches, such a chain is one epoch.

The coordinator hears a chain's epochs as Dask events, each carrying the records since the
last: a chain's first and a decision's epoch as they end, the others every ``hear_every_s`` s;
the chain's result carries every record too. An epoch is handed to the controller once.

The worker stages its state after each epoch but the last (``STAGED_FILE``); the state of an
epoch it tells of (``staged`` in its record) stays, and the coordinator makes it the checkpoint
before the controller hears of the epoch: the checkpoint never runs ahead of the history. Each
state carries its epoch's record, which a retry tells when its attempt was cut off first. A
chain whose worker died is run again by Dask from the newest state within it (``chains.py``): at
most an epoch is lost; a restarted coordinator goes on from the checkpoint, at most about
``hear_every_s`` seconds behind.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from mopflow.base import stopping
from mopflow.training.compute.workers import cluster_workers
from mopflow.training.executors.base import (
    Controller,
    EpochReport,
    ModelOutcome,
    decides_after,
    decides_after_any_epoch,
    epochs_before_decision,
    raise_if_cluster_lost,
    unheard_epoch,
)
from mopflow.training.executors.chains import stop_chain, train_chain
from mopflow.training.executors.task_host import TaskHost
from mopflow.training.executors.task_notices import account_killed, take_preempted
from mopflow.training.executors.units import ChainStopped
from mopflow.training.trainable.state import StateFormatError, global_step, partial_meta
from mopflow.training.trainable.unit import ModelSpec
from mopflow.training.volatile.preempt import UnitPreempted

# How long an epoch handed back by a spot notice waits for its worker to leave before it is
# submitted anyway (the worker leaves within its grace period, MOPFLOW_PREEMPT_GRACE_S).
LEAVE_WAIT_S = 60.0

log = logging.getLogger(__name__)


class TaskRun:
    """The bookkeeping of one :meth:`TaskExecutor.run`: active models, their states and chains."""

    def __init__(
        self,
        executor: TaskHost,
        epochs: int,
        controller: Controller,
        waiting: list[ModelSpec],
        run_id: str = "",
    ) -> None:
        self.executor, self.epochs, self.controller = executor, epochs, controller
        self.run_id = run_id  # whose chains' epochs are heard as they end ("": at the chain's end)
        self.waiting = waiting  # models to start, before the controller's new ones
        self.outcomes: dict[str, ModelOutcome] = {}
        self.specs: dict[str, ModelSpec] = {}
        self.states: dict[str, bytes] = {}
        self.next_epoch: dict[str, int] = {}  # the first epoch of the model's chain in flight, or next
        self.told: dict[str, int] = {}  # the last epoch each model handed to the controller
        self.early: dict[str, dict[int, tuple[dict[str, Any], bool]]] = {}  # heard before an earlier epoch
        self.stop_after: dict[str, int] = {}  # model -> the epoch after which the controller stopped it
        self.active: set[str] = set()
        self.in_flight: dict[Any, str] = {}
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()  # finished chains and heard epochs
        self.leaving: set[str] = set()  # workers that said they are being preempted
        self.deferred: dict[str, float] = {}  # model -> deadline: waiting for a leaving worker to go
        self.held: dict[str, dict[str, Any]] = {}  # in batches: epochs waiting for their batch
        self.started: dict[str, int] = {}  # model -> when it (last) started, counted in models
        self.chains: dict[str, tuple[str, int]] = {}  # model -> its chain in flight: (Dask key, last epoch)
        self.where: dict[str, str] = {}  # model -> the worker its chain's last heard epoch came from
        # a chain runs to the end and a stop reaches it on its worker (see the module docstring)
        self.to_the_end = bool(run_id and executor.checkpoint_root and not executor.batches) and (
            decides_after_any_epoch(controller)
        )

    # -- what comes in: finished chains and the epochs heard before them ---------------------

    def next_done(self, timeout: float) -> list[Any]:
        """Hand the controller every epoch heard so far; the chains that finished (waits up to
        ``timeout`` seconds for the first of either)."""
        items = []
        try:
            items.append(self.inbox.get(timeout=timeout))
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        done = []
        for kind, item in items:
            if kind == "epochs":
                records, worker = item
                mid = str(records[-1]["model"])
                moved = self.where.get(mid) != worker
                self.where[mid] = worker
                if moved and mid in self.stop_after:  # a stopped chain, run again elsewhere by Dask
                    self._stop_chain(mid, self.stop_after[mid])
                for record in records:
                    self.take_epoch(mid, record)
            elif item in self.in_flight:
                done.append(item)
        return done

    def take_epoch(self, mid: str, record: dict[str, Any], staged: bool | None = None) -> None:
        """Hand one trained epoch to the controller, once and in order (an epoch already told is
        passed over; one heard before an earlier epoch waits for it), its staged state made the
        checkpoint first where there is one (``staged``; None: as the record says). A chain run
        again from states an earlier attempt staged tells their epochs only with its result,
        after the epochs it trains."""
        epoch = int(record["epoch"])
        staged = bool(record.get("staged")) if staged is None else staged
        if (
            mid not in self.active
            or epoch <= self.told.get(mid, -1)
            or epoch > self.stop_after.get(mid, epoch)
        ):
            return  # told before, or trained past the epoch the controller stopped the model after
        if epoch > self.told.get(mid, -1) + 1:
            self.early.setdefault(mid, {})[epoch] = (record, staged)
            return
        self._tell(mid, record, staged)
        waiting = self.early.get(mid, {})
        while self.told[mid] + 1 in waiting:
            self._tell(mid, *waiting.pop(self.told[mid] + 1))

    def _tell(self, mid: str, record: dict[str, Any], staged: bool) -> None:
        epoch = int(record["epoch"])
        self.told[mid] = epoch
        if staged:
            self.executor.promote_staged(mid, epoch)
        self.executor.records.append(record)
        report = EpochReport(
            mid, epoch, float(record["val_acc"]), float(record["train_loss"]), float(record["lr_end"])
        )
        if epoch == 0 or (epoch + 1) % 10 == 0 or epoch + 1 == self.epochs:
            log.info(
                "task: %s epoch %d/%d val_acc=%.4f on %s",
                mid,
                epoch + 1,
                self.epochs,
                report.val_acc,
                record["worker"],
            )
        if not self.executor.report_epoch(self.outcomes[mid], report, self.controller):
            self.stop_after[mid] = epoch
            self._stop_chain(mid, epoch)

    def _stop_chain(self, mid: str, epoch: int) -> None:
        """The model was stopped after ``epoch``: a chain of it in flight that goes on past that
        epoch is told to stop at its next batch, on the worker it was heard from."""
        key, last = self.chains.get(mid, ("", -1))
        if last <= epoch:
            return
        where = self.where.get(mid)
        log.info("task: %s stopped after epoch %d; its chain stops at its next batch", mid, epoch + 1)
        self.executor.client.run(
            stop_chain, key, workers=[where] if where else None, wait=False, on_error="ignore"
        )

    # -- models in ----------------------------------------------------------------------------

    def admit(self) -> None:
        """Start models while there are slots (or the admission says so): the waiting ones first,
        then the controller's; in batches, only once the previous batch is done."""
        if self.executor.batches and self.active:
            return
        while True:
            if not self.waiting and not self.active:
                # ask before admitting: with nothing active, admission may open a new round
                # of workers, which only a model to start should do
                self.waiting.extend(self.controller.new_models(1))
                if not self.waiting:
                    return
            if not self.executor.may_start(len(self.active)):
                return
            spec = self.waiting.pop(0) if self.waiting else next(iter(self.controller.new_models(1)), None)
            if spec is None:
                return
            if self.executor.admission is not None:
                self.executor.admission.started()
            self.start(spec)

    def start(self, spec: ModelSpec) -> None:
        """Take a model in: from its checkpoint when it has one (a restarted coordinator's retried
        trial, its finished epochs handed to the controller again), then its next chain."""
        mid = spec.model_id
        self.specs[mid], self.outcomes[mid] = spec, ModelOutcome(spec)
        self.executor.started_at[mid] = time.time()
        self.started[mid] = max(self.started.values(), default=-1) + 1
        self.told[mid], keep = -1, True
        self.early.pop(mid, None)
        self.stop_after.pop(mid, None)
        try:
            found = self.executor.load_checkpoint(mid)
        except StateFormatError as exc:  # a damaged or tampered checkpoint: never loaded
            self.fail(mid, f"{type(exc).__name__}: {exc}")
            return
        if found is not None:
            state, meta = found
            stopped_mid_epoch = partial_meta(state) is not None
            epoch = int(meta.get("epoch", -1)) + (0 if stopped_mid_epoch else 1)
            self.states[mid], self.next_epoch[mid], self.told[mid] = state, epoch, epoch - 1
            self.executor.resumed[mid] = {"epoch": epoch - 1, "step": global_step(state)}
            log.info(
                "task: %s resumes at epoch %d (step %d) from its checkpoint",
                mid,
                epoch + 1,
                global_step(state),
            )
            keep = self.executor.replay_history(self.outcomes[mid], epoch - 1, self.controller)
            heard = [r.epoch for r in self.outcomes[mid].history]  # an attempt cut off before telling one
            if report := unheard_epoch(mid, meta, epoch - 1, max(heard, default=-1)):
                keep = self.executor.report_epoch(self.outcomes[mid], report, self.controller) and keep
        self.active.add(mid)
        if keep and self.next_epoch.get(mid, 0) < self.epochs:
            self.submit(mid)
        else:
            self.finish(mid, stopped_early=not keep)

    def submit(self, mid: str) -> None:
        """Submit the model's next chain; while a worker given a spot notice is still connected,
        it waits (:meth:`submit_deferred`) so that it does not land on that worker. (Restricting
        it to the other workers instead can strand it: when those die too, Dask keeps a task
        restricted to workers that are gone unrunnable, even with loose restrictions.)"""
        if self._leaving_still_here():
            self.deferred.setdefault(mid, time.monotonic() + LEAVE_WAIT_S)
            return
        self._submit_now(mid)

    def _leaving_still_here(self) -> bool:
        if not self.leaving:
            return False
        self.leaving &= set(cluster_workers(self.executor.client))  # the gone ones are forgotten
        return bool(self.leaving)

    def submit_deferred(self) -> None:
        """Submit the deferred chains once the leaving workers are gone (or waited long enough)."""
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
        if self.to_the_end:
            count = self.epochs - epoch
        else:  # in batches every epoch waits for its batch before the controller hears it: one per task
            count = (
                1 if self.executor.batches else epochs_before_decision(self.controller, epoch, self.epochs)
            )
        state = self.states.get(mid)  # None: the worker builds the model's seeded first state
        decisions = [e for e in range(epoch, epoch + count - 1) if decides_after(self.controller, e)]
        executor = self.executor
        chain = (spec, state, executor.data, executor.shards, epoch, count, self.epochs, self.run_id)
        future = executor.client.submit(
            train_chain,
            *chain,
            executor.staged_folder(mid),
            decisions,
            executor.hear_every_s,
            pure=False,
            key=f"task-{mid}-e{epoch}-{count}-{time.monotonic_ns()}",
            resources=spec.device.resources() or None,
        )
        self.in_flight[future] = mid
        self.chains[mid] = (str(future.key), epoch + count - 1)
        future.add_done_callback(lambda done: self.inbox.put(("done", done)))

    # -- chains back ----------------------------------------------------------------------------

    def collect(self, future: Any) -> None:
        """Take in one finished chain: its epochs to the controller, then the model's next chain
        or its end."""
        mid = self.in_flight.pop(future)
        self.chains.pop(mid, None)
        epoch = self.next_epoch.get(mid, 0)
        try:
            state, records = future.result()
        except ChainStopped as exc:  # told to stop: the epochs it finished, up to the decision
            log.info(
                "task: %s's chain stopped; %.3f s trained past its last epoch dropped", mid, exc.dropped_s
            )
            for record in exc.records:
                self.take_epoch(mid, record)
            if mid in self.stop_after:
                self.end_stopped(mid)
            else:  # its task was cancelled under it, not by this run: it goes on from its checkpoint
                self.go_on_from_checkpoint(mid)
            return
        except UnitPreempted as exc:  # a spot notice: the epoch goes on from its batch elsewhere
            # an attempt on a worker killed before this one is work redone too
            account_killed(self, mid, epoch, future)
            take_preempted(self, mid, epoch, exc)
            return
        except Exception as exc:
            raise_if_cluster_lost(exc, self.executor.client)  # the cluster's loss: no trial fails for it
            log.warning("task: %s failed at epoch %d: %s", mid, self.told.get(mid, -1) + 2, exc)
            self.fail(mid, f"{type(exc).__name__}: {exc}")
            return
        finally:  # the result is here now: the worker need not keep it (nor hand it off)
            future.release()
        if account_killed(self, mid, epoch, future):  # Dask ran the chain again, from its newest state
            where = records[-1].get("resumed_from") or {
                "epoch": epoch - 1,
                "step": global_step(self.states.get(mid)),
            }
            self.executor.resumed[mid] = dict(where)
        *inside, last = records
        for record in inside:  # those not heard yet (a staged state made the checkpoint where one was kept)
            self.take_epoch(mid, record)
        if int(last["epoch"]) > self.stop_after.get(mid, int(last["epoch"])):  # it ran past a stop
            self.end_stopped(mid)
            return
        self.states[mid] = state
        self.executor.save_checkpoint(mid, state)
        self.next_epoch[mid] = int(last["epoch"]) + 1
        if self.executor.batches:
            self.held[mid] = last  # handed over with the rest of its batch (:meth:`release`)
        else:
            self.advance(mid, last)

    def advance(self, mid: str, last: dict[str, Any]) -> None:
        """Hand a chain's last epoch to the controller (its state is the checkpoint already),
        then submit the model's next chain or end it."""
        self.take_epoch(mid, last, staged=False)
        keep = mid not in self.stop_after
        if keep and self.next_epoch[mid] < self.epochs:
            if stopping.stop_requested():  # the run stops: the next chain starts on resume
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
            self.advance(mid, held[mid])

    def end_stopped(self, mid: str) -> None:
        """End a model the controller stopped while its chain trained on: its state is its
        checkpoint, which ends at the epoch it was stopped after (what the chain trained past
        that epoch is dropped)."""
        found = self.executor.load_checkpoint(mid)
        if found is not None:
            self.states[mid] = found[0]
        self.finish(mid, stopped_early=True)

    def go_on_from_checkpoint(self, mid: str) -> None:
        """Submit the model's next chain from its checkpoint (the last epoch told, or the batch a
        notice stopped it at)."""
        found = self.executor.load_checkpoint(mid)
        if found is not None:
            state, meta = found
            within = partial_meta(state) is not None  # the epoch it stopped in goes on
            self.states[mid], self.next_epoch[mid] = state, int(meta.get("epoch", -1)) + (0 if within else 1)
        if not stopping.stop_requested():  # the run stops: the next chain starts on resume
            self.submit(mid)

    def fail(self, mid: str, error: str) -> None:
        self.outcomes[mid].error = error
        self.finish(mid, stopped_early=False)

    def finish(self, mid: str, stopped_early: bool) -> None:
        """The model is done: its outcome to the controller (which may add a model in its slot)."""
        self.active.discard(mid)
        self.executor.drop_staged(mid)
        outcome = self.outcomes[mid]
        outcome.stopped_early = stopped_early
        outcome.state = self.states.get(mid)
        outcome.checkpoint_uri = self.executor.kept_checkpoint(mid)
        self.controller.on_model_done(outcome)
