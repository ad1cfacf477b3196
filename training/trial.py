"""One trial: train a configuration on the shards, report each epoch, save the model bundle.

Runs on a Dask worker. It talks to the Optuna storage only to report and ask whether to
prune; asking for trials and telling results stays with the coordinator (``search.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

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
    import tempfile

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


CHECKPOINT_FILE = "last.ckpt"


def fetch_checkpoint(spec: TrialSpec, workdir: str) -> str | None:
    """Copy the newest checkpoint of this trial (or of the attempt it retries) to local disk."""
    from infra import storage

    for folder in (spec.checkpoint_uri, spec.resume_from):
        if folder and storage.exists(storage.join(folder, CHECKPOINT_FILE), spec.storage_options):
            if not _checkpoint_matches(spec, folder):
                log.warning(
                    "trial %d: checkpoint in %s is of other params; not resuming from it", spec.number, folder
                )
                continue
            local = os.path.join(workdir, "resume.ckpt")
            with open(local, "wb") as fh:
                fh.write(storage.read_bytes(storage.join(folder, CHECKPOINT_FILE), spec.storage_options))
            return local
    return None


CHECKPOINT_META = "checkpoint.json"


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


def save_checkpoint(trainer: Any, spec: TrialSpec, workdir: str) -> None:
    """Write the trainer's state (weights, optimizer, schedule, loop, history) for this epoch,
    atomically, so a killed worker leaves the previous epoch's checkpoint intact."""
    from infra import storage

    local = os.path.join(workdir, CHECKPOINT_FILE)
    trainer.save_checkpoint(local)
    with open(local, "rb") as fh:
        data = fh.read()
    meta_uri = storage.join(spec.checkpoint_uri, CHECKPOINT_META)
    if not storage.exists(meta_uri, spec.storage_options):
        storage.write_json_atomic(meta_uri, {"params_key": _params_key(spec)}, spec.storage_options)
    storage.write_bytes_atomic(storage.join(spec.checkpoint_uri, CHECKPOINT_FILE), data, spec.storage_options)


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


