"""One trial: train a configuration on the shards, report each epoch, save the model bundle.

Runs on a Dask worker. It talks to the Optuna storage only to report and ask whether to
prune; asking for trials and telling results stays with the coordinator (``search.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn, Protocol

import numpy as np

from training.devices import CPU, DeviceSpec
from training.preempt import Preempted, notice_received

log = logging.getLogger(__name__)


class Reporter(Protocol):
    """Receives a trial's per-epoch metric and decides about pruning."""

    def report(self, value: float, step: int) -> None: ...

    def should_prune(self) -> bool: ...


PRUNERS = ("asha", "successive_halving", "hyperband", "median", "none")


def make_pruner(name: str, min_resource: int, max_resource: int | None = None) -> Any:
    """The study's pruner. Workers must build the same one: pruners are not stored in the storage.

    ``asha`` and ``successive_halving`` are the same: Optuna's successive halving is asynchronous
    (ASHA, Li et al. 2020): a trial is compared with those that reached the same rung, without
    waiting for a full bracket. ``max_resource`` (the epoch budget) is needed by ``hyperband``.
    """
    import optuna

    if name == "none":
        return optuna.pruners.NopPruner()
    if name in ("asha", "successive_halving"):
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)
    if name == "hyperband":
        top = max_resource if max_resource is not None else "auto"
        if isinstance(top, int) and top <= min_resource:
            # A single rung: Hyperband degenerates to successive halving at min_resource.
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)
        return optuna.pruners.HyperbandPruner(min_resource=min_resource, max_resource=top, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=max(min_resource - 1, 0))
    raise ValueError(f"unknown pruner {name!r}; expected one of {list(PRUNERS)}")


class OptunaReporter:
    """Reports to a trial in an Optuna storage (opened in the worker process)."""

    def __init__(self, storage_url: str, study_name: str, trial_id: int, pruner: Any) -> None:
        import optuna

        from infra.optuna_storage import make_storage, quiet_optuna

        quiet_optuna()
        study = optuna.load_study(study_name=study_name, storage=make_storage(storage_url), pruner=pruner)
        self._trial = optuna.trial.Trial(study, trial_id)

    def report(self, value: float, step: int) -> None:
        self._trial.report(value, step)

    def should_prune(self) -> bool:
        return bool(self._trial.should_prune())

    def heartbeat_thread(self) -> Any:
        """Optuna's heartbeat thread for this trial (a no-op one when the storage keeps none)."""
        from optuna.storages._heartbeat import get_heartbeat_thread

        return get_heartbeat_thread(self._trial._trial_id, self._trial.study._storage)


class NullReporter:
    """Never prunes; used when training outside a study."""

    def report(self, value: float, step: int) -> None:
        return None

    def should_prune(self) -> bool:
        return False


def shard_cache_dir() -> str:
    """Where a worker caches remote shards on its local disk (``MOPFLOW_SHARD_CACHE``)."""

    return os.environ.get("MOPFLOW_SHARD_CACHE") or os.path.join(tempfile.gettempdir(), "mopflow-shard-cache")


def quiet_lightning() -> None:
    """Lightning's INFO chatter (GPU available, tips) does not belong in task logs."""
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class TrialSpec:
    """Everything a worker needs to train one trial (small and picklable)."""

    number: int
    trial_id: int
    params: dict[str, Any]
    epochs: int
    seed: int
    manifest_uri: str
    bundle_uri: str
    study_name: str = ""
    optuna_storage: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    torch_threads: int = 1
    pruner: str = "asha"
    min_resource: int = 1
    checkpoint_uri: str = ""  # folder of this trial's last epoch checkpoint ("" = no checkpoints)
    resume_from: str = ""  # checkpoint folder of an earlier attempt at the same params (a retry)
    device: DeviceSpec = CPU  # where it trains (submitted with the device's Dask resources)


@dataclass
class TrialResult:
    """What a trial produced. ``state`` is COMPLETE, PRUNED or FAIL."""

    number: int
    trial_id: int
    params: dict[str, Any]
    state: str
    value: float | None
    history: list[dict[str, float]]
    bundle_uri: str | None
    pruned_epoch: int | None = None
    error: str | None = None
    duration_s: float = 0.0
    worker: str = ""
    num_params: int = 0
    resumed_from_epoch: int | None = None  # the epoch a retried trial resumed after
    resumed_from_step: int | None = None  # the optimizer step it resumed at (mid-epoch after a notice)
    resumed_after_notice_at_step: int | None = None  # set when the checkpoint was written on a spot notice
    saved_at: list[float] = field(default_factory=list)  # wall-clock times of its checkpoints (all attempts)
    redone_s: float = 0.0  # work lost with preempted/killed workers and done again (set by the coordinator)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CHECKPOINT_FILE = "last.safetensors"  # the unit's exported state (training/unit.py)
