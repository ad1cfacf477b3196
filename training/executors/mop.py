"""Model Hopper Parallelism on Dask: partitions stay on their workers, model states hop.

Volatile workers: a unit whose worker got a spot notice (SIGTERM) hands back its state packed at
the last batch boundary (``UnitPreempted``); it is queued again as its model's next unit and
continues from that batch on another (or the restarted) worker. A unit whose worker died without
notice (SIGKILL) is seen missing within ``POLL_S`` (+ ``REAP_GRACE_S``) and redone from the
model's last finished unit: at most that sub-epoch is lost. The seconds to redo are summed in
``redone_unit_seconds`` and each interruption is listed in ``interruptions``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from infra import stopping
from training.data import load_manifest
from training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from training.executors.scheduler import MopScheduler, Unit, round_robin
from training.executors.units import evaluate_state, init_state, train_pass_and_validate
from training.schedule import steps_per_epoch
from training.unit import DataRef, ModelSpec
from training.unit_state import partial_meta, read_meta
from training.volatile.preempt import (
    UnitPreempted,
    clear_notice,
    lost_spans,
    raise_notice,
    redone_seconds,
    task_story,
)

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the coordinator looks for workers that died while running a unit
REAP_GRACE_S = 2.0  # a worker missing this long with its unit unanswered died without notice
WORKER_WAIT_S = 120.0  # how long to wait for a replacement when no worker is left
FETCH_POLL_S = 5.0  # how often a unit's result being fetched checks that its worker is still there


class UnitResultLost(RuntimeError):
    """A unit finished on a worker that died before its result was fetched (the result died with it)."""


def fetch_unit_result(client: Any, future: Any, worker: str, poll_s: float = FETCH_POLL_S) -> Any:
    """The result of a unit pinned to ``worker``.

    A unit that finished on a worker killed before its result was fetched cannot be fetched any
    more, and Dask would run it again only on that (pinned) worker, which never comes back:
    waiting would hang the sweep. Raises ``UnitResultLost`` once ``worker`` has left the cluster.
    """
    while True:
        try:
            return future.result(timeout=poll_s)
        except TimeoutError:
            if worker not in client.scheduler_info()["workers"]:
                raise UnitResultLost(f"worker {worker} left before its unit's result was fetched") from None


def partition_shards(shard_names: Sequence[str], n_partitions: int) -> dict[str, list[str]]:
    """Group the training shards into one partition per worker (the data is partitioned once)."""
    n = max(1, min(n_partitions, len(shard_names)))
    groups: dict[str, list[str]] = {f"p{i}": [] for i in range(n)}
    for i, name in enumerate(sorted(shard_names)):
        groups[f"p{i % n}"].append(name)
    return groups


def partition_rows(manifest: Mapping[str, Any], partitions: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Training rows of each partition, from the manifest's shard rows."""
    rows = {e["name"]: int(e["rows"]) for e in manifest["splits"]["train"]}
    return {p: sum(rows[name] for name in names) for p, names in partitions.items()}


