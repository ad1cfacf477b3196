"""Model Hopper Parallelism on Dask: partitions stay on their workers, model states hop."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from training.executors.scheduler import MopScheduler, Unit, round_robin
from training.executors.units import DataRef, ModelSpec, evaluate_state, init_state, read_meta, train_pass

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
        self, client: Any, data: DataRef, shard_names: Sequence[str], checkpoint_root: str = "", seed: int = 0
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.seed = seed
        workers = sorted(client.scheduler_info()["workers"])
        self.partitions = partition_shards(shard_names, len(workers))
        self.scheduler = MopScheduler(round_robin(self.partitions, workers), seed=seed)
        self.epoch_records: dict[int, list[dict[str, Any]]] = {}

    def _alive(self) -> list[str]:
        return sorted(self.client.scheduler_info()["workers"])

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        from distributed import wait

        controller = controller or TrainAll()
        outcomes = {m.model_id: ModelOutcome(m) for m in models}
        states: dict[str, bytes] = {}
        visited: dict[str, list[str]] = {}
        start_epoch: dict[str, int] = {}
        for spec in models:
            self._restore(spec, states, visited, start_epoch)
        active = {m.model_id: m for m in models}
        for epoch in range(epochs):
            runnable = [mid for mid in active if start_epoch.get(mid, 0) <= epoch]
            if not runnable:
                continue
            self.scheduler.start_epoch(runnable)
            for mid in runnable:  # resume mid-epoch: partitions already visited are skipped
                done = set(visited.get(mid, [])) if start_epoch.get(mid, 0) == epoch else set()
                self.scheduler.queue = [
                    u for u in self.scheduler.queue if not (u.model == mid and u.partition in done)
                ]
            records: list[dict[str, Any]] = []
            in_flight: dict[Any, tuple[str, Unit]] = {}
            epoch_started = time.monotonic()
            total_units = len(self.scheduler.queue)
            while not self.scheduler.epoch_finished:
                idle = [w for w in self._alive() if w not in self.scheduler.running]
                for worker, unit in self.scheduler.assign(idle):
                    spec = active[unit.model]
                    seen = visited.get(unit.model, []) if start_epoch.get(unit.model, 0) == epoch else []
                    future = self.client.submit(
                        train_pass,
                        spec,
                        states.get(unit.model) or init_state(spec, self.data),
                        self.data,
                        self.partitions[unit.partition],
                        epoch,
                        epochs,
                        int(unit.partition[1:]),
                        {"visited": [*seen, unit.partition]},
                        workers=[worker],
                        allow_other_workers=False,
                        pure=False,
                        key=f"mop-{unit.model}-e{epoch}-{unit.partition}-{time.monotonic_ns()}",
                    )
                    in_flight[future] = (worker, unit)
                    log.info(
                        "mop: epoch %d: %s on %s runs on %s", epoch + 1, unit.model, unit.partition, worker
                    )
                if not in_flight:
                    time.sleep(0.05)
                    continue
                done, _ = wait(list(in_flight), return_when="FIRST_COMPLETED")
                for future in done:
                    worker, unit = in_flight.pop(future)
                    try:
                        state, record = future.result()
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
                    visited[unit.model] = read_meta(state).get("visited", [])
                    start_epoch[unit.model] = epoch
                    record |= {"worker": worker, "partition": unit.partition}
                    records.append(record)
                    self.save_checkpoint(unit.model, state)
                    log.info(
                        "mop: epoch %d: %s finished %s on %s in %.2fs (%d/%d units)",
                        epoch + 1,
                        unit.model,
                        unit.partition,
                        worker,
                        record["end"] - record["start"],
                        len(records),
                        total_units,
                    )
            self.records += records
            self.epoch_records[epoch] = records
            log.info("mop: epoch %d done in %.1fs", epoch + 1, time.monotonic() - epoch_started)
            self._end_epoch(
                epoch, epochs, active, states, visited, start_epoch, outcomes, controller, records
            )
        for mid, state in states.items():
            outcomes[mid].state = state
            outcomes[mid].checkpoint_uri = self.checkpoint_uri(mid) if self.checkpoint_root else None
        return outcomes

    def _restore(
        self,
        spec: ModelSpec,
        states: dict[str, bytes],
        visited: dict[str, list[str]],
        start_epoch: dict[str, int],
    ) -> None:
        found = self.load_checkpoint(spec.model_id)
        if found is None:
            return
        state, meta = found
        states[spec.model_id] = state
        epoch = int(meta.get("epoch", -1))
        seen = list(meta.get("visited", []))
        if len(seen) >= len(self.partitions):  # that epoch was complete
            start_epoch[spec.model_id], visited[spec.model_id] = epoch + 1, []
        else:
            start_epoch[spec.model_id], visited[spec.model_id] = epoch, seen
        log.info(
            "mop: %s resumes at epoch %d from its checkpoint", spec.model_id, start_epoch[spec.model_id] + 1
        )

    def _end_epoch(
        self,
        epoch: int,
        epochs: int,
        active: dict[str, ModelSpec],
        states: dict[str, bytes],
        visited: dict[str, list[str]],
        start_epoch: dict[str, int],
        outcomes: dict[str, ModelOutcome],
        controller: Controller,
        records: list[dict[str, Any]],
    ) -> None:
        """Validate every model that finished this epoch; the controller may stop or add models."""
        finished = [mid for mid in active if start_epoch.get(mid, -1) == epoch and mid in states]
        futures = {
            mid: self.client.submit(evaluate_state, active[mid], states[mid], self.data, pure=False)
            for mid in finished
        }
        for mid, future in futures.items():
            losses = [r["train_loss"] for r in records if r["model"] == mid]
            report = EpochReport(
                mid, epoch, float(future.result()), float(losses[-1]) if losses else float("nan")
            )
            outcomes[mid].history.append(report)
            start_epoch[mid], visited[mid] = epoch + 1, []
            keep = controller.on_epoch_end(report)
            log.info(
                "mop: epoch %d: %s val_acc=%.4f%s",
                epoch + 1,
                mid,
                report.val_acc,
                "" if keep else " (stopped)",
            )
            if not keep:
                outcomes[mid].stopped_early = True
                outcomes[mid].state = states[mid]
                del active[mid]
        if epoch + 1 < epochs:
            for spec in controller.new_models(max(0, len(self.partitions) - len(active))):
                active[spec.model_id] = spec
                outcomes[spec.model_id] = ModelOutcome(spec)
                start_epoch[spec.model_id] = epoch + 1
                log.info("mop: %s joins at epoch %d", spec.model_id, epoch + 2)
