"""A pass without a Lightning Trainer: the same steps as the Trainer's fast path, none of its set-up.

On one device in 32-bit precision the Trainer adds nothing to a pass of the trainable unit: its
fast path (``Classifier``'s docstring) already calls ``loss.backward()`` and the optimizer's own
``step()``. What it does cost is the set-up and teardown of a Trainer per pass, about 4 ms on a
CPU (``benchmarks/small_units.py``): nothing beside a 130-ms pass, a quarter of a GPU's 15-ms
one. :func:`plain_pass` runs the module's own hooks and steps in the order the Trainer runs them,
so a pass gives the same weights, moments, loss and step count bit for bit
(``tests/training/trainable/test_loop.py``); DDP, mixed precision and passes with Lightning
callbacks still fit a Trainer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mopflow.training.compute.devices import DeviceSpec


class StepCount:
    """Optimizer steps taken in a pass, counted as the Trainer's step progress counts them."""

    def __init__(self) -> None:
        self.completed = 0

    def increment_ready(self) -> None:
        """A step is about to be taken (Lightning's progress marks it ready; nothing to count)."""

    def increment_completed(self) -> None:
        self.completed += 1

    def count(self) -> int:
        return self.completed


def plain_pass(module: Any, batches: Iterable[Any], steps: StepCount, device: Any) -> None:
    """Train ``module`` (a :class:`~mopflow.training.trainable.lit.Classifier`) one pass over
    ``batches`` on ``device``: its optimizer and schedule from ``configure_optimizers``, then
    ``on_train_epoch_start``, ``training_step`` on every batch, ``on_train_epoch_end``; each step
    counted in ``steps``. Errors of a step (a non-finite loss, a stop) end the pass as they would
    end a fit."""
    import torch

    from mopflow.training.trainable.lit import FastStep

    if device.type != "cpu":  # a CPU module is there already (moving it still walks every module)
        module.to(device)
    configured = module.configure_optimizers()
    module._fast = FastStep(configured["optimizer"], configured["lr_scheduler"]["scheduler"], steps)
    module.train()
    try:
        with torch.enable_grad():
            module.on_train_epoch_start()
            for index, batch in enumerate(batches):
                module.training_step(batch, index)
            module.on_train_epoch_end()
    finally:
        module._fast = None


@dataclass(frozen=True)
class TrainerSteps:
    """The optimizer steps a Lightning fit of ``module`` has taken so far."""

    module: Any

    def count(self) -> int:
        return int(self.module.trainer.global_step)


def trainer_pass(
    module: Any,
    batches: Any,
    device: DeviceSpec,
    callbacks: Sequence[Any],
    trainer_kwargs: Mapping[str, Any] | None,
    in_runs: bool,
) -> int:
    """The pass fitted by a Lightning Trainer on ``device`` with the caller's ``callbacks`` and
    ``trainer_kwargs``; ``in_runs``: the batches reach Lightning in runs (rows held in memory on
    one device). Returns the optimizer steps the fit took."""
    import pytorch_lightning as pl

    from mopflow.training.trainable.lit import (
        BATCH_RUN,
        BatchRuns,
        cache_callback_factories,
        fit_quietly,
        quiet_trainer_kwargs,
    )

    cache_callback_factories()
    trainer = pl.Trainer(
        max_epochs=1,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **{**quiet_trainer_kwargs(device), **dict(trainer_kwargs or {})},
    )
    # Runs on one device, of rows held in memory: DDP's reducer expects one backward per
    # forward, and a run of streamed batches would hold 8 (and the fetcher 8 more) at once.
    if in_runs and not trainer_kwargs:
        batches = BatchRuns(batches, BATCH_RUN)
    fit_quietly(trainer, module, batches)
    return int(trainer.global_step)