CHECKPOINT_META = "checkpoint.json"


def fetch_checkpoint(spec: TrialSpec) -> bytes | None:
    """The newest checkpoint of this trial (or of the attempt it retries), when it holds a run of
    these params on this data."""
    from infra import storage

    for folder in (spec.checkpoint_uri, spec.resume_from):
        if folder and storage.exists(storage.join(folder, CHECKPOINT_FILE), spec.storage_options):
            if not _checkpoint_matches(spec, folder):
                log.warning(
                    "trial %d: checkpoint in %s is of other params; not resuming from it", spec.number, folder
                )
                continue
            return storage.read_bytes(storage.join(folder, CHECKPOINT_FILE), spec.storage_options)
    return None


def _params_key(spec: TrialSpec) -> str:
    from infra import storage

    return storage.canonical_hash(
        {"params": spec.params, "study": spec.study_name, "manifest": spec.manifest_uri}
    )


def _checkpoint_matches(spec: TrialSpec, folder: str) -> bool:
    """Whether a checkpoint folder holds a run of these params on this data (a study recreated
    under the same name would otherwise resume another configuration's weights)."""
    from infra import storage

    meta_uri = storage.join(folder, CHECKPOINT_META)
    if not storage.exists(meta_uri, spec.storage_options):
        return False
    return bool(storage.read_json(meta_uri, spec.storage_options).get("params_key") == _params_key(spec))


def save_checkpoint(spec: TrialSpec, state: bytes) -> None:
    """Write the unit's state (weights, optimizer, schedule and pass position, history),
    atomically, so a killed worker leaves the previous checkpoint intact."""
    from infra import storage

    meta_uri = storage.join(spec.checkpoint_uri, CHECKPOINT_META)
    if not storage.exists(meta_uri, spec.storage_options):
        storage.write_json_atomic(meta_uri, {"params_key": _params_key(spec)}, spec.storage_options)
    storage.write_bytes_atomic(
        storage.join(spec.checkpoint_uri, CHECKPOINT_FILE), state, spec.storage_options
    )


@contextlib.contextmanager
def heartbeat(reporter: Reporter) -> Iterator[None]:
    """Beat for the trial while it trains, when its storage keeps heartbeats (RDB storages)."""
    beat = getattr(reporter, "heartbeat_thread", None)
    thread = beat() if beat is not None else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        if thread is not None:
            thread.join()


def _reporter(spec: TrialSpec, reporter: Reporter | None) -> Reporter:
    if reporter is not None:
        return reporter
    if not spec.optuna_storage:
        return NullReporter()
    pruner = make_pruner(spec.pruner, spec.min_resource, spec.epochs)
    return OptunaReporter(spec.optuna_storage, spec.study_name, spec.trial_id, pruner)


@dataclass
class _Progress:
    """A trial's history and resumption facts, carried in its checkpoints across attempts."""

    history: list[dict[str, float]] = field(default_factory=list)
    saved_at: list[float] = field(default_factory=list)  # when each checkpoint was written
    pruned_epoch: int | None = None
    resumed_from_epoch: int | None = None
    resumed_from_step: int | None = None
    resumed_after_notice_at_step: int | None = None

    def meta(self, preempted_at_step: int | None = None) -> dict[str, Any]:
        return {
            "history": [dict(h) for h in self.history],
            "saved_at": list(self.saved_at),
            "preempted_at_step": preempted_at_step,
        }

    def resume(self, meta: Mapping[str, Any], global_step: int) -> None:
        self.history[:] = [dict(h) for h in meta.get("history", [])]
        self.saved_at[:] = [float(t) for t in meta.get("saved_at", [])]
        self.resumed_after_notice_at_step = meta.get("preempted_at_step")
        self.resumed_from_step = global_step
        if self.history:
            self.resumed_from_epoch = int(self.history[-1]["epoch"])


