"""Model averaging (MA, bulk-synchronous parallel): the baseline MOP is measured against.

The data is partitioned once across the workers, as for MOP (``mopflow/training/executors/mop.py``). Each
epoch of a model, one copy of it per partition starts from the same weights and trains one pass
over its partition, all copies at once, each on the worker that holds its partition; the
coordinator then averages the copies into the model's next state, which is validated on a worker
and reported to the controller. This is the "MA" baseline of the Cerebro paper (VLDB 2020) and
what Spark MLlib-style model averaging does: one synchronization per epoch, so the copies drift
apart on their partitions between averages, and the averaged model is not the one sequential
SGD would reach. Models train one after another, each on every worker.

What is averaged: the element-wise mean of every floating-point tensor of the model's state
(parameters and buffers, BatchNorm's running statistics included); integer buffers (BatchNorm's
batch counter) and the global step take the largest copy's value. The optimizer state is reset
every epoch: each copy starts its pass with fresh AdamW moments, as the clients of federated
averaging and the workers of Spark-based MA (Elephas' synchronous mode, which rebuilds the model
for every partition) do. Averaging the moments too is a different method (an adaptive
federated optimizer), not plain MA.

The learning rate follows the same one-cycle curve as every strategy, over ``epochs x`` the steps
of one pass over the largest partition (a copy's pass is its whole epoch), so the schedule ends
with the last epoch whatever the number of partitions.

A baseline for the benchmarks, not a strategy of the search: no checkpoints, no resume, no
handling of volatile workers (a copy that fails fails its model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from baselines.sequential import OneModelAtATime
from mopflow.training.compute.workers import joined_worker_addresses
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, ModelOutcome
from mopflow.training.executors.units import evaluate_state, init_state, train_pass
from mopflow.training.trainable.schedule import steps_per_epoch
from mopflow.training.trainable.state import read_meta
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the packed state's weights (training/trainable/state.py)
CARRIED_META = ("model_id", "epoch")  # what the averaged state keeps of a copy's metadata


def average_states(states: Sequence[bytes], meta: Mapping[str, Any] | None = None) -> bytes:
    """One packed state from copies of the same model: the mean of their floating-point weights
    and buffers, the largest of their integer buffers and global steps, no optimizer moments (the
    next pass starts a fresh optimizer) and no mid-pass position. ``meta`` joins the metadata."""
    import json

    from safetensors.torch import load, save

    if not states:
        raise ValueError("no states to average")
    copies = [load(state) for state in states]
    names = sorted(k for k in copies[0] if k.startswith(MODEL_PREFIX))
    for index, copy in enumerate(copies[1:], start=1):
        theirs = sorted(k for k in copy if k.startswith(MODEL_PREFIX))
        if theirs != names:
            raise ValueError(f"copy {index} has other tensors than copy 0: not copies of one model")
    tensors = {name: _mean([copy[name] for copy in copies]) for name in names}
    first = read_meta(states[0])
    info = {k: first[k] for k in CARRIED_META if k in first} | dict(meta or {})
    info["global_step"] = max(int(read_meta(state).get("global_step", 0)) for state in states)
    return bytes(save(tensors, metadata={"meta": json.dumps(info), "steps": json.dumps({})}))


def _mean(tensors: Sequence[Any]) -> Any:
    """The element-wise mean of floating-point tensors (computed in float64, kept in their dtype);
    the largest value for integer ones (a counter of batches seen)."""
    import torch

    stacked = torch.stack(list(tensors))
    if not stacked.dtype.is_floating_point:
        return stacked.amax(dim=0).contiguous()
    return stacked.double().mean(dim=0).to(stacked.dtype).contiguous()


class ModelAveragingExecutor(OneModelAtATime):
    """Each model, one epoch at a time: a copy per partition trains on the worker holding it,
    then the copies are averaged (see the module docstring)."""

    name = "averaging"

    def __init__(
        self, client: Any, data: DataRef, shard_names: Sequence[str], partitions: int | None = None
    ) -> None:
        # mop.py brings the MOP driver: imported here, so that importing this module stays light
        from mopflow.training.data import load_manifest
        from mopflow.training.executors.mop import cluster_size, partition_rows, partition_shards
        from mopflow.training.executors.scheduler import round_robin

        super().__init__(data)
        self.client = client
        workers = joined_worker_addresses(client)
        self.partitions = partition_shards(shard_names, partitions or cluster_size(client, workers))
        self.placement = round_robin(self.partitions, workers)  # partition -> the worker holding it
        manifest = load_manifest(data.manifest_uri, data.storage_options)
        self.partition_rows = partition_rows(manifest, self.partitions)

    def epoch_steps(self, spec: ModelSpec) -> int:
        """A copy's optimizer steps in one epoch: one pass over the largest partition."""
        batch = int(spec.params["batch_size"])
        return max(steps_per_epoch([rows], batch) for rows in self.partition_rows.values())

    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        outcome = ModelOutcome(spec)
        state = init_state(spec, self.data)
        for epoch in range(epochs):
            try:
                state, report = self._epoch(spec, state, epoch, epochs)
            except Exception as exc:  # a copy failed (e.g. a non-finite loss): the model fails
                outcome.error = f"{type(exc).__name__}: {exc}"
                log.warning("averaging: %s failed at epoch %d: %s", spec.model_id, epoch + 1, outcome.error)
                break
            outcome.state = state  # the latest average (a model failing at its first epoch has none)
            keep = self.report_epoch(outcome, report, controller)
            log.info(
                "averaging: %s epoch %d/%d val_acc=%.4f", spec.model_id, epoch + 1, epochs, report.val_acc
            )
            if not keep:
                outcome.stopped_early = True
                break
        return outcome

    def _epoch(self, spec: ModelSpec, state: bytes, epoch: int, epochs: int) -> tuple[bytes, EpochReport]:
        """One epoch: the copies' passes in parallel, their average, its validation on a worker."""
        steps = self.epoch_steps(spec)
        futures = {
            partition: self.client.submit(
                train_pass,
                spec,
                state,
                self.data,
                shards,
                epoch,
                epochs,
                int(partition[1:]),  # the pass index: each copy its own row order
                {"partition": partition},
                steps,
                workers=[self.placement[partition]],
                allow_other_workers=False,
                resources=spec.device.resources() or None,
                pure=False,
                key=f"averaging-{spec.model_id}-e{epoch}-{partition}-{time.monotonic_ns()}",
            )
            for partition, shards in sorted(self.partitions.items())
        }
        try:
            done = {partition: future.result() for partition, future in futures.items()}
        finally:  # the results are here (or one failed): the workers need not keep them
            for future in futures.values():
                future.release()
        records = [  # "process": where the copy trained (host:pid), "worker": where it was placed
            record | {"process": record["worker"], "worker": self.placement[p], "partition": p}
            for p, (_, record) in done.items()
        ]
        self.records += records
        averaged = average_states([copy for copy, _ in done.values()], {"epoch": epoch})
        val_acc = self.client.submit(
            evaluate_state, spec, averaged, self.data, pure=False, resources=spec.device.resources() or None
        ).result()
        return averaged, _report(spec.model_id, epoch, float(val_acc), records)


def _report(model_id: str, epoch: int, val_acc: float, records: Sequence[Mapping[str, Any]]) -> EpochReport:
    """The epoch's report: the averaged model's accuracy, the copies' loss weighted by their rows,
    the learning rate the longest copy ended at."""
    rows = sum(int(r["rows"]) for r in records)
    loss = sum(float(r["train_loss"]) * int(r["rows"]) for r in records) / rows if rows else float("nan")
    longest = max(records, key=lambda r: int(r["global_step_end"]))
    return EpochReport(model_id, epoch, val_acc, loss, float(longest["lr_end"]))