class MopExecutor(Executor):
    """Each model trains one sub-epoch per partition, on the worker that holds it, then hops."""

    name = "mop"

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
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.seed = seed
        workers = sorted(client.scheduler_info()["workers"])
        if not workers:  # a cluster still starting (or a worker restarting under load)
            client.wait_for_workers(1, timeout=120)
            workers = sorted(client.scheduler_info()["workers"])
        self.partitions = partition_shards(shard_names, partitions or len(workers))
        manifest = load_manifest(data.manifest_uri, data.storage_options)
        self.partition_rows = partition_rows(manifest, self.partitions)
        self.before_round = (
            before_round  # e.g. scale the cluster to n_j workers (training/volatile/scaling.py)
        )
        self.scheduler = MopScheduler(round_robin(self.partitions, workers), seed=seed)
        # Model slots: models training at once (at least one per partition keeps every worker busy).
        self.slots = slots or len(self.partitions)
        self.epoch_records: dict[int, list[dict[str, Any]]] = {}
        self.redone_unit_seconds = 0.0  # work lost with interrupted units, to be done again
        self.interruptions: list[dict[str, Any]] = []  # one per unit lost or stopped by a notice
        self._leaving: set[str] = set()  # workers that said they are being preempted
        self._missing_since: dict[str, float] = {}
        self._no_worker_since: float | None = None
        self._stopping = False  # asked to stop: the units in flight were given the notice

    def epoch_steps(self, spec: ModelSpec) -> int:
        """A model's optimizer steps in one epoch over every partition (its schedule's unit)."""
        return steps_per_epoch(self.partition_rows.values(), int(spec.params["batch_size"]))

    def _connected(self) -> set[str]:
        return set(self.client.scheduler_info()["workers"])

    def _alive(self) -> list[str]:
        """Workers that can take units (connected, not leaving on a notice)."""
        return sorted(self._connected() - self._leaving)

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        """Rounds of MOP epochs: in each round every active model visits every partition once.

        A model trains ``epochs`` epochs whenever it joined; models added by the controller
        join at the next round, in the slots that stopped or finished models freed.
        """
        with stopping.stops_cooperatively():  # a stop lets the units in flight checkpoint first
            return self._run(models, epochs, controller or TrainAll())

    def _run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        from distributed import wait

        outcomes: dict[str, ModelOutcome] = {}
        states: dict[str, bytes] = {}
        visited: dict[str, list[str]] = {}
        next_epoch: dict[str, int] = {}
        active = {
            m.model_id: m
            for m in models
            if self._admit(m, epochs, states, visited, next_epoch, outcomes, controller)
        }
        round_index = len(self.epoch_records)  # a second run (more trials) goes on numbering rounds
        while active:
            if self.before_round is not None:  # the cluster may change size between rounds
                self.before_round(round_index)
                self.scheduler.placement = round_robin(self.partitions, self._alive())
            self.scheduler.start_epoch(list(active))
            for mid in active:  # resume mid-epoch: partitions already visited are skipped
                done = set(visited.get(mid, []))
                self.scheduler.queue = [
                    u for u in self.scheduler.queue if not (u.model == mid and u.partition in done)
                ]
            records: list[dict[str, Any]] = []
            val_accs: dict[str, float] = {}  # measured by the unit that ended a model's epoch
            in_flight: dict[Any, tuple[str, Unit]] = {}
            round_started = time.monotonic()
            total_units = len(self.scheduler.queue)
            submitted: dict[Any, float] = {}

            def submit_ready(
                alive: list[str],
                in_flight: dict[Any, tuple[str, Unit]] = in_flight,
                submitted: dict[Any, float] = submitted,
                round_index: int = round_index,
            ) -> None:
                """Give every idle worker a unit (the randomized rule) and submit it."""
                idle = [w for w in alive if w not in self.scheduler.running]
                for worker, unit in self.scheduler.assign(idle):
                    spec = active[unit.model]
                    epoch = next_epoch.get(unit.model, 0)
                    seen = [*visited.get(unit.model, []), unit.partition]
                    future = self.client.submit(
                        train_pass_and_validate,
                        spec,
                        states.get(unit.model) or init_state(spec, self.data),
                        self.data,
                        self.partitions[unit.partition],
                        epoch,
                        epochs,
                        int(unit.partition[1:]),
                        {"visited": seen, "partition": unit.partition},
                        len(set(seen)) >= len(self.partitions),  # the epoch's last unit validates
                        self.epoch_steps(spec),
                        workers=[worker],
                        allow_other_workers=False,
                        resources=spec.device.resources() or None,
                        pure=False,
                        key=f"mop-{unit.model}-e{epoch}-{unit.partition}-{time.monotonic_ns()}",
                    )
                    in_flight[future] = (worker, unit)
                    submitted[future] = time.time()
                    log.info(
                        "mop: round %d: %s (epoch %d) on %s runs on %s",
                        round_index + 1,
                        unit.model,
                        epoch + 1,
                        unit.partition,
                        worker,
                    )

            while not self.scheduler.epoch_finished:
                if stopping.stop_requested():  # the units in flight checkpoint at their next batch
                    self._stop_units(in_flight)
                connected = self._connected()
                alive = self._reconcile(connected)
                if not stopping.stop_requested():
                    submit_ready(alive)
                if not in_flight:
                    self._wait_for_a_worker(alive)
                    time.sleep(0.05)
                    continue
                try:
                    done_futures, _ = wait(list(in_flight), timeout=POLL_S, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    done_futures = set()
                self._reap_dead(in_flight, submitted, connected)
                finished: list[str] = []  # models whose unit finished: checkpointed below
                for future in done_futures:
                    worker, unit = in_flight.pop(future)
                    started_at = submitted.pop(future, time.time())
                    try:
                        state, record, val_acc = fetch_unit_result(self.client, future, worker)
                    except UnitPreempted as exc:  # a spot notice: continue from its batch elsewhere
                        if exc.state is not None:
                            states[unit.model] = exc.state
                            self.save_checkpoint(unit.model, exc.state)
                        if stopping.stop_requested():  # the run stops: the unit waits in its checkpoint
                            continue
                        redone = max(0.0, float(exc.record["end"]) - float(exc.record["saved_at"]))
                        self._account(unit, worker, "notice", redone, batches=exc.record.get("batches", 0))
                        self._leaving.add(worker)
                        self._lose(worker, saved=partial_meta(exc.state) is not None)
                        continue
                    except (
                        FloatingPointError
                    ) as exc:  # NonFiniteLossError: the model fails, the sweep goes on
                        self.scheduler.complete(worker)
                        self.scheduler.drop_model(unit.model)
                        outcomes[unit.model].error = f"{type(exc).__name__}: {exc}"
                        states.pop(unit.model, None)
                        active.pop(unit.model, None)
                        log.warning("mop: %s failed on %s: %s", unit.model, unit.partition, exc)
                        controller.on_model_done(outcomes[unit.model])
                        continue
                    except Exception as exc:
                        log.warning(
                            "mop: unit %s on %s was lost (%s); it goes back to the queue", unit, worker, exc
                        )
                        self._account(unit, worker, "lost", self._lost_seconds(future, started_at))
                        self._lose(worker, saved=False)
                        continue
                    finally:  # the result is here now: the worker need not keep it (nor hand it off)
                        future.release()
                    self.scheduler.complete(worker)
                    states[unit.model] = state
                    visited[unit.model] = list(read_meta(state).get("visited", []))
                    if val_acc is not None:
                        val_accs[unit.model] = val_acc
                    record |= {"worker": worker, "partition": unit.partition, "round": round_index}
                    records.append(record)
                    self.scheduler.record_cost(unit.model, float(record["end"]) - float(record["start"]))
                    finished.append(unit.model)
                    log.info(
                        "mop: round %d: %s finished %s on %s in %.2fs (%d/%d units)",
                        round_index + 1,
                        unit.model,
                        unit.partition,
                        worker,
                        record["end"] - record["start"],
                        len(records),
                        total_units,
                    )
                if finished and not stopping.stop_requested():  # the freed workers get their next units first
                    submit_ready(self._alive())
                for mid in finished:
                    self.save_checkpoint(mid, states[mid])
            self.records += records
            self.epoch_records[round_index] = records
            log.info("mop: round %d done in %.1fs", round_index + 1, time.monotonic() - round_started)
            self._end_round(
                epochs, active, states, visited, next_epoch, outcomes, controller, records, val_accs
            )
            round_index += 1
        for mid, state in states.items():
            outcomes[mid].state = state
            outcomes[mid].checkpoint_uri = self.checkpoint_uri(mid) if self.checkpoint_root else None
        return outcomes

    def _stop_units(self, in_flight: dict[Any, tuple[str, Unit]]) -> None:
        """Asked to stop: give the workers the notice once (their units save their state at the
        next batch and come back); once none is in flight, withdraw it and stop."""
        if not self._stopping:
            self._stopping = True
            log.warning("mop: stopping; %d unit(s) in flight checkpoint at their next batch", len(in_flight))
            self.client.run(raise_notice)
        if not in_flight:
            self.client.run(clear_notice)
            self._stopping = False
            stopping.raise_if_stopped()

    def _reconcile(self, connected: set[str]) -> list[str]:
        """Follow the cluster: partitions of workers gone while idle move to survivors; a new
        (restarted) worker takes partitions from the busiest. Returns the workers that take units."""
        alive = sorted(connected - self._leaving)
        for holder in sorted(set(self.scheduler.placement.values()) - set(alive)):
            if holder not in self.scheduler.running and alive:
                self.scheduler.lose_worker(holder, alive)
        for worker in alive:
            moved = self.scheduler.add_worker(worker)
            if moved:
                log.info("mop: worker %s joined; it takes partition(s) %s", worker, ", ".join(moved))
        self._leaving &= connected  # a worker that has left is forgotten
        return alive

    def _reap_dead(
        self, in_flight: dict[Any, tuple[str, Unit]], submitted: dict[Any, float], connected: set[str]
    ) -> None:
        """Units whose worker vanished without answering (SIGKILL: no notice): cancel and requeue
        them; the model goes on from its last finished unit."""
        now = time.monotonic()
        for worker in {w for w, _ in in_flight.values()} - connected:
            self._missing_since.setdefault(worker, now)
        for future, (worker, unit) in list(in_flight.items()):
            missing = self._missing_since.get(worker)
            if worker in connected or missing is None or now - missing < REAP_GRACE_S:
                continue
            if future.done():  # its answer arrived after all: handled with the done futures
                continue
            lost = self._lost_seconds(future, submitted.pop(future, time.time()))
            future.cancel()
            del in_flight[future]
            log.warning("mop: worker %s died running %s (no notice); the unit is redone", worker, unit)
            self._account(unit, worker, "killed", lost)
            self._lose(worker, saved=False)
        self._missing_since = {w: t for w, t in self._missing_since.items() if w not in connected}

    def _lost_seconds(self, future: Any, submitted_at: float) -> float:
        """Seconds the unit ran on a worker that never finished it (from the scheduler's story;
        from its submission when the story does not tell)."""
        spans = lost_spans(task_story(self.client, str(future.key)))
        return redone_seconds(spans) if spans else max(0.0, time.time() - submitted_at)

    def _wait_for_a_worker(self, alive: list[str]) -> None:
        """Nothing runs: fail when no worker has been there for ``WORKER_WAIT_S``."""
        if alive:
            self._no_worker_since = None
            return
        now = time.monotonic()
        self._no_worker_since = self._no_worker_since or now
        if now - self._no_worker_since > WORKER_WAIT_S:
            raise RuntimeError(f"no Dask worker left to run MOP units (waited {WORKER_WAIT_S:.0f}s)")

    def _lose(self, worker: str, saved: bool) -> None:
        """Requeue ``worker``'s unit and move its partitions, waiting for a replacement if none is left."""
        if worker in self._alive():  # the unit failed but its worker is fine: requeue it in place
            self.scheduler.requeue(worker, saved)
            return
        deadline = time.monotonic() + WORKER_WAIT_S
        survivors = [w for w in self._alive() if w != worker]
        while not survivors:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Dask worker left to run MOP units (waited {WORKER_WAIT_S:.0f}s)")
            time.sleep(0.2)
            survivors = [w for w in self._alive() if w != worker]
        self.scheduler.lose_worker(worker, survivors, saved=saved)

    def _account(self, unit: Unit, worker: str, kind: str, redone: float, **extra: Any) -> None:
        self.redone_unit_seconds += redone
        self.interruptions.append(
            {
                "model": unit.model,
                "partition": unit.partition,
                "worker": worker,
                "kind": kind,
                "redone_s": redone,
                "at": time.time(),
                **extra,
            }
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

    def _restore(
        self,
        spec: ModelSpec,
        states: dict[str, bytes],
        visited: dict[str, list[str]],
        next_epoch: dict[str, int],
    ) -> None:
        found = self.load_checkpoint(spec.model_id)
        if found is None:
            return
        state, meta = found
        states[spec.model_id] = state
        epoch = int(meta.get("epoch", -1))
        seen = list(meta.get("visited", []))
        if partial_meta(state) is not None:  # stopped mid-pass on a notice: that unit comes first
            seen = [p for p in seen if p != meta.get("partition")]
            if meta.get("partition") in self.partitions:
                self.scheduler.resume[spec.model_id] = str(meta["partition"])
        if len(seen) >= len(self.partitions):  # that epoch was complete
            next_epoch[spec.model_id], visited[spec.model_id] = epoch + 1, []
        else:
            next_epoch[spec.model_id], visited[spec.model_id] = epoch, seen
        log.info(
            "mop: %s resumes at epoch %d from its checkpoint", spec.model_id, next_epoch[spec.model_id] + 1
        )

    def _end_round(
        self,
        epochs: int,
        active: dict[str, ModelSpec],
        states: dict[str, bytes],
        visited: dict[str, list[str]],
        next_epoch: dict[str, int],
        outcomes: dict[str, ModelOutcome],
        controller: Controller,
        records: list[dict[str, Any]],
        val_accs: dict[str, float],
    ) -> None:
        """Report every model that finished an epoch; the controller may stop or add models."""
        finished = [
            mid for mid in active if mid in states and len(visited.get(mid, [])) >= len(self.partitions)
        ]
        # normally validated by the epoch's last unit; a model without a figure is validated here
        missing = {
            mid: self.client.submit(
                evaluate_state,
                active[mid],
                states[mid],
                self.data,
                pure=False,
                resources=active[mid].device.resources() or None,
            )
            for mid in finished
            if mid not in val_accs
        }
        for mid in finished:
            epoch = next_epoch.get(mid, 0)
            mine = [r for r in records if r["model"] == mid]
            val_acc = val_accs[mid] if mid in val_accs else float(missing[mid].result())
            report = EpochReport(
                mid,
                epoch,
                val_acc,
                float(mine[-1]["train_loss"]) if mine else float("nan"),
                float(mine[-1]["lr_end"]) if mine else None,
            )
            outcomes[mid].history.append(report)
            self.save_history(mid, outcomes[mid].history)
            next_epoch[mid], visited[mid] = epoch + 1, []
            keep = controller.on_epoch_end(report)
            log.info(
                "mop: %s epoch %d/%d val_acc=%.4f%s",
                mid,
                epoch + 1,
                epochs,
                report.val_acc,
                "" if keep else " (stopped)",
            )
            if not keep:
                outcomes[mid].stopped_early = True
            if not keep or epoch + 1 >= epochs:
                outcomes[mid].state = states[mid]
                outcomes[mid].checkpoint_uri = self.checkpoint_uri(mid) if self.checkpoint_root else None
                del active[mid]
                controller.on_model_done(outcomes[mid])  # before its slot is filled again
        for spec in controller.new_models(max(0, self.slots - len(active))):
            if self._admit(spec, epochs, states, visited, next_epoch, outcomes, controller):
                active[spec.model_id] = spec
                log.info("mop: %s joins at the next round", spec.model_id)

    def _admit(
        self,
        spec: ModelSpec,
        epochs: int,
        states: dict[str, bytes],
        visited: dict[str, list[str]],
        next_epoch: dict[str, int],
        outcomes: dict[str, ModelOutcome],
        controller: Controller,
    ) -> bool:
        """Take a model in: from its checkpoint when it has one (a restarted coordinator's retried
        trial), its finished epochs handed to the controller again. True when it has epochs left."""
        outcome = outcomes[spec.model_id] = ModelOutcome(spec)
        self._restore(spec, states, visited, next_epoch)
        done = next_epoch.setdefault(spec.model_id, 0)
        keep = True
        for report in self.load_history(spec.model_id, done - 1) if done else []:
            outcome.history.append(report)
            keep = controller.on_epoch_end(report) and keep
        if keep and done < epochs:
            return True
        outcome.stopped_early = not keep
        outcome.state = states.get(spec.model_id)
        outcome.checkpoint_uri = self.checkpoint_uri(spec.model_id) if self.checkpoint_root else None
        controller.on_model_done(outcome)
        return False