def train_trial(spec: TrialSpec, reporter: Reporter | None = None) -> TrialResult:
    """Train ``spec.params`` for up to ``spec.epochs`` epochs; never raises for a training failure.

    Each epoch is one pass of the trainable unit (``training/unit.py``) over every training
    shard, then validation, a report, the pruner's decision and a checkpoint. A NaN/inf loss or
    any error ends the trial as FAIL with the reason; a pruning decision ends it as PRUNED. A
    spot notice checkpoints at the next batch boundary and hands the trial back to Dask.
    """
    started = time.monotonic()
    worker = f"{os.uname().nodename}:{os.getpid()}"
    progress = _Progress()
    if notice_received():  # this worker is going away: do not start here
        from distributed import Reschedule

        raise Reschedule()
    try:
        import torch

        from training.bundle import save_bundle
        from training.data import load_manifest
        from training.executors.units import load_eval_split, load_partition
        from training.models import count_params
        from training.schedule import steps_per_epoch
        from training.unit import DataRef, ModelSpec, PassInterrupted, TrainableUnit

        torch.set_num_threads(spec.torch_threads)
        quiet_lightning()
        # worker processes default to WARNING; progress is forwarded to the task log
        log.setLevel(logging.INFO)
        active = _reporter(spec, reporter)
        manifest = load_manifest(spec.manifest_uri, spec.storage_options)
        data = DataRef(spec.manifest_uri, dict(spec.storage_options), shard_cache_dir())
        shards = sorted(e["name"] for e in manifest["splits"]["train"])
        x, y = load_partition(data, shards, str(spec.device.torch_device()))
        x_val, y_val = load_eval_split(data, "validation")
        model = ModelSpec(f"trial-{spec.number:04d}", spec.params, spec.seed, spec.device)
        total_steps = spec.epochs * steps_per_epoch([len(x)], int(spec.params["batch_size"]))
        unit = TrainableUnit.build(model, manifest, total_steps)
        checkpoint = fetch_checkpoint(spec)
        if checkpoint is not None:
            progress.resume(unit.import_state(checkpoint), unit.global_step)
            log.info("trial %d: resuming at step %d from its checkpoint", spec.number, unit.global_step)
            for h in progress.history:  # a retry is a new Optuna trial: give it the epochs already done
                active.report(float(h["val_acc"]), int(h["epoch"]))

        def preempt_now() -> NoReturn:
            """A spot notice: checkpoint where the unit is and hand the trial back."""
            if spec.checkpoint_uri:
                progress.saved_at.append(time.time())
                save_checkpoint(spec, unit.export_state(progress.meta(preempted_at_step=unit.global_step)))
            log.warning(
                "trial %d: preempted at step %d; checkpointed, rescheduling", spec.number, unit.global_step
            )
            raise Preempted(spec.number)

        part = ",".join(shards)
        with heartbeat(active):
            for epoch in range(len(progress.history), spec.epochs):
                try:
                    record = unit.train_pass((x, y), epoch, 0, part, stop=notice_received)
                except PassInterrupted:
                    preempt_now()
                val_acc = unit.evaluate(x_val, y_val)
                progress.history.append({"epoch": epoch, "val_acc": val_acc, "train_loss": record.train_loss})
                active.report(val_acc, epoch)
                if epoch == 0 or (epoch + 1) % 10 == 0 or epoch + 1 == spec.epochs:
                    log.info(
                        "trial %d: epoch %d/%d val_acc=%.4f", spec.number, epoch + 1, spec.epochs, val_acc
                    )
                if active.should_prune():
                    progress.pruned_epoch = epoch
                    break
                if notice_received() and epoch + 1 < spec.epochs:
                    preempt_now()  # the epoch is validated: its checkpoint resumes at the next
                if spec.checkpoint_uri:
                    progress.saved_at.append(time.time())
                    save_checkpoint(spec, unit.export_state(progress.meta()))
        save_bundle(
            spec.bundle_uri,
            [unit.model],
            [unit.arch],
            manifest["feature_columns"],
            extra={"trial": spec.number, "params": spec.params, "manifest_hash": manifest["manifest_hash"]},
            storage_options=spec.storage_options,
        )
        value = progress.history[-1]["val_acc"] if progress.history else None
        if value is None or not np.isfinite(value):
            raise RuntimeError("training produced no finite validation accuracy")
        return TrialResult(
            number=spec.number,
            trial_id=spec.trial_id,
            params=spec.params,
            state="PRUNED" if progress.pruned_epoch is not None else "COMPLETE",
            value=value,
            history=progress.history,
            bundle_uri=spec.bundle_uri,
            pruned_epoch=progress.pruned_epoch,
            duration_s=time.monotonic() - started,
            worker=worker,
            num_params=count_params(unit.arch),
            resumed_from_epoch=progress.resumed_from_epoch,
            resumed_from_step=progress.resumed_from_step,
            resumed_after_notice_at_step=progress.resumed_after_notice_at_step,
            saved_at=list(progress.saved_at),
        )
    except Preempted as exc:
        from distributed import Reschedule

        raise Reschedule() from exc  # Dask runs it again elsewhere; it resumes from the checkpoint
    except Exception as exc:  # a failed trial is a result, not a crash of the sweep
        log.warning("trial %d failed: %s", spec.number, exc)
        return TrialResult(
            number=spec.number,
            trial_id=spec.trial_id,
            params=spec.params,
            state="FAIL",
            value=None,
            history=progress.history,
            bundle_uri=None,
            error=f"{type(exc).__name__}: {exc}",
            duration_s=time.monotonic() - started,
            worker=worker,
            resumed_from_epoch=progress.resumed_from_epoch,
            saved_at=list(progress.saved_at),
        )
