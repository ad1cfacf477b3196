"""Model Hopper Parallelism on Dask: partitions stay on their workers, model states hop.

The driver: rounds of MOP epochs, each a queue of (model, partition) units
(``training/executors/scheduler.py``) given to idle workers and collected as they finish. A round
holds the epochs up to the controller's next possible decision on any of its models (one epoch
under a pruner that may stop a model after any epoch): within it a model goes on to its next
epoch as soon as its own is done, and that epoch is reported then; the round's last epochs are
reported at its end, in model order, where the controller may stop models and fill their slots.
Each busy worker also holds a unit queued behind its running one, so it never waits for the
coordinator between two units, and a worker the round has no more units for starts a model's
next epoch, or a successor trial's first, ahead of the round's decisions
(``training/executors/mop_lookahead.py``). A unit is
not a Dask task: it is a direct call to the worker's resident trainer
(``training/executors/mop_service.py``), which runs its units one at a time. The models'
bookkeeping is ``training/executors/mop_models.py``; following the workers of a volatile cluster,
``training/executors/mop_workers.py``; where the partitions live,
``training/executors/mop_partitions.py``.

Volatile workers: a unit whose worker got a spot notice (SIGTERM) hands back its state packed at
the last batch boundary (``UnitPreempted``); it is queued again as its model's next unit and
continues from that batch on another (or the restarted) worker. A unit whose worker died without
notice (SIGKILL) fails its call as its connection closes, or is seen missing within ``POLL_S``
(+ ``REAP_GRACE_S``), and is redone from the model's last finished unit: at most that sub-epoch
is lost. ``redone_unit_seconds`` sums the seconds to redo; ``interruptions`` lists each.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mopflow.base import stopping
from mopflow.training.data import load_manifest
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, Executor, ModelOutcome
from mopflow.training.executors.mop_lookahead import Lookahead, Speculative
from mopflow.training.executors.mop_models import MopModels
from mopflow.training.executors.mop_partitions import (
    cluster_size,
    eligible_workers,
    partition_rows,
    partition_shards,
)
from mopflow.training.executors.mop_service import UnitCalls
from mopflow.training.executors.mop_workers import MEMBERSHIP_S, WorkerWatch, fetch_unit_result
from mopflow.training.executors.scheduler import MopScheduler, Unit, round_robin
from mopflow.training.executors.stop_notice import StopNotice
from mopflow.training.trainable.schedule import steps_per_epoch
from mopflow.training.trainable.state import partial_meta
from mopflow.training.trainable.unit import ModelSpec
from mopflow.training.volatile.preempt import UnitPreempted

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the coordinator looks for workers that died while running a unit
CHECKPOINT_EVERY_S = 10.0  # a model's state is checkpointed at its epochs' ends and at least this often


@dataclass
class _Round:
    """One round of MOP epochs in progress: its units in flight and what the finished ones did."""

    index: int  # its first epoch's, from 0, over every run of the executor
    total_units: int
    epochs: int = 1  # epochs in the round: up to the controller's next decision on any model
    started: float = field(default_factory=time.monotonic)
    in_flight: dict[Any, tuple[str, Unit]] = field(default_factory=dict)  # future -> (worker, unit)
    submitted: dict[Any, float] = field(default_factory=dict)  # future -> when (wall clock)
    records: list[dict[str, Any]] = field(default_factory=list)  # one per finished unit
    val_accs: dict[str, float] = field(default_factory=dict)  # measured by a model's epoch's last unit
    ended: set[str] = field(default_factory=set)  # models whose epoch ended before the round's last


class MopExecutor(Executor):
    """Each model trains one sub-epoch per partition, on the worker that holds it, then hops.

    Rounds of MOP epochs: in each round every active model visits every partition once. A model
    trains ``epochs`` epochs whenever it joined; models added by the controller join at the next
    round, in the slots that stopped or finished models freed.
    """

    name = "mop"
    stops_on_its_own = True  # a stop lets the units in flight checkpoint first

    def __init__(
        self,
        client: Any,
        data: DataRef,
        shard_names: Sequence[str],
        checkpoint_root: str = "",
        seed: int = 0,
        slots: int | None = None,
        partitions: int | None = None,
        before_round: Callable[[int], int] | None = None,
        schedule: str = "fixed",
        lookahead: bool = True,
        ask_ahead: bool = True,
        resources: Mapping[str, float] | None = None,
        checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.seed = seed
        # the Dask resources a unit needs (a GPU): only the workers that declare them hold partitions
        self.resources = dict(resources or {})
        workers = eligible_workers(client, self.resources)
        size = len(workers) if self.resources else cluster_size(client, workers)  # the spec counts all
        self.partitions = partition_shards(shard_names, partitions or size)
        manifest = load_manifest(data.manifest_uri, data.storage_options)
        self.partition_rows = partition_rows(manifest, self.partitions)
        self.before_round = before_round  # e.g. scale the cluster to n_j workers (training/search/scaling.py)
        # "fixed": each round's plan is a function of the seed and the round (scheduler.py)
        self.scheduler = MopScheduler(round_robin(self.partitions, workers), seed=seed, schedule=schedule)
        # Model slots: models training at once (at least one per partition keeps every worker busy).
        self.slots = slots or len(self.partitions)
        self.epoch_records: dict[int, list[dict[str, Any]]] = {}
        self.checkpoint_every_s = checkpoint_every_s  # within an epoch; its end is always checkpointed
        self.workers = WorkerWatch(client, self.scheduler, self._account, self.resources)
        self._notice = StopNotice(client, "mop", "unit")  # asked to stop: units in flight checkpoint
        self.units = UnitCalls(client)  # each worker's resident trainer (mop_service.py)
        # next epochs started ahead of the round's decisions (none while the cluster is rescaled
        # between rounds: the next round's placement is not known yet)
        self.lookahead = Lookahead() if lookahead and before_round is None else None
        self.ask_ahead = ask_ahead and self.lookahead is not None  # successors asked at a cohort's last round

    def epoch_steps(self, spec: ModelSpec) -> int:
        """A model's optimizer steps in one epoch over every partition (its schedule's unit)."""
        return steps_per_epoch(self.partition_rows.values(), int(spec.params["batch_size"]))

    def _train(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        run = MopModels(self, epochs, controller, asks_ahead=self.ask_ahead)
        for spec in models:
            run.admit(spec)
        round_index = len(self.epoch_records)  # a second run (more trials) goes on numbering rounds
        while run.active:
            current = self._start_round(round_index, run)
            self._run_round(run, current)
            run.tell_done()  # before this round's reports and asks, whatever the timings
            run.ask_ahead()
            self.records += current.records
            for record in current.records:  # per epoch of the round (MOP's invariants hold per epoch)
                self.epoch_records.setdefault(int(record["round"]), []).append(record)
            log.info(
                "mop: round %d (%d epoch(s)) done in %.1fs",
                round_index + 1,
                current.epochs,
                time.monotonic() - current.started,
            )
            run.end_round(current.records, current.val_accs)
            round_index += current.epochs
        run.tell_done()  # the last round's
        if self.lookahead is not None:
            self._drop(self.lookahead.drop_all())
            log.info(
                "mop: %d unit(s) started ahead of their round, %d dropped",
                self.lookahead.adopted + self.lookahead.dropped,
                self.lookahead.dropped,
            )
        return run.final_outcomes()

    def _start_round(self, index: int, run: MopModels) -> _Round:
        """Queue the round's units: every active model on every partition it has not visited, for
        each epoch up to the controller's next possible decision on any of them (no model waits
        for the others between two epochs that no decision separates)."""
        epochs = run.epochs_before_decision()
        if self.before_round is not None:  # the cluster may change size between rounds (of one epoch)
            epochs = 1
            self.before_round(index)
            self.scheduler.placement = round_robin(self.partitions, self.workers.alive())
        self.scheduler.start_epoch(list(run.active), epoch=index, epochs=epochs)
        run.start_round(epochs)  # the finishing models' successors are due
        done = {mid: set(run.visited.get(mid, [])) for mid in run.active}  # resumed mid-epoch: skipped
        self.scheduler.queue = [
            u for u in self.scheduler.queue if not (u.epoch == 0 and u.partition in done[u.model])
        ]
        current = _Round(index, total_units=len(self.scheduler.queue), epochs=epochs)
        if self.lookahead is not None:  # the units started ahead that this round takes as its own
            adopted, dropped = self.lookahead.take(run, self.scheduler, self.workers.alive())
            self._drop(dropped)
            for future, early in adopted:
                current.in_flight[future] = (early.worker, early.unit)
                current.submitted[future] = early.sent
        return current

    def _drop(self, tokens: dict[str, list[str]]) -> None:
        """Tell workers to drop the units started ahead that no round takes (``mop_lookahead.py``)."""
        for worker, dropped in tokens.items():
            self.units.drop(worker, dropped)

    def _run_round(self, run: MopModels, current: _Round) -> None:
        """Give idle workers units and collect the finished ones until the round's queue is done,
        following the workers that leave or join meanwhile."""
        while not self.scheduler.epoch_finished:
            if stopping.stop_requested():  # the units in flight checkpoint at their next batch
                self._stop_units(current.in_flight)
            connected = self.workers.connected(max_age_s=MEMBERSHIP_S)
            alive = self.workers.reconcile(connected)
            if not stopping.stop_requested():
                self._submit_ready(run, current, alive)
            if self.lookahead is None or self.lookahead.driver_may_pause(self.scheduler, alive):
                run.tell_done(at_most=1)  # the last round's finished models, told while workers train
            run.ask_ahead(at_most=1)  # then this round's finishing models' successors
            if not current.in_flight:
                self.workers.wait_for_a_worker(alive)
                time.sleep(0.05)
                continue
            early = self.lookahead.running() if self.lookahead is not None else []
            done, _ = concurrent.futures.wait(  # a unit started ahead frees a worker's place too
                [*current.in_flight, *early], timeout=POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
            self.workers.reap_dead(current.in_flight, current.submitted, connected)
            collected = [self._collect(run, current, future) for future in done]
            finished = [mid for mid in collected if mid is not None]  # their pass completed
            ended = [mid for mid in finished if mid in current.ended]
            for mid in ended:  # checkpointed before it is reported: a report never runs ahead of it
                self.save_checkpoint(mid, run.states[mid])
                run.end_epoch(mid, current.val_accs.pop(mid, None), current.records)
                if mid not in run.active:  # stopped all the same (e.g. the search's goal)
                    self.scheduler.drop_model(mid)
            current.ended.clear()
            if finished and not stopping.stop_requested():  # the freed workers get their next units first
                # the membership read at the top of this turn: asking the scheduler again costs
                # the coordinator a round trip per unit, and a worker lost since then holds no
                # partition any more (its units and partitions moved as it was seen lost)
                self._submit_ready(run, current, self.workers.alive(connected))
            for mid in finished:
                if mid not in ended and run.checkpoint_due(mid, self.checkpoint_every_s):
                    self.save_checkpoint(mid, run.states[mid])

    def _submit_ready(self, run: MopModels, current: _Round, alive: list[str]) -> None:
        """Give every idle worker a unit (the randomized rule), and every busy one a unit ahead,
        and submit them."""
        idle = [w for w in alive if w not in self.scheduler.running]
        # then one unit queued behind each running one: the worker goes on without a round trip
        given = self.scheduler.assign(idle) + self.scheduler.assign_ahead(alive)
        self._start_ahead(run, alive)
        for worker, unit in given:
            future = self._submit_unit(run, worker, unit)
            current.in_flight[future] = (worker, unit)
            current.submitted[future] = time.time()
            log.info(
                "mop: round %d: %s (epoch %d) on %s runs on %s",
                current.index + 1,
                unit.model,
                run.next_epoch.get(unit.model, 0) + 1,
                unit.partition,
                worker,
            )

    def _start_ahead(self, run: MopModels, alive: list[str]) -> None:
        """Send the workers the round has no more units for the first units of models' next
        epochs, ahead of the round's decisions (``mop_lookahead.py``)."""
        if self.lookahead is None:
            return
        for worker, unit, epoch in self.lookahead.offers(run, self.scheduler, alive):
            token = f"{unit.model}:{unit.partition}:e{epoch}:{uuid.uuid4().hex[:12]}"
            future = self._submit_unit(run, worker, unit, epoch=epoch, visited=[], token=token)
            early = Speculative(worker, unit, epoch, run.states.get(unit.model), token)
            self.lookahead.note_sent(future, early)
            log.info(
                "mop: %s (epoch %d) on %s starts ahead on %s", unit.model, epoch + 1, unit.partition, worker
            )

    def _submit_unit(
        self,
        run: MopModels,
        worker: str,
        unit: Unit,
        epoch: int | None = None,
        visited: list[str] | None = None,
        token: str = "",
    ) -> concurrent.futures.Future[Any]:
        """Send ``unit`` to ``worker`` (which holds its partition): a pass, then validation
        when it is the model's epoch's last unit. The worker's resident trainer runs its units
        one at a time, in order (``mop_service.py``). ``epoch`` and ``visited``: a unit of the
        model's next epoch, started ahead (default: where the model stands); ``token``: its name
        for a drop."""
        spec = run.spec_of(unit.model)
        seen = [*(run.visited.get(unit.model, []) if visited is None else visited), unit.partition]
        return self.units.call(
            worker,
            (
                spec,
                run.states.get(unit.model),  # None: the worker builds the model's seeded first state
                self.data,
                self.partitions[unit.partition],
                run.next_epoch.get(unit.model, 0) if epoch is None else epoch,
                run.epochs,
                int(unit.partition[1:]),
                {"visited": seen, "partition": unit.partition},
                len(set(seen)) >= len(self.partitions),  # the epoch's last unit validates
                self.epoch_steps(spec),
            ),
            token=token,
        )

    def _collect(self, run: MopModels, current: _Round, future: Any) -> str | None:
        """Take in one finished unit; returns its model when the unit's pass completed."""
        if future not in current.in_flight:  # cancelled: its worker was lost, its unit requeued
            return None
        worker, unit = current.in_flight.pop(future)
        started_at = current.submitted.pop(future, time.time())
        try:
            state, record, val_acc = fetch_unit_result(self.client, future, worker)
        except UnitPreempted as exc:  # a spot notice: continue from its batch elsewhere
            self._preempted(run, current, unit, worker, exc)
            return None
        except FloatingPointError as exc:  # NonFiniteLossError: the model fails, the sweep goes on
            self.scheduler.complete(worker, unit)
            self.scheduler.drop_model(unit.model)
            log.warning("mop: %s failed on %s: %s", unit.model, unit.partition, exc)
            run.fail(unit.model, f"{type(exc).__name__}: {exc}")
            return None
        except Exception as exc:
            log.warning("mop: unit %s on %s was lost (%s); it goes back to the queue", unit, worker, exc)
            self._account(unit, worker, "lost", self.workers.lost_seconds(started_at))
            if isinstance(exc, OSError):  # its worker cannot be reached: killed, or closing
                self.workers.unreachable(worker)
            self.workers.lose(worker, current.in_flight, unit=unit)
            return None
        self._started_next(current, worker)
        self.scheduler.complete(worker, unit)
        run.unit_done(unit.model, state)
        if val_acc is not None:
            current.val_accs[unit.model] = val_acc
        record |= {"worker": worker, "partition": unit.partition, "round": current.index + unit.epoch}
        current.records.append(record)
        if unit.epoch < current.epochs - 1 and run.epoch_complete(unit.model):
            current.ended.add(unit.model)  # reported now, not at the round's end
        seconds = float(record["end"]) - float(record["start"])
        self.scheduler.record_cost(unit.model, seconds)
        log.info(
            "mop: round %d: %s finished %s on %s in %.2fs (%d/%d units)",
            current.index + 1,
            unit.model,
            unit.partition,
            worker,
            seconds,
            len(current.records),
            current.total_units,
        )
        return unit.model

    @staticmethod
    def _started_next(current: _Round, worker: str) -> None:
        """The unit queued behind the one ``worker`` just finished starts now: the seconds it
        would lose count from here, not from when it was sent."""
        now = time.time()
        for future, (holder, _) in current.in_flight.items():
            if holder == worker:
                current.submitted[future] = max(current.submitted.get(future, now), now)

    def _preempted(
        self, run: MopModels, current: _Round, unit: Unit, worker: str, exc: UnitPreempted
    ) -> None:
        """A unit stopped by a spot notice: its state is checkpointed, and the unit goes on from
        that batch on another worker (or waits in its checkpoint when the run stops). A unit ahead
        handed back untouched goes back to the queue; its worker's running unit tells the rest."""
        if self.scheduler.ahead.get(worker) == unit:
            self.scheduler.requeue(worker, unit=unit)
            return
        if exc.state is not None:
            run.states[unit.model] = exc.state
            self.save_checkpoint(unit.model, exc.state)
        if stopping.stop_requested():  # the run stops: the unit waits in its checkpoint
            return
        redone = max(0.0, float(exc.record["end"]) - float(exc.record["saved_at"]))
        self._account(unit, worker, "notice", redone, batches=exc.record.get("batches", 0))
        self.workers.leaving.add(worker)
        self.workers.lose(worker, current.in_flight, saved=partial_meta(exc.state) is not None)

    def _stop_units(self, in_flight: dict[Any, tuple[str, Unit]]) -> None:
        """Asked to stop: give the workers the notice once (their units save their state at the
        next batch and come back); once none is in flight, withdraw it and stop."""
        self._notice.give(len(in_flight))
        if not in_flight:
            self._notice.withdraw()
            stopping.raise_if_stopped()

    def _account(self, unit: Unit, worker: str, kind: str, redone: float, **extra: Any) -> None:
        """Record the work a unit lost (a notice, a lost result or a killed worker)."""
        self.record_interruption(
            redone, model=unit.model, partition=unit.partition, worker=worker, kind=kind, **extra
        )
        log.warning(
            "mop: %s on %s interrupted (%s) on %s: %.2f unit-seconds to redo, %.2f in all",
            unit.model,
            unit.partition,
            kind,
            worker,
            redone,
            self.redone_unit_seconds,
        )
