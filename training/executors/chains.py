"""The worker side of ``task``'s chains (``training/executors/task_run.py``): a model's epochs
between two decisions of the controller, trained in one Dask task.

Each epoch but the chain's last is staged beside the model's checkpoint, with its record in the
state's metadata, before the coordinator is told of it (a Dask event on the run's topic). When
Dask runs a chain again because its worker died, the chain goes on from the newest state within
it, staged or already made the checkpoint, and hands back the staged epochs' records too (the
coordinator takes each epoch once, so those it heard before change nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mopflow.infra.base import storage
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import CHECKPOINT_FILE, STAGED_FILE
from mopflow.training.executors.units import train_epochs_and_validate
from mopflow.training.trainable.state import StateFormatError, global_step, partial_meta, read_meta
from mopflow.training.trainable.unit import ModelSpec

STAGED_RECORD = "staged_record"  # the state's metadata key of a staged epoch's record

log = logging.getLogger(__name__)


def train_chain(
    spec: ModelSpec,
    state: bytes,
    data: DataRef,
    shards: Sequence[str],
    first_epoch: int,
    epochs: int,
    total_epochs: int,
    topic: str,
    staged_folder: str,
) -> tuple[bytes, list[dict[str, Any]]]:
    """The Dask task of a chain: ``epochs`` epochs from ``first_epoch``, each validated; each but
    the last staged in ``staged_folder`` (when given) and told on ``topic`` as it ends. Returns
    the state after the chain and every epoch's record; the last record says where the chain
    went on from (``resumed_from``) when an earlier attempt of it left a newer state."""
    from distributed import get_worker

    worker = get_worker()
    options = data.storage_options
    recovered: list[dict[str, Any]] = []
    resumed_from = None
    if staged_folder:
        found = newest_state_within(staged_folder, first_epoch, first_epoch + epochs - 1, options)
        if found is not None:
            state, reached, recovered = found
            resumed_from = {"epoch": reached, "step": global_step(state)}
            log.info("%s: chain from epoch %d goes on after epoch %d", spec.model_id, first_epoch, reached)
            epochs -= reached + 1 - first_epoch
            first_epoch = reached + 1

    def tell(record: dict[str, Any], pack: Any) -> None:
        if staged_folder:  # before the coordinator can hear of the epoch
            uri = storage.join(staged_folder, STAGED_FILE.format(epoch=int(record["epoch"])))
            storage.write_bytes_atomic(uri, pack({STAGED_RECORD: record}), options)
        worker.log_event(topic, {"record": record})  # wrapped: the scheduler sets its own "worker"

    new_state, records = train_epochs_and_validate(
        spec, state, data, shards, first_epoch, epochs, total_epochs, tell if topic else None
    )
    records = recovered + records
    if resumed_from is not None:
        records[-1]["resumed_from"] = resumed_from
    return new_state, records


def newest_state_within(
    folder: str, first_epoch: int, last_epoch: int, storage_options: dict[str, Any]
) -> tuple[bytes, int, list[dict[str, Any]]] | None:
    """The newest whole-epoch state of epochs ``first_epoch`` to ``last_epoch - 1`` found in a
    model's folder (staged, or the checkpoint it became), the epoch it ends, and the records of
    the staged epochs up to it; None when there is none (the chain starts from its start)."""
    best: tuple[bytes, int] | None = None
    staged: list[dict[str, Any]] = []
    for epoch in range(first_epoch, last_epoch):
        uri = storage.join(folder, STAGED_FILE.format(epoch=epoch))
        meta = _whole_epoch_meta(uri, storage_options)
        if meta is not None and STAGED_RECORD in meta[1]:
            best = (meta[0], epoch)
            staged.append({**meta[1][STAGED_RECORD], "recovered": True})
    checkpoint = _whole_epoch_meta(storage.join(folder, CHECKPOINT_FILE), storage_options)
    if checkpoint is not None:
        epoch = int(checkpoint[1].get("epoch", -1))
        if first_epoch <= epoch < last_epoch and (best is None or epoch > best[1]):
            best = (checkpoint[0], epoch)
    if best is None:
        return None
    return best[0], best[1], [r for r in staged if int(r["epoch"]) <= best[1]]


def _whole_epoch_meta(uri: str, storage_options: dict[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
    """A state at ``uri`` that ends a whole epoch, with its metadata (None: none, or unreadable)."""
    try:
        if not storage.exists(uri, storage_options):
            return None
        data = storage.read_bytes(uri, storage_options)
        meta = read_meta(data)
    except (FileNotFoundError, StateFormatError):  # moved away meanwhile, or damaged: not used
        return None
    return (data, meta) if partial_meta(data) is None else None
