"""Training passes that run on workers: one pass of one model over some shards, state in and out.

Each pass is a :class:`mopflow.training.trainable.unit.TrainableUnit` rebuilt from the state it is handed, so a
model hops between workers (MOP), moves epoch by epoch (``task``) or is checkpointed after
every pass; its state travels as safetensors bytes and loading it never unpickles.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from mopflow.training.data.ref import DataRef
from mopflow.training.executors.resident import pooled
from mopflow.training.executors.worker_data import (
    _manifest,
    cached_bytes,
    clear_partitions,
    load_eval_split,
    load_partition,
    training_rows,
)
from mopflow.training.models.builtin import ArchSpec
from mopflow.training.models.families import DataSpec
from mopflow.training.trainable.augment import augmenter
from mopflow.training.trainable.schedule import steps_per_epoch
from mopflow.training.trainable.unit import ModelSpec, PassInterrupted, TrainableUnit
from mopflow.training.volatile import preempt
from mopflow.training.volatile.preempt import UnitPreempted, notice_received

__all__ = [
    "DataRef",
    "ModelSpec",
    "train_pass",
    "train_pass_and_validate",
    "train_epochs_and_validate",
    "init_state",
    "evaluate_state",
    "cached_bytes",
    "clear_partitions",
    "load_eval_split",
    "load_partition",
    "training_rows",
]

log = logging.getLogger(__name__)

STAGED_RECORD = "staged_record"  # the metadata key of a staged epoch's record (executors/chains.py)
STAGED_UNHEARD = "staged_unheard"  # and of the records of the epochs before it not heard yet


class ChainStopped(Exception):
    """A chain of epochs told to stop by the coordinator (its controller stopped the model after
    an epoch the chain had already told): it ended at its next batch, the pass it was in
    discarded. ``records`` are the epochs it finished, each staged before it was told;
    ``dropped_s`` the seconds it trained after the last of them, for nothing."""

    def __init__(self, model_id: str, records: Sequence[Mapping[str, Any]], dropped_s: float = 0.0) -> None:
        super().__init__(f"chain of {model_id} stopped after {len(records)} epoch(s)")
        self.model_id = model_id
        self.records = [dict(r) for r in records]
        self.dropped_s = dropped_s

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.model_id, self.records, self.dropped_s))


@contextmanager
def _unit(spec: ModelSpec, data: DataRef, state: bytes | None, total_steps: int) -> Iterator[TrainableUnit]:
    """The unit of ``spec`` on this data, carrying ``state`` (a fresh seeded one without); a
    state loads into a model this worker kept from an earlier unit of the same architecture
    (:mod:`~mopflow.training.executors.resident`), which goes back to the pool after the unit."""
    manifest = _manifest(data)
    arch = ArchSpec.from_params(spec.params, DataSpec.from_manifest(manifest))
    with pooled(
        _pool_key(data, arch) if state is not None else None, lambda: _built(spec, manifest)
    ) as model:
        unit = TrainableUnit(spec, model, total_steps, arch=arch)
        if state is not None:
            unit.import_state(state)
        unit.augment = augmenter(data.augment, data.spec.modality, data.spec.input_shape)
        yield unit


def _built(spec: ModelSpec, manifest: Mapping[str, Any]) -> Any:
    return TrainableUnit.build(spec, manifest, 1).model


def _pool_key(data: DataRef, arch: ArchSpec) -> tuple[str, ArchSpec] | None:
    """What a kept model is kept under: its data (the normalisation in its buffers comes from the
    manifest, and the state overwrites it anyway) and architecture; None when the architecture's
    params cannot be a key (a family's param that is a list)."""
    try:
        hash(arch)
    except TypeError:
        return None
    return (data.manifest_uri, arch)


def train_pass(
    spec: ModelSpec,
    state: bytes | None,
    data: DataRef,
    shard_names: Sequence[str],
    epoch: int,
    total_epochs: int,
    pass_index: int = 0,
    meta: Mapping[str, Any] | None = None,
    epoch_steps: int | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """One pass of ``spec`` over ``shard_names`` at ``epoch`` (a MOP sub-epoch, or a whole epoch).

    The learning rate follows the one-cycle schedule of ``total_epochs x epoch_steps`` global
    steps from the model's global step, which the state carries: the same curve whichever
    strategy trains it. ``epoch_steps`` is the steps of a whole epoch over every partition
    (None: this pass is the whole epoch). A spot notice stops the pass at the next batch
    boundary (:class:`UnitPreempted` carries the state there). Returns the new state and the
    pass's record (worker, timings, rows, loss, global step and learning rate at its end).
    """
    new_state, record, _ = train_pass_and_validate(
        spec, state, data, shard_names, epoch, total_epochs, pass_index, meta, False, epoch_steps
    )
    return new_state, record


def train_epochs_and_validate(
    spec: ModelSpec,
    state: bytes | None,
    data: DataRef,
    shard_names: Sequence[str],
    first_epoch: int,
    epochs: int,
    total_epochs: int,
    on_epoch: Callable[[dict[str, Any], Callable[..., bytes]], None] | None = None,
    halt: Callable[[], bool] | None = None,
) -> tuple[bytes, list[dict[str, Any]]]:
    """Epochs ``first_epoch .. first_epoch + epochs - 1`` of ``spec`` over every shard, each
    validated, on one worker with the model kept in memory between them: one task, one state
    unpacked and packed, however many epochs (``task``'s epochs between two decisions of the
    pruner).

    The state after the chain is the state the same epochs one per task would give (each pass is
    seeded by its epoch; the moments and global step carry over as an export would carry them).
    Each epoch's record (with ``val_acc`` and ``val_s``) but the last's goes to ``on_epoch`` as
    it ends, with a function that packs the state there (``export_state``, to stage it as a
    checkpoint), so the coordinator hears of it before the chain is done. A spot notice or a
    stop ends the chain at the next batch: :class:`UnitPreempted` carries the state there and, in
    its record's ``epochs``, the records of the epochs finished before it. ``halt`` (asked after
    every batch and between epochs) saying so ends the chain with :class:`ChainStopped`.
    """
    started = time.time()
    _refuse_on_notice(spec, state, started)
    rows, loaded = _rows_here(spec, data, shard_names)
    with _unit(spec, data, state, total_epochs * _epoch_steps(spec, rows, None)) as unit:
        return _train_chain(
            unit,
            data,
            rows,
            shard_names,
            range(first_epoch, first_epoch + epochs),
            on_epoch,
            halt,
            (started, loaded),
        )


def _train_chain(
    unit: TrainableUnit,
    data: DataRef,
    rows: Any,
    shard_names: Sequence[str],
    epochs: range,
    on_epoch: Callable[[dict[str, Any], Callable[..., bytes]], None] | None,
    halt: Callable[[], bool] | None,
    since: tuple[float, float],
) -> tuple[bytes, list[dict[str, Any]]]:
    """The epochs of :func:`train_epochs_and_validate` on its unit; ``since``: when the chain's
    task started and when its rows were ready."""
    started, loaded = since
    for key in (STAGED_RECORD, STAGED_UNHEARD):  # carried by a staged state it goes on from
        unit.meta.pop(key, None)
    x_val, y_val = load_eval_split(data, "validation")
    done: list[dict[str, Any]] = []
    for epoch in epochs:
        unit.meta["epoch"] = epoch
        if halt is not None and halt():
            raise ChainStopped(unit.spec.model_id, done, time.time() - started)
        try:
            record = _run_pass(unit, rows, shard_names, epoch, 0, started, loaded, halt)
        except UnitPreempted as stopped:
            stopped.record["epochs"] = done
            raise
        except ChainStopped:
            raise ChainStopped(unit.spec.model_id, done, time.time() - started) from None
        validated = time.perf_counter()
        val_acc = unit.evaluate(x_val, y_val)
        record |= {"val_acc": val_acc, "val_s": time.perf_counter() - validated, "end": time.time()}
        done.append(record)
        if on_epoch is not None and epoch + 1 < epochs.stop:  # the last comes with the result
            on_epoch(record, unit.export_state)
        # the next epoch's span starts where this one's record ended: staging counts in the task
        started, loaded = record["end"], time.time()
    packing = time.time()
    # the last epoch's record travels in the state: once the coordinator makes it the checkpoint,
    # a retry can tell that epoch even if the attempt that heard it lost it before telling it
    new_state = unit.export_state({STAGED_RECORD: done[-1]})
    done[-1] |= {"state_bytes": len(new_state), "pack_s": time.time() - packing, "end": time.time()}
    return new_state, done


def _refuse_on_notice(spec: ModelSpec, state: bytes | None, started: float) -> None:
    """A worker going away (a spot notice) hands the unit back untouched."""
    if notice_received():
        here = {"start": started, "saved_at": started, "end": started, "worker": _dask_address()}
        raise UnitPreempted(spec.model_id, state, here)


def _rows_here(spec: ModelSpec, data: DataRef, shard_names: Sequence[str]) -> tuple[Any, float]:
    """The training rows on this worker (loaded once per worker), and when they were ready."""
    import torch

    from mopflow.training.trainable.lit import quiet_lightning

    torch.set_num_threads(1)
    quiet_lightning()
    return training_rows(data, shard_names, str(spec.device.torch_device())), time.time()


def _epoch_steps(spec: ModelSpec, rows: Any, epoch_steps: int | None) -> int:
    """Optimizer steps in a whole epoch: ``epoch_steps`` when given, else one pass over ``rows``."""
    if epoch_steps is not None:
        return epoch_steps
    n_rows = len(rows[0]) if isinstance(rows, tuple) else len(rows)
    return steps_per_epoch([n_rows], int(spec.params["batch_size"]))


def _run_pass(
    unit: TrainableUnit,
    rows: Any,
    shard_names: Sequence[str],
    epoch: int,
    pass_index: int,
    started: float,
    loaded: float,
    halt: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """One pass of ``unit`` over ``rows``, stopped by a spot notice at its next batch
    (:class:`UnitPreempted`), or by ``halt`` (:class:`ChainStopped`, nothing of the pass kept);
    the pass's record."""
    spec = unit.spec
    part = ",".join(sorted(shard_names))
    fit_started = time.time()
    notice = preempt.NOTICE
    stop = notice.is_set if halt is None else (lambda: notice.is_set() or halt())
    try:
        record = unit.train_pass(rows, epoch, pass_index, part, stop=stop)
    except PassInterrupted as stopped:
        if not notice.is_set():  # told to stop: the epochs before this one are all it keeps
            raise ChainStopped(spec.model_id, []) from None
        log.warning(
            "%s: spot notice; stopped epoch %d pass %d at batch %d/%d",
            spec.model_id,
            epoch,
            pass_index,
            stopped.batches,
            stopped.n_batches,
        )
        where = {"start": started, "load_end": loaded, "saved_at": time.time(), "batches": stopped.batches}
        raise UnitPreempted(
            spec.model_id, stopped.state, {**where, "end": time.time(), "worker": _dask_address()}
        ) from None
    if record.resumed_at_batch:
        log.info(
            "%s: resumed epoch %d pass %d at batch %d",
            spec.model_id,
            epoch,
            pass_index,
            record.resumed_at_batch,
        )
    return {
        "model": spec.model_id,
        "partition": ",".join(shard_names),
        "worker": f"{os.uname().nodename}:{os.getpid()}",
        "epoch": epoch,
        "start": started,
        "load_end": loaded,
        "end": time.time(),
        "rows": record.rows,
        "resumed_at_batch": record.resumed_at_batch,
        "train_loss": record.train_loss,
        "global_step_end": unit.global_step,
        "lr_end": record.lr_end,
        "loop_s": record.loop_s,
        # the task's seconds before the pass (rows, model, state) and in it (Trainer and loop)
        "setup_s": fit_started - started,
        "fit_s": time.time() - fit_started,
    }


def _dask_address() -> str:
    """The address of the Dask worker running this (empty outside a worker)."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return ""


def init_state(spec: ModelSpec, data: DataRef) -> bytes:
    """A model's initial state (seeded), before any pass."""
    with _unit(spec, data, None, 1) as unit:
        return unit.export_state({"epoch": -1})


def evaluate_state(spec: ModelSpec, state: bytes, data: DataRef, split: str = "validation") -> float:
    """Accuracy of a packed state on a split."""
    import torch

    torch.set_num_threads(1)
    x, y = load_eval_split(data, split)
    with _unit(spec, data, state, 1) as unit:
        return unit.evaluate(x, y)


def train_pass_and_validate(
    spec: ModelSpec,
    state: bytes | None,
    data: DataRef,
    shard_names: Sequence[str],
    epoch: int,
    total_epochs: int,
    pass_index: int = 0,
    meta: Mapping[str, Any] | None = None,
    validate: bool = False,
    epoch_steps: int | None = None,
    halt: Callable[[], bool] | None = None,
) -> tuple[bytes, dict[str, Any], float | None]:
    """:func:`train_pass`, then (when it ends the model's epoch) validation on the same worker.

    Validating where the state already is saves a task and a round trip per model-epoch, and
    the wait for a separate validation phase at the end of a MOP round; the model that trained
    is the one validated (its state is not unpacked again). ``halt`` (asked before the pass and
    after every batch) saying so drops the unit: :class:`ChainStopped`, nothing of it kept.
    """
    started = time.time()
    _refuse_on_notice(spec, state, started)
    if halt is not None and halt():
        raise ChainStopped(spec.model_id, [])
    rows, loaded = _rows_here(spec, data, shard_names)
    with _unit(spec, data, state, total_epochs * _epoch_steps(spec, rows, epoch_steps)) as unit:
        unit.meta |= {"epoch": epoch, **dict(meta or {})}
        record = _run_pass(unit, rows, shard_names, epoch, pass_index, started, loaded, halt)
        packing = time.time()
        new_state = unit.export_state()
        # the unit's span ends packed
        record |= {"state_bytes": len(new_state), "pack_s": time.time() - packing, "end": time.time()}
        if not validate:
            return new_state, record, None
        x_val, y_val = load_eval_split(data, "validation")
        validated = time.perf_counter()
        val_acc = unit.evaluate(x_val, y_val)
    return new_state, {**record, "val_s": time.perf_counter() - validated, "end": time.time()}, val_acc


def state_to_bundle(spec: ModelSpec, state: bytes, data: DataRef, url: str) -> str:
    """Write a packed state as a model bundle (the checkpoint format the ensemble stage reads)."""
    from mopflow.training.models.bundle import save_bundle

    manifest = _manifest(data)  # read and verified once per process, as the unit's build reads it
    with _unit(spec, data, state, 1) as unit:
        return save_bundle(
            url,
            [unit.model],
            [unit.arch],
            manifest["feature_columns"],
            extra={
                "model_id": spec.model_id,
                "params": spec.params,
                "manifest_hash": manifest["manifest_hash"],
            },
            storage_options=data.storage_options,  # written by the coordinator (the sweep): its options
        )
