"""Lightning modules: a classifier trained on hard labels, with an optional distillation target."""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.core.optimizer import LightningOptimizer
from torch import nn

from mopflow.training.compute.devices import CPU, DeviceSpec
from mopflow.training.models.metrics import top1_accuracy
from mopflow.training.trainable.schedule import one_cycle


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; the run stops at that step."""


def quiet_lightning() -> None:
    """Lightning's INFO chatter (GPU available, tips) does not belong in task logs."""
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logger = logging.getLogger(name)
        if logger.level != logging.WARNING:  # setLevel clears every logger's cache: once, not per pass
            logger.setLevel(logging.WARNING)


class Classifier(pl.LightningModule):
    """Cross-entropy (optionally plus a soft-target distillation term) with AdamW + one-cycle LR.

    Batches are ``(x, y)`` or ``(x, y, soft_targets)``; with soft targets the loss is
    ``alpha * T^2 * KL(soft || softmax(z/T)) + (1 - alpha) * CE(z, y)`` (Hinton et al. 2015).

    Optimization is manual: the same zero_grad / backward / step / per-step scheduler step as
    Lightning's automatic loop, without its closure and per-step hook machinery, which cost
    these small models about a third of each step (benchmarks/overhead.py).

    On a single device in 32-bit precision, when no callback (nor a subclass) uses the
    backward / optimizer-step hooks, a step goes straight to ``loss.backward()`` and the
    optimizer's own ``step()`` (the fast path): Lightning's wrapper would only call those
    unused hooks, an empty closure and the pass-through profiler around the same two calls.
    The step is still counted in the loop's progress, exactly as the wrapper counts it, so
    ``global_step``, checkpoints and resumption are unchanged. Anything else (DDP, whose
    ``manual_backward`` prepares the gradient reducer; mixed precision; a hook in use) takes
    Lightning's path.

    A batch may be a :class:`BatchRun`: the step then trains each of its batches in turn, one
    optimizer step each (what the trainable unit gives Lightning on one device).
    ``after_batch``, when set, is called after every batch's step.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float,
        temperature: float = 1.0,
        alpha: float = 0.0,
        total_steps: int | None = None,
        start_step: int = 0,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay
        # The schedule's length and position in global steps (training/trainable/schedule.py); None: this
        # fit's own steps (the whole training in one fit).
        self.total_steps = total_steps
        self.start_step = start_step
        self.temperature = temperature
        self.alpha = alpha
        # the epoch a one-pass fit belongs to (errors name it); None: the fit's own epoch count
        self.epoch_label: int | None = None
        self.last_train_loss = math.nan
        # the epoch's loss sum and step count, in a plain list: two nn.Module.__setattr__ calls
        # per step avoided
        self._epoch_loss = [0.0, 0]
        self.automatic_optimization = False
        self._fast: FastStep | None = None  # set at the start of each fit when the fast path applies
        # Lightning's logging of the epoch's loss (loggers, callbacks that monitor it); a caller
        # that reads last_train_loss itself turns it off: it costs a fit about a millisecond
        self.log_train_loss = True
        self.batches_done = 0  # batches trained in the current epoch (a BatchRun counts each of its own)
        # called after each batch's step with batches_done (e.g. to stop a pass at a batch boundary)
        self.after_batch: Callable[[int], None] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets _current_fx_name (a str or None) around every hook call, several times
        # per step; nn.Module.__setattr__ checks each value against parameters, buffers and
        # submodules first. A plain attribute store is what that check ends in for a str.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # On the CPU the batch already is where it must be: skip the per-step walk over it.
        if device.type == "cpu":
            return batch
        if isinstance(batch, BatchRun):
            return BatchRun(
                tuple(super().transfer_batch_to_device(b, device, dataloader_idx) for b in batch.batches)
            )
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x)
        return out

    def loss(self, batch: Any) -> torch.Tensor:
        """The training loss of one batch."""
        x, y = batch[0], batch[1]
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if len(batch) > 2 and self.alpha > 0:
            soft = batch[2]
            t = self.temperature
            kd = F.kl_div(F.log_softmax(logits / t, dim=1), soft, reduction="batchmean") * (t * t)
            loss = self.alpha * kd + (1 - self.alpha) * loss
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for one in batch.batches if isinstance(batch, BatchRun) else (batch,):
            self._train_on(one)
            self.batches_done += 1
            if self.after_batch is not None:
                self.after_batch(self.batches_done)

    def _train_on(self, batch: Any) -> None:
        """One optimizer step on one batch."""
        loss = self.loss(batch)
        value = loss.item()  # one read serves the NaN check and the epoch mean
        if not math.isfinite(value):
            # Stop at the first non-finite step: later steps would only spread NaN into the weights.
            raise NonFiniteLossError(
                f"training loss became {value} at epoch "
                f"{self.current_epoch if self.epoch_label is None else self.epoch_label}, "
                f"step {self.start_step + self._steps_taken()}"
            )
        fast = self._fast
        if fast is not None:
            fast.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            fast.progress.increment_ready()
            fast.optimizer.step()
            fast.progress.increment_completed()
            if fast.scheduler is not None:
                fast.scheduler.step()
        else:
            optimizer = cast(LightningOptimizer, self.optimizers())  # one optimizer: never a list
            optimizer.zero_grad(set_to_none=True)
            # manual_backward, not loss.backward(): under DDP it prepares the gradient reducer
            self.manual_backward(loss)
            optimizer.step()
            scheduler = self.lr_schedulers()
            if scheduler is not None:
                scheduler.step()  # type: ignore[union-attr]
        # Accumulated on the side and logged once per epoch: self.log on every step doubled
        # the per-step cost of these small models.
        epoch_loss = self._epoch_loss
        epoch_loss[0] += value
        epoch_loss[1] += 1

    def _steps_taken(self) -> int:
        """Optimizer steps of this fit (or plain pass) so far."""
        fast = self._fast
        count = getattr(fast.progress, "count", None) if fast is not None else None
        return int(count()) if callable(count) else int(self.global_step)

    def on_train_start(self) -> None:
        self._fast = _fast_step(self)

    def on_train_end(self) -> None:
        self._fast = None

    def epoch_train_loss(self) -> float:
        """Mean training loss of the current (or just finished) epoch so far."""
        total, count = self._epoch_loss
        return float(total / count) if count else self.last_train_loss

    def on_train_epoch_start(self) -> None:
        self._epoch_loss = [0.0, 0]
        self.batches_done = 0

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint taken mid-epoch carries the epoch's loss so far: resumed, the epoch's mean
        # covers all its batches (Lightning does not call on_train_epoch_start on a resumed epoch)
        checkpoint["epoch_train_loss_so_far"] = [float(self._epoch_loss[0]), int(self._epoch_loss[1])]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        total, count = checkpoint.get("epoch_train_loss_so_far", [0.0, 0])
        self._epoch_loss = [float(total), int(count)]

    def on_train_epoch_end(self) -> None:
        total, count = self._epoch_loss
        if count:
            self.last_train_loss = float(total / count)
            if self.log_train_loss:
                self.log("train_loss", self.last_train_loss, prog_bar=False, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        logits = self(x)
        acc = top1_accuracy(logits, y)
        # sync_dist: under DDP each rank validates a slice; the logged value is over all of them.
        self.log("val_acc", acc, on_step=False, on_epoch=True, prog_bar=False, sync_dist=True)
        self.log(
            "val_loss",
            F.cross_entropy(logits, y),
            on_step=False,
            on_epoch=True,
            prog_bar=False,
            sync_dist=True,
        )

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        self.restore_optimizer(optimizer)
        total = (
            self.total_steps if self.total_steps is not None else int(self.trainer.estimated_stepping_batches)
        )
        scheduler = one_cycle(optimizer, self.lr, total, self.start_step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Load saved optimizer state (a resumed model's moments) before the schedule is placed;
        nothing here, a fresh start."""


