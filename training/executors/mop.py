"""Model Hopper Parallelism on Dask: partitions stay on their workers, model states hop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from training.executors.scheduler import MopScheduler, Unit, round_robin
from training.executors.units import (
    DataRef,
    ModelSpec,
    evaluate_state,
    init_state,
    read_meta,
    train_pass_and_validate,
)

log = logging.getLogger(__name__)


def partition_shards(shard_names: Sequence[str], n_partitions: int) -> dict[str, list[str]]:
    """Group the training shards into one partition per worker (the data is partitioned once)."""
    n = max(1, min(n_partitions, len(shard_names)))
    groups: dict[str, list[str]] = {f"p{i}": [] for i in range(n)}
    for i, name in enumerate(sorted(shard_names)):
        groups[f"p{i % n}"].append(name)
    return groups


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
        self.before_round = before_round  # e.g. scale the cluster to n_j workers (training/scaling.py)
        self.scheduler = MopScheduler(round_robin(self.partitions, workers), seed=seed)
        # Model slots: models training at once (at least one per partition keeps every worker busy).
        self.slots = slots or len(self.partitions)
        self.epoch_records: dict[int, list[dict[str, Any]]] = {}

    def _alive(self) -> list[str]:
        return sorted(self.client.scheduler_info()["workers"])

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        """Rounds of MOP epochs: in each round every active model visits every partition once.

        A model trains ``epochs`` epochs whenever it joined; models added by the controller
        join at the next round, in the slots that stopped or finished models freed.
        """
        from distributed import wait

        controller = controller or TrainAll()
        outcomes = {m.model_id: ModelOutcome(m) for m in models}
        states: dict[str, bytes] = {}
        visited: dict[str, list[str]] = {}
        next_epoch: dict[str, int] = {}
        for spec in models:
            self._restore(spec, states, visited, next_epoch)
        active = {m.model_id: m for m in models if next_epoch.get(m.model_id, 0) < epochs}
        round_index = 0
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
            while not self.scheduler.epoch_finished:
                idle = [w for w in self._alive() if w not in self.scheduler.running]
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
                        {"visited": seen},
                        len(set(seen)) >= len(self.partitions),  # the epoch's last unit validates
                        workers=[worker],
                        allow_other_workers=False,
                        pure=False,
                        key=f"mop-{unit.model}-e{epoch}-{unit.partition}-{time.monotonic_ns()}",
                    )
                    in_flight[future] = (worker, unit)
                    log.info(
                        "mop: round %d: %s (epoch %d) on %s runs on %s",
                        round_index + 1,
                        unit.model,
                        epoch + 1,
                        unit.partition,
                        worker,
                    )
                if not in_flight:
                    time.sleep(0.05)
                    continue
                done_futures, _ = wait(list(in_flight), return_when="FIRST_COMPLETED")
                for future in done_futures:
                    worker, unit = in_flight.pop(future)
                    try:
                        state, record, val_acc = future.result()
                    except (
                        FloatingPointError
                    ) as exc:  # NonFiniteLossError: the model fails, the sweep goes on
                        self.scheduler.complete(worker)
                        self.scheduler.drop_model(unit.model)
                        outcomes[unit.model].error = f"{type(exc).__name__}: {exc}"
                        states.pop(unit.model, None)
                        active.pop(unit.model, None)
                        log.warning("mop: %s failed on %s: %s", unit.model, unit.partition, exc)
                        continue
                    except Exception as exc:
                        log.warning(
                            "mop: unit %s on %s was lost (%s); it goes back to the queue", unit, worker, exc
                        )
                        self.scheduler.lose_worker(
                            worker, [w for w in self._alive() if w != worker] or self._alive()
                        )
                        continue
                    self.scheduler.complete(worker)
                    states[unit.model] = state
                    visited[unit.model] = list(read_meta(state).get("visited", []))
                    if val_acc is not None:
                        val_accs[unit.model] = val_acc
                    record |= {"worker": worker, "partition": unit.partition, "round": round_index}
                    records.append(record)
                    self.save_checkpoint(unit.model, state)
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
            mid: self.client.submit(evaluate_state, active[mid], states[mid], self.data, pure=False)
            for mid in finished
            if mid not in val_accs
        }
        for mid in finished:
            epoch = next_epoch.get(mid, 0)
            losses = [r["train_loss"] for r in records if r["model"] == mid]
            val_acc = val_accs[mid] if mid in val_accs else float(missing[mid].result())
            report = EpochReport(mid, epoch, val_acc, float(losses[-1]) if losses else float("nan"))
            outcomes[mid].history.append(report)
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
                del active[mid]
        for spec in controller.new_models(max(0, self.slots - len(active))):
            active[spec.model_id] = spec
            outcomes[spec.model_id] = ModelOutcome(spec)
            next_epoch[spec.model_id] = 0
            log.info("mop: %s joins at the next round", spec.model_id)
