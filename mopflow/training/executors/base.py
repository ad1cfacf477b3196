"""One interface for training many configurations: "train these for E epochs on these shards;
report each model's validation metric after every epoch; tell the caller the moment a model is
done (finished, stopped or failed); let the caller stop or add models between epochs; return
checkpoints"."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from mopflow.base import stopping, storage
from mopflow.base.fencing import Fence, unfenced
from mopflow.training.data.ref import DataRef
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "last.safetensors"  # a model's latest state (training/trainable/unit.py's export)
# a state a worker wrote inside a chain of epochs (``task``), the checkpoint once its epoch is told
STAGED_FILE = "staged-e{epoch:04d}.safetensors"
# a model's epoch reports, one JSON line each, beside its checkpoint (appended where storage can)
HISTORY_FILE = "history.jsonl"
LEGACY_HISTORY_FILE = "history.json"  # one JSON list, as earlier versions wrote it
# Why Dask cancels every future of a client whose connection to the scheduler broke
SCHEDULER_CONNECTION_LOST = "scheduler-connection-lost"


class ClusterLost(RuntimeError):
    """The coordinator lost its connection to the Dask scheduler (its host was cut off), and Dask
    cancelled every future it held. Nothing is wrong with the trials: the attempt ends without
    telling the study anything about them, and its retry resumes them from their checkpoints."""


# A client that gave up reconnecting closes, and its close cancels the futures left with no reason
# given: a cancel seen while the client is in one of these states is the cluster's loss too.
CLIENT_WITHOUT_SCHEDULER = frozenset({"connecting", "closing", "closed"})


def raise_if_cluster_lost(exc: BaseException, client: Any = None) -> None:
    """Raise :class:`ClusterLost` from ``exc`` when it is a future cancelled because the client
    lost the scheduler (the cancel says so, or ``client`` is reconnecting or closed); otherwise
    return (the caller judges ``exc`` as the unit's own error)."""
    if not isinstance(exc, CancelledError):
        return
    status = str(getattr(client, "status", ""))
    if getattr(exc, "reason", None) == SCHEDULER_CONNECTION_LOST or status in CLIENT_WITHOUT_SCHEDULER:
        raise ClusterLost(f"the connection to the Dask scheduler was lost: {exc}") from exc


@dataclass(frozen=True)
class EpochReport:
    """A model's validation metric after an epoch."""

    model_id: str
    epoch: int
    val_acc: float
    train_loss: float
    lr: float | None = None  # the learning rate the epoch ended at (the schedule's position)


@dataclass
class ModelOutcome:
    """What training a model produced."""

    spec: ModelSpec
    history: list[EpochReport] = field(default_factory=list)
    state: bytes | None = None
    stopped_early: bool = False
    error: str | None = None
    checkpoint_uri: str | None = None

    @property
    def epochs_done(self) -> int:
        return len(self.history)


class Controller(Protocol):
    """The caller's say between epochs (the search's pruner and sampler live behind it)."""

    def on_epoch_end(self, report: EpochReport) -> bool:
        """Return False to stop training this model."""
        ...

    def on_model_done(self, outcome: ModelOutcome) -> None:
        """A model is done (all epochs, stopped by ``on_epoch_end`` or failed): its final
        outcome, with its state, before any model is added in its slot."""
        ...

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        """Models to add now that ``free_slots`` slots are free (may be empty)."""
        ...


@runtime_checkable
class DecisionPoints(Protocol):
    """A controller that says in advance after which epochs it may stop a model: between two such
    points ``task`` trains a model's epochs in one task, with no round trip to the coordinator
    between them. A controller without it may stop a model after any epoch."""

    def next_decision(self, epochs_done: int) -> int | None:
        """The smallest epoch count above ``epochs_done`` after which a model may be stopped
        (None: none is, it trains to the end)."""
        ...


def decides_after_any_epoch(controller: Controller) -> bool:
    """Whether ``controller`` may stop a model after any epoch: it names no decision points
    (:class:`DecisionPoints`), or every epoch (``decides_every_epoch``, the median pruner's)."""
    every_epoch = bool(getattr(controller, "decides_every_epoch", False))
    return every_epoch or not isinstance(controller, DecisionPoints)


def decides_after(controller: Controller, epoch: int) -> bool:
    """Whether ``controller`` may stop a model after epoch ``epoch`` (counted from 0)."""
    return not isinstance(controller, DecisionPoints) or controller.next_decision(epoch) == epoch + 1


def epochs_before_decision(controller: Controller, epochs_done: int, epochs: int) -> int:
    """Epochs a model that has trained ``epochs_done`` of ``epochs`` may train before the
    controller next may stop it (at least one)."""
    if not isinstance(controller, DecisionPoints):
        return 1
    point = controller.next_decision(epochs_done)
    until = epochs if point is None else min(point, epochs)
    return max(1, until - epochs_done)


class TrainAll:
    """Default controller: every model trains for all epochs; nothing is added."""

    def on_epoch_end(self, report: EpochReport) -> bool:
        return True

    def on_model_done(self, outcome: ModelOutcome) -> None:
        return None

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        return []


class _NoController(TrainAll):
    """What :meth:`Executor.run` uses without a controller: nothing ever stops a model, so it
    says so in advance (a subclass of :class:`TrainAll` may stop one after any epoch)."""

    def next_decision(self, epochs_done: int) -> int | None:
        return None


class RunBookkeeping(Protocol):
    """What a run's helpers (a DDP job, a MOP run's models, a task run) need from the executor they
    serve: reports to the controller, checkpoints, staged states and resumptions. Every
    :class:`Executor` offers it."""

    def report_epoch(self, outcome: ModelOutcome, report: EpochReport, controller: Controller) -> bool: ...

    def replay_history(self, outcome: ModelOutcome, through_epoch: int, controller: Controller) -> bool: ...

    def kept_checkpoint(self, model_id: str) -> str | None: ...

    def save_checkpoint(self, model_id: str, state: bytes) -> str | None: ...

    def load_checkpoint(self, model_id: str) -> tuple[bytes, dict[str, Any]] | None: ...

    def note_resumed(self, model_id: str, epoch: int, state: bytes) -> None: ...

    def staged_folder(self, model_id: str) -> str: ...

    def promote_staged(self, model_id: str, epoch: int) -> None: ...

    def drop_staged(self, model_id: str) -> None: ...


class Executor(ABC):
    """A strategy for training many models; see the module docstring."""

    name = "base"
    # Whether a training run watches for a requested stop itself (its units checkpoint at their
    # next batch first): a signal then only sets the flag (``mopflow.base.stopping``).
    stops_on_its_own = False

    def __init__(self, data: DataRef, checkpoint_root: str = "") -> None:
        self.data = data
        self.checkpoint_root = checkpoint_root
        self.records: list[dict[str, Any]] = []  # one per unit/pass: worker, model, timings
        self.interruptions: list[dict[str, Any]] = []  # one per unit, epoch or job lost or stopped
        self.redone_unit_seconds = 0.0  # work lost with interrupted units, to be done again
        # per model: where it went on from a checkpoint (epoch done, optimizer step, after a notice)
        self.resumed: dict[str, dict[str, Any]] = {}
        # checked before a checkpoint or history is written: a superseded attempt writes none
        self.fence: Fence = unfenced
        # model -> the history list this executor writes for it, and how many of its reports are written
        self._history_written: dict[str, tuple[list[EpochReport], int]] = {}
        self._records_by_model: tuple[int, dict[str, list[dict[str, Any]]]] = (0, {})  # (indexed, index)

    def run(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller | None = None
    ) -> dict[str, ModelOutcome]:
        """Train ``models`` for up to ``epochs`` epochs; return their outcomes by model id.

        Without a ``controller`` every model trains all its epochs and none is added."""
        if not self.stops_on_its_own:
            return self._train(models, epochs, controller or _NoController())
        with stopping.stops_cooperatively():
            return self._train(models, epochs, controller or _NoController())

    @abstractmethod
    def _train(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        """The strategy's own :meth:`run`, with a controller."""

    # -- the controller's view of a model's epochs -------------------------------------------

    def report_epoch(self, outcome: ModelOutcome, report: EpochReport, controller: Controller) -> bool:
        """Record a finished epoch (kept beside the checkpoint) and tell the controller; False
        once the model is to stop."""
        outcome.history.append(report)
        self.save_history(report.model_id, outcome.history)
        return controller.on_epoch_end(report)

    def replay_history(self, outcome: ModelOutcome, through_epoch: int, controller: Controller) -> bool:
        """Hand the controller again the epochs a model's checkpoint covers (a restarted
        coordinator's retried trial), into ``outcome``; False when it says to stop."""
        keep = True
        for report in self.load_history(outcome.spec.model_id, through_epoch):
            outcome.history.append(report)
            keep = controller.on_epoch_end(report) and keep
        return keep

    def records_of(self, model_id: str) -> list[dict[str, Any]]:
        """The records of ``model_id``'s units, in order: indexed as the records grow, so that a
        long sweep looks each finished trial up without scanning every record."""
        indexed, index = self._records_by_model
        for record in self.records[indexed:]:
            index.setdefault(str(record.get("model")), []).append(record)
        self._records_by_model = (len(self.records), index)
        return list(index.get(model_id, []))

    def record_interruption(self, redone: float, **what: Any) -> None:
        """Record work lost with an interrupted unit, epoch or job (a notice or a lost worker)."""
        self.redone_unit_seconds += redone
        self.interruptions.append({**what, "redone_s": redone, "at": time.time()})

    # -- checkpoints: the latest state of each model, written after every pass --------------

    def checkpoint_uri(self, model_id: str) -> str:
        return storage.join(self.checkpoint_root, model_id, CHECKPOINT_FILE)

    def kept_checkpoint(self, model_id: str) -> str | None:
        """Where a model's checkpoint is, when this executor keeps checkpoints (None otherwise)."""
        return self.checkpoint_uri(model_id) if self.checkpoint_root else None

    def save_checkpoint(self, model_id: str, state: bytes) -> str | None:
        if not self.checkpoint_root:
            return None
        uri = self.checkpoint_uri(model_id)
        self.fence()
        storage.write_bytes_atomic(uri, state, self.data.storage_options)
        return uri

    def staged_folder(self, model_id: str) -> str:
        """Where a worker stages a model's states inside a chain of epochs ("": no checkpoints)."""
        return storage.join(self.checkpoint_root, model_id) if self.checkpoint_root else ""

    def promote_staged(self, model_id: str, epoch: int) -> None:
        """The state a worker staged after ``epoch`` becomes the model's checkpoint (moved, once
        the coordinator takes that epoch in: the checkpoint never runs ahead of the history)."""
        if not self.checkpoint_root:
            return
        staged = storage.join(self.staged_folder(model_id), STAGED_FILE.format(epoch=epoch))
        self.fence()
        try:
            storage.move(staged, self.checkpoint_uri(model_id), self.data.storage_options)
        except FileNotFoundError:
            log.warning("%s: no staged state for epoch %d; its checkpoint stays older", model_id, epoch)

    def drop_staged(self, model_id: str) -> None:
        """Remove the states left staged (a chain run again after its worker died wrote some twice)."""
        if self.checkpoint_root:
            pattern = storage.join(self.staged_folder(model_id), STAGED_FILE.replace("{epoch:04d}", "*"))
            storage.remove_matching(pattern, self.data.storage_options)

    def save_history(self, model_id: str, history: list[EpochReport]) -> None:
        """The model's epoch reports so far, beside its checkpoint: a restarted coordinator
        hands them to its new trial, so the trial's record is whole."""
        if not self.checkpoint_root:
            return
        uri = storage.join(self.checkpoint_root, model_id, HISTORY_FILE)
        kept, written = self._history_written.get(model_id, (None, 0))
        self.fence()
        # a model's history (this list, while it trains) is written whole the first time (an
        # earlier attempt's lines go), then each epoch appends its line where the storage can
        appended = kept is history and written <= len(history)
        if appended:
            new = "".join(json.dumps(asdict(r)) + "\n" for r in history[written:])
            appended = storage.append_bytes(uri, new.encode(), self.data.storage_options)
        if not appended:
            whole = "".join(json.dumps(asdict(r)) + "\n" for r in history)
            storage.write_bytes_atomic(uri, whole.encode(), self.data.storage_options)
        self._history_written[model_id] = (history, len(history))

    def load_history(self, model_id: str, through_epoch: int) -> list[EpochReport]:
        """The saved epoch reports up to ``through_epoch`` (those its checkpoint covers): the
        last line of each epoch, a half-written last line passed over."""
        if not self.checkpoint_root:
            return []
        options = self.data.storage_options
        folder = storage.join(self.checkpoint_root, model_id)
        if storage.exists(uri := storage.join(folder, HISTORY_FILE), options):
            rows = []
            for line in storage.read_bytes(uri, options).decode().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rows.append(json.loads(line))
        elif storage.exists(uri := storage.join(folder, LEGACY_HISTORY_FILE), options):
            rows = json.loads(storage.read_bytes(uri, options))
        else:
            return []
        by_epoch = {int(row["epoch"]): row for row in rows if int(row["epoch"]) <= through_epoch}
        return [EpochReport(**by_epoch[epoch]) for epoch in sorted(by_epoch)]

    def load_checkpoint(self, model_id: str) -> tuple[bytes, dict[str, Any]] | None:
        """The latest state of a model and its metadata (epoch, visited partitions), if it has
        trained (every trained state records its epoch)."""
        if not self.checkpoint_root:
            return None
        uri = self.checkpoint_uri(model_id)
        if not storage.exists(uri, self.data.storage_options):
            return None
        data = storage.read_bytes(uri, self.data.storage_options)
        from mopflow.training.trainable.state import read_meta

        meta = read_meta(data)
        if int(meta.get("epoch", -1)) < 0:  # an initial state a stop handed back untrained: start afresh
            return None
        return data, meta

    def note_resumed(self, model_id: str, epoch: int, state: bytes) -> None:
        """Record that ``model_id`` goes on from its checkpoint after ``epoch`` (a retried or
        promoted trial, or one stopped by a notice)."""
        from mopflow.training.trainable.state import global_step, partial_meta

        self.resumed[model_id] = {
            "epoch": epoch,
            "step": global_step(state),
            "after_notice": partial_meta(state) is not None,
        }


def pass_seconds(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Seconds the pass records spent inside their batch loops: training (``loop_s``) and the
    validation that followed (``val_s``); None when no record times its loop (DDP gangs)."""
    timed = [r for r in records if "loop_s" in r]
    if not timed:
        return None
    return float(sum(float(r["loop_s"]) + float(r.get("val_s", 0.0)) for r in timed))


def task_seconds(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Seconds the workers spent inside the records' tasks (from each record's ``start`` to its
    ``end``): the passes and what surrounds them on the worker (the model built, the state
    unpacked and packed, a checkpoint staged); None when no record times its loop."""
    timed = [r for r in records if "loop_s" in r and "start" in r and "end" in r]
    if not timed:
        return None
    return float(sum(max(0.0, float(r["end"]) - float(r["start"])) for r in timed))


def task_parts(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The records' task seconds around their loops, by part: ``setup`` (before the pass: the rows
    loaded, the model built and its state unpacked, or a chain's previous epoch staged),
    ``fit`` (the pass less its loop: the optimizer made and the moments captured, and a Trainer's
    set-up and teardown where the pass fits one) and
    ``pack`` (the state packed at the end); empty when no record times them."""
    timed = [r for r in records if "fit_s" in r and "loop_s" in r]
    if not timed:
        return {}
    return {
        "setup": float(sum(float(r.get("setup_s", 0.0)) for r in timed)),
        "fit": float(sum(max(0.0, float(r["fit_s"]) - float(r["loop_s"])) for r in timed)),
        "pack": float(sum(float(r.get("pack_s", 0.0)) for r in timed)),
    }


def unheard_epoch(model_id: str, meta: Mapping[str, Any], covered: int, heard: int) -> EpochReport | None:
    """The report of the epoch ``covered`` that a checkpoint's state carries (its ``staged_record``
    metadata), when the history heard only up to the epoch before it: an attempt made the state
    the checkpoint and was cut off before it told the epoch. None otherwise."""
    record = meta.get("staged_record")  # units.STAGED_RECORD
    if heard != covered - 1 or not isinstance(record, Mapping) or int(record.get("epoch", -2)) != covered:
        return None
    return EpochReport(
        model_id, covered, float(record["val_acc"]), float(record["train_loss"]), float(record["lr_end"])
    )