@dataclass(frozen=True)
class BatchRun:
    """Consecutive batches handed to Lightning as one of its batches: ``Classifier.training_step``
    takes an optimizer step on each in turn, exactly as if each came alone (same steps, same
    schedule, ``global_step`` counts every one). Lightning's loop costs a batch about 0.2 ms of
    bookkeeping (hooks, progress, fetching), which is a third of a small MLP's step on one CPU
    thread; a run of :data:`BATCH_RUN` batches pays it once (``benchmarks/overhead.py``)."""

    batches: tuple[Any, ...]


BATCH_RUN = 8  # batches per BatchRun


class BatchRuns:
    """A pass's batches (any sized iterable of them) in runs of ``length``, the last one shorter
    when they do not divide: what ``Trainer.fit`` is given as the loader."""

    def __init__(self, batches: Any, length: int = BATCH_RUN) -> None:
        if length < 1:
            raise ValueError(f"a batch run holds at least one batch, got length={length}")
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return -(-len(self.batches) // self.length)

    def __iter__(self) -> Iterator[BatchRun]:
        run: list[Any] = []
        for batch in self.batches:
            run.append(batch)
            if len(run) == self.length:
                yield BatchRun(tuple(run))
                run = []
        if run:
            yield BatchRun(tuple(run))


# Lightning inspects training_step's signature on every step (whether it takes batch_idx); a
# function's precomputed ``__signature__`` makes that a lookup (about 15 µs a step saved).
Classifier.training_step.__signature__ = inspect.signature(Classifier.training_step)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FastStep:
    """What the fast path steps: the bare optimizer, its scheduler, and the loop's step counter."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: Any  # the manual-optimization loop's optimizer-step progress (a ``_Progress``)


# Hooks Lightning's optimizer wrapper and ``manual_backward`` run around backward and step.
_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def _fast_step(module: Classifier) -> FastStep | None:
    """The fast path's parts, or None when Lightning's own path is needed (see ``Classifier``)."""
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.profilers import PassThroughProfiler
    from pytorch_lightning.strategies import SingleDeviceStrategy
    from pytorch_lightning.utilities.model_helpers import is_overridden

    trainer = module.trainer
    if (
        type(trainer.strategy) is not SingleDeviceStrategy
        or type(trainer.precision_plugin) is not Precision
        or not isinstance(getattr(trainer, "profiler", None), PassThroughProfiler)
        or trainer.gradient_clip_val
    ):
        return None
    for hook in _STEP_HOOKS:
        if is_overridden(hook, module, pl.LightningModule) or any(
            is_overridden(hook, callback, pl.Callback) for callback in getattr(trainer, "callbacks", [])
        ):
            return None
    optimizers = module.optimizers(use_pl_optimizer=False)
    progress = getattr(
        getattr(getattr(trainer.fit_loop, "epoch_loop", None), "manual_optimization", None),
        "optim_step_progress",
        None,
    )
    if isinstance(optimizers, list) or progress is None:
        return None
    schedulers = module.lr_schedulers()
    if isinstance(schedulers, list):
        return None
    return FastStep(optimizers, schedulers, progress)


CALLBACK_FACTORY_GROUP = "pytorch_lightning.callbacks_factory"
_factory_lookup: list[Any] = []  # the loaded factories, once the lookup is cached


def cache_callback_factories() -> None:
    """Look Lightning's external callback factories up once per process.

    Every ``Trainer`` scans the entry points of every installed distribution for the group
    ``pytorch_lightning.callbacks_factory`` (about 11 ms here); the trainable unit builds a
    Trainer per pass, so the lookup is done once and its factories kept. They are still called
    for every Trainer, so each gets its own callbacks, as without the cache.
    """
    if _factory_lookup:
        return
    from importlib.metadata import entry_points

    from pytorch_lightning.trainer.connectors import callback_connector

    original = callback_connector._load_external_callbacks
    factories = [entry.load() for entry in entry_points(group=CALLBACK_FACTORY_GROUP)]

    def load(group: str) -> list[Any]:
        if group != CALLBACK_FACTORY_GROUP:
            return list(original(group))
        made: list[Any] = []
        for factory in factories:
            callbacks = factory()
            made.extend(callbacks if isinstance(callbacks, list) else [callbacks])
        return made

    callback_connector._load_external_callbacks = load
    _factory_lookup.append(load)


def quiet_trainer_kwargs(device: DeviceSpec = CPU) -> dict[str, Any]:
    """Trainer settings for non-interactive runs on one device (CPU by default): no progress
    bars, no summaries, no default logger."""
    return {
        **device.trainer_kwargs(),
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }


def fit_quietly(trainer: Any, module: Any, batches: Any) -> None:
    """``trainer.fit`` over the batches, without the warnings a trainable unit's pass always raises."""
    with warnings.catch_warnings():  # a pass has no validation loader by design: the unit validates
        warnings.filterwarnings(
            "ignore", message=".*defined a `validation_step` but have no `val_dataloader`"
        )
        # Lightning 2.6's own use of a torch pytree API that torch 2.13 deprecates, raised at
        # every fit: nothing a user can act on
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
        )
        trainer.fit(module, batches)
