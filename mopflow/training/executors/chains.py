"""The worker side of ``task``'s chains (``training/executors/task_run.py``): a model's epochs
between two decisions of the controller, trained in one Dask task.

Every epoch but the chain's last is staged beside the model's checkpoint, its record in the
state's metadata. The coordinator hears an epoch (a Dask event, :data:`EPOCH_TOPIC`) only where it
needs it at once, or as often as a run's progress wants: the chain's first epoch and an epoch
after which the controller may stop the model (``decisions``) are heard as they end, the others
at most every ``hear_every_s`` seconds (default :data:`HEAR_EVERY_S`), each event carrying the
records of every epoch since the last (the chain's result carries them all). A heard epoch's state stays staged until the
coordinator makes it the checkpoint; the state of an epoch not heard yet is removed once a newer
one is staged, and carries the records of the epochs before it that were not heard either. When
Dask runs a chain again because its worker died, the chain goes on from the newest state within
it, staged or already made the checkpoint, and hands back the records it finds (the coordinator
takes each epoch once, so those it heard before change nothing): a worker's death loses at most
the epoch in flight.

A chain may run past a decision of the controller (under a pruner that may stop a model after
any epoch, ``task`` trains a model's epochs to the end in one chain and the controller decides
as each is heard): the coordinator then tells the chain's worker to stop it
(:func:`stop_chain`, through ``client.run``), and the chain ends at its next batch with
:class:`~mopflow.training.executors.units.ChainStopped`. So does a chain whose task Dask cancelled
under it (its coordinator died or let its future go): nobody waits for what it would train.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Collection, Sequence
from typing import Any

from mopflow.base import storage
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import CHECKPOINT_FILE, STAGED_FILE
from mopflow.training.executors.units import (
    STAGED_RECORD,
    STAGED_UNHEARD,
    ChainStopped,
    train_epochs_and_validate,
)
from mopflow.training.trainable.state import StateFormatError, global_step, partial_meta, read_meta
from mopflow.training.trainable.unit import ModelSpec
from mopflow.training.volatile.preempt import UnitPreempted

# One topic for every run: the scheduler keeps each topic's recent events (a bounded log), so a
# topic per run would leave a log per run behind on a long-lived scheduler.
EPOCH_TOPIC = "mopflow-task-epochs"
# How often a chain's epochs that no decision waits for are heard: the run's progress (its
# trials' reports, the checkpoint the coordinator keeps) lags the training by at most this much,
# and an epoch heard costs the coordinator about 1 ms (the event through the scheduler, the state
# moved into place), which short (GPU-speed) epochs would otherwise pay every few milliseconds.
HEAR_EVERY_S = 2.0
STOPS_KEPT = 1024  # the chains told to stop that a worker remembers (a stop may come after its chain)

_STOPPED: dict[str, None] = {}  # in a worker process: the keys of chains told to stop, oldest first


async def stop_chain(key: str) -> None:
    """Stop the chain whose Dask task is ``key`` at its next batch (``client.run`` it on the
    chain's worker, on whose event loop it runs, so that the coordinator need not wait for it; a
    chain already over is not affected)."""
    _STOPPED[key] = None
    while len(_STOPPED) > STOPS_KEPT:
        del _STOPPED[next(iter(_STOPPED))]


log = logging.getLogger(__name__)


def _told_to_stop(worker: Any, key: str) -> bool:
    """Whether the chain of task ``key`` is to end: told so (:func:`stop_chain`), or its task was
    cancelled on ``worker`` while it ran (Dask cannot interrupt a running task)."""
    if key in _STOPPED:
        return True
    task = worker.state.tasks.get(key)
    return task is None or task.state == "cancelled"


def train_chain(
    spec: ModelSpec,
    state: bytes | None,
    data: DataRef,
    shards: Sequence[str],
    first_epoch: int,
    epochs: int,
    total_epochs: int,
    run_id: str,
    staged_folder: str,
    decisions: Collection[int] = (),
    hear_every_s: float = 0.0,
) -> tuple[bytes, list[dict[str, Any]]]:
    """The Dask task of a chain: ``epochs`` epochs from ``first_epoch`` (from ``state``, or the
    model's seeded first state when None), each validated; each but the last staged in
    ``staged_folder`` (when given) and told on :data:`EPOCH_TOPIC` for the run ``run_id`` ("":
    not told): as it ends when it is the chain's first, one of ``decisions`` (the epochs after
    which the controller may stop the model), or ``hear_every_s`` seconds have passed since the
    chain last told one; else with the next one told. Returns the state after the chain and every epoch's record
    (``staged``: its state was left staged for the coordinator); the last record says where the
    chain went on from (``resumed_from``) when an earlier attempt of it left a newer state."""
    from distributed import get_worker
    from distributed.worker import thread_state

    worker = get_worker()
    key = str(thread_state.key)
    options = data.options_here()  # this worker's, when it sets its own
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

    unheard: list[dict[str, Any]] = []  # the records of the epochs finished and not told yet
    unheard_state = ""  # the state staged after the newest of them
    told_at = -float("inf")  # a chain's first epoch is heard as it ends: its checkpoint is there from then on

    def tell(record: dict[str, Any], pack: Any) -> None:
        nonlocal unheard, unheard_state, told_at
        epoch = int(record["epoch"])
        now = epoch in decisions or time.monotonic() - told_at >= hear_every_s
        if staged_folder:  # before the coordinator can hear of the epoch
            record["staged"] = now  # left for the coordinator to make the checkpoint
            uri = storage.join(staged_folder, STAGED_FILE.format(epoch=epoch))
            storage.write_bytes_atomic(uri, pack({STAGED_RECORD: record, STAGED_UNHEARD: unheard}), options)
            if unheard_state:  # superseded: the newer state carries its record
                storage.remove(unheard_state, options)
            unheard_state = "" if now else uri
        unheard = [*unheard, record]  # a new list: an event in flight keeps its own
        if now:
            worker.log_event(EPOCH_TOPIC, {"run": run_id, "records": unheard})  # the scheduler adds "worker"
            unheard, told_at = [], time.monotonic()

    try:
        new_state, records = train_epochs_and_validate(
            spec,
            state,
            data,
            shards,
            first_epoch,
            epochs,
            total_epochs,
            tell if run_id else None,
            halt=lambda: _told_to_stop(worker, key),
        )
    except UnitPreempted as stopped:  # the epochs recovered are finished epochs too
        stopped.record["epochs"] = recovered + list(stopped.record.get("epochs", []))
        raise
    except ChainStopped as stopped:
        raise ChainStopped(spec.model_id, recovered + stopped.records, stopped.dropped_s) from None
    finally:
        _STOPPED.pop(key, None)
        if unheard_state:  # the result (or the notice, or the stop) carries what it held
            storage.remove(unheard_state, options)
    records = recovered + records
    if resumed_from is not None:
        records[-1]["resumed_from"] = resumed_from
    return new_state, records


def newest_state_within(
    folder: str, first_epoch: int, last_epoch: int, storage_options: dict[str, Any]
) -> tuple[bytes, int, list[dict[str, Any]]] | None:
    """The newest whole-epoch state of epochs ``first_epoch`` to ``last_epoch - 1`` found in a
    model's folder (staged, or the checkpoint it became), the epoch it ends, and the records the
    staged states carry up to it, in order (each ``recovered``; ``staged`` where its own state is
    still staged); None when there is none (the chain starts from its start).

    One listing of the folder and one header read of the checkpoint when nothing is there (a
    chain's first attempt): a whole state is read only when it is used."""
    fs, path = storage.filesystem(
        storage.join(folder, STAGED_FILE.replace("{epoch:04d}", "*")), storage_options
    )
    listed = {posixpath.basename(name) for name in fs.glob(path)}
    best: tuple[bytes, int] | None = None
    staged: list[dict[str, Any]] = []
    for epoch in range(first_epoch, last_epoch):
        if STAGED_FILE.format(epoch=epoch) not in listed:
            continue
        found = _whole_epoch_state(storage.join(folder, STAGED_FILE.format(epoch=epoch)), storage_options)
        if found is not None and STAGED_RECORD in found[1]:
            best = (found[0], epoch)
            earlier = [{**r, "staged": False} for r in found[1].get(STAGED_UNHEARD, [])]
            staged += [*earlier, {**found[1][STAGED_RECORD], "staged": True}]  # this state is staged
    checkpoint = storage.join(folder, CHECKPOINT_FILE)
    reached = _epoch_in_header(checkpoint, storage_options)
    if reached is not None and first_epoch <= reached < last_epoch and (best is None or reached > best[1]):
        found = _whole_epoch_state(checkpoint, storage_options)
        if found is not None and int(found[1].get("epoch", -1)) == reached:
            best = (found[0], reached)
    if best is None:
        return None
    recovered = {int(r["epoch"]): {**r, "recovered": True} for r in staged if int(r["epoch"]) <= best[1]}
    return best[0], best[1], [recovered[epoch] for epoch in sorted(recovered)]


def _epoch_in_header(uri: str, storage_options: dict[str, Any]) -> int | None:
    """The epoch a packed state ends, from its safetensors header alone (None: no such file)."""
    fs, path = storage.filesystem(uri, storage_options)
    try:
        with fs.open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            head = size.to_bytes(8, "little") + handle.read(size)
        return int(read_meta(head).get("epoch", -1))
    except (FileNotFoundError, StateFormatError, ValueError):  # absent, moved away meanwhile or damaged
        return None


def _whole_epoch_state(uri: str, storage_options: dict[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
    """A state at ``uri`` that ends a whole epoch, with its metadata (None: none, or unreadable)."""
    try:
        data = storage.read_bytes(uri, storage_options)
        meta = read_meta(data)
    except (FileNotFoundError, StateFormatError):  # moved away meanwhile, or damaged: not used
        return None
    return (data, meta) if partial_meta(data) is None else None