def train_trial(spec: TrialSpec, reporter: Reporter | None = None) -> TrialResult:
    """Train ``spec.params`` for up to ``spec.epochs`` epochs; never raises for a training failure.

    A NaN/inf loss or any error ends the trial as FAIL with the reason; a pruning decision at
    an epoch boundary ends it as PRUNED.
    """
    started = time.monotonic()
    worker = f"{os.uname().nodename}:{os.getpid()}"
    history: list[dict[str, float]] = []
    saved_at: list[float] = []  # when each checkpoint was written (carried across attempts)
    state: dict[str, int | None] = {
        "pruned_epoch": None,
        "resumed_from_epoch": None,
        "resumed_from_step": None,
        "preempted_at_step": None,
        "resumed_after_notice_at_step": None,
    }
    if notice_received():  # this worker is going away: do not start here
        from distributed import Reschedule

        raise Reschedule()
    workdir = tempfile.mkdtemp(prefix="mopflow-trial-")
    try:
        import pytorch_lightning as pl
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        from training.bundle import save_bundle
        from training.data import load_manifest, load_split
        from training.lit import Classifier, EpochShuffle, quiet_trainer_kwargs
        from training.models import ArchSpec, build_model, count_params

        torch.set_num_threads(spec.torch_threads)
        quiet_lightning()
        log.setLevel(
            logging.INFO
        )  # worker processes default to WARNING; progress is forwarded to the task log
        active: Reporter
        if reporter is not None:
            active = reporter
        else:
            active = (
                OptunaReporter(
                    spec.optuna_storage,
                    spec.study_name,
                    spec.trial_id,
                    make_pruner(spec.pruner, spec.min_resource, spec.epochs),
                )
                if spec.optuna_storage
                else NullReporter()
            )
        manifest = load_manifest(spec.manifest_uri, spec.storage_options)
        resume_path = fetch_checkpoint(spec, workdir)
        cache = shard_cache_dir()
        x_train, y_train = load_split(spec.manifest_uri, "train", spec.storage_options, cache_dir=cache)
        x_val, y_val = load_split(spec.manifest_uri, "validation", spec.storage_options, cache_dir=cache)
        arch = ArchSpec.from_params(spec.params, x_train.shape[1], int(manifest["num_classes"]))
        norm = manifest["normalization"]
        pl.seed_everything(spec.seed, workers=False, verbose=False)
        model = build_model(arch, norm["mean"], norm["std"])
        module = Classifier(
            model, lr=float(spec.params["lr"]), weight_decay=float(spec.params["weight_decay"])
        )
        batch_size = int(spec.params["batch_size"])
        steps_per_epoch = -(-len(x_train) // batch_size)
        # each epoch's order from (seed, epoch): a resumed trial goes on with the batches it had left
        shuffle = EpochShuffle(len(x_train), spec.seed, batch_size)
        train_loader = DataLoader(
            TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            batch_size=batch_size,
            sampler=shuffle,
        )
        val_loader = DataLoader(
            TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val)), batch_size=4096
        )

        class EpochReport(pl.Callback):
            """Reports validation accuracy each epoch, stops the trainer when Optuna prunes, and
            checkpoints each finished epoch (the history travels in the checkpoint)."""

            def state_dict(self) -> dict[str, Any]:
                return {
                    "history": [dict(h) for h in history],
                    "preempted_at_step": state["preempted_at_step"],
                    "saved_at": list(saved_at),
                }

            def on_load_checkpoint(
                self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
            ) -> None:
                # before Lightning draws the first batch (when it sets up the data): the epoch and
                # batch the checkpoint stopped at (one optimizer step per batch)
                shuffle.resume_at(*divmod(int(checkpoint["global_step"]), steps_per_epoch))

            def load_state_dict(self, state_dict: dict[str, Any]) -> None:
                history[:] = [dict(h) for h in state_dict.get("history", [])]
                saved_at[:] = [float(t) for t in state_dict.get("saved_at", [])]
                state["resumed_after_notice_at_step"] = state_dict.get("preempted_at_step")
                if history:
                    state["resumed_from_epoch"] = int(history[-1]["epoch"])
                for h in history:  # a retry is a new Optuna trial: give it the epochs already done
                    active.report(float(h["val_acc"]), int(h["epoch"]))

            def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                if resume_path:
                    state["resumed_from_step"] = int(trainer.global_step)

            def on_train_batch_end(
                self,
                trainer: pl.Trainer,
                pl_module: pl.LightningModule,
                outputs: Any,
                batch: Any,
                batch_idx: int,
            ) -> None:
                if not notice_received():
                    return
                if spec.checkpoint_uri and batch_idx + 1 >= trainer.num_training_batches:
                    # The epoch's last batch: Lightning resumes a checkpoint taken here past the
                    # epoch's end and skips its validation (the epoch would be missing from the
                    # history and the pruner). Its validation comes next; stop after it instead.
                    return
                self._preempt(trainer)

            def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                if trainer.sanity_checking or not spec.checkpoint_uri or state["pruned_epoch"] is not None:
                    return
                if notice_received() and trainer.current_epoch + 1 < spec.epochs:
                    self._preempt(trainer)  # the epoch is validated: its checkpoint resumes at the next
                self._save(trainer)

            def _save(self, trainer: pl.Trainer) -> None:
                saved_at.append(time.time())
                save_checkpoint(trainer, spec, workdir)

            def _preempt(self, trainer: pl.Trainer) -> None:
                """A spot notice: checkpoint this epoch's progress and hand the trial back."""
                state["preempted_at_step"] = int(trainer.global_step)
                if spec.checkpoint_uri:
                    self._save(trainer)
                log.warning(
                    "trial %d: preempted at epoch %d step %d; checkpointed, rescheduling",
                    spec.number,
                    trainer.current_epoch,
                    trainer.global_step,
                )
                raise Preempted(spec.number)

            def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                if trainer.sanity_checking:
                    return
                epoch = trainer.current_epoch
                val_acc = float(trainer.callback_metrics["val_acc"])
                train_loss = pl_module.epoch_train_loss()  # type: ignore[operator]
                history.append({"epoch": epoch, "val_acc": val_acc, "train_loss": train_loss})
                active.report(val_acc, epoch)
                if epoch == 0 or (epoch + 1) % 10 == 0 or epoch + 1 == spec.epochs:
                    log.info(
                        "trial %d: epoch %d/%d val_acc=%.4f", spec.number, epoch + 1, spec.epochs, val_acc
                    )
                if active.should_prune():
                    state["pruned_epoch"] = epoch
                    trainer.should_stop = True

        trainer = pl.Trainer(
            max_epochs=spec.epochs, callbacks=[EpochReport()], **quiet_trainer_kwargs(spec.device)
        )
        if resume_path:
            log.info("trial %d: resuming from checkpoint %s", spec.number, resume_path)
        with heartbeat(active):
            # weights_only: a checkpoint is data, never code (a tampered file is refused)
            trainer.fit(module, train_loader, val_loader, ckpt_path=resume_path, weights_only=True)
        save_bundle(
            spec.bundle_uri,
            [model],
            [arch],
            manifest["feature_columns"],
            extra={"trial": spec.number, "params": spec.params, "manifest_hash": manifest["manifest_hash"]},
            storage_options=spec.storage_options,
        )
        value = history[-1]["val_acc"] if history else None
        if value is None or not np.isfinite(value):
            raise RuntimeError("training produced no finite validation accuracy")
        return TrialResult(
            number=spec.number,
            trial_id=spec.trial_id,
            params=spec.params,
            state="PRUNED" if state["pruned_epoch"] is not None else "COMPLETE",
            value=value,
            history=history,
            bundle_uri=spec.bundle_uri,
            pruned_epoch=state["pruned_epoch"],
            duration_s=time.monotonic() - started,
            worker=worker,
            num_params=count_params(arch),
            resumed_from_epoch=state["resumed_from_epoch"],
            resumed_from_step=state["resumed_from_step"],
            resumed_after_notice_at_step=state["resumed_after_notice_at_step"],
            saved_at=list(saved_at),
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
            history=history,
            bundle_uri=None,
            error=f"{type(exc).__name__}: {exc}",
            duration_s=time.monotonic() - started,
            worker=worker,
            resumed_from_epoch=state["resumed_from_epoch"],
            saved_at=list(saved_at),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
