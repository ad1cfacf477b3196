"""Lightning modules: a classifier trained on hard labels, with an optional distillation target."""

from __future__ import annotations

import math
from typing import Any, cast

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.core.optimizer import LightningOptimizer
from torch import nn


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; the run stops at that step."""


class Classifier(pl.LightningModule):
    """Cross-entropy (optionally plus a soft-target distillation term) with AdamW + one-cycle LR.

    Batches are ``(x, y)`` or ``(x, y, soft_targets)``; with soft targets the loss is
    ``alpha * T^2 * KL(soft || softmax(z/T)) + (1 - alpha) * CE(z, y)`` (Hinton et al. 2015).

    Optimization is manual: the same zero_grad / backward / step / per-step scheduler step as
    Lightning's automatic loop, without its closure and per-step hook machinery, which cost
    these small models about a third of each step (benchmarks/overhead.py).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float,
        temperature: float = 1.0,
        alpha: float = 0.0,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay
        self.temperature = temperature
        self.alpha = alpha
        self.last_train_loss = math.nan
        self._loss_sum = 0.0
        self._loss_count = 0
        self.automatic_optimization = False

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
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x)
        return out

    def loss(self, batch: Any) -> torch.Tensor:
        """The training loss of one batch."""
        x, y = batch[0], batch[1]
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if len(batch) > 2 and self.alpha > 0:
            soft = batch[2]
            t = self.temperature
            kd = F.kl_div(F.log_softmax(logits / t, dim=1), soft, reduction="batchmean") * (t * t)
            loss = self.alpha * kd + (1 - self.alpha) * loss
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = cast(LightningOptimizer, self.optimizers())  # one optimizer: never a list
        loss = self.loss(batch)
        value = loss.item()  # one read serves the NaN check and the epoch mean
        if not math.isfinite(value):
            # Stop at the first non-finite step: later steps would only spread NaN into the weights.
            raise NonFiniteLossError(
                f"training loss became {value} at epoch {self.current_epoch}, step {self.global_step}"
            )
        optimizer.zero_grad(set_to_none=True)
        # manual_backward, not loss.backward(): under DDP it prepares the gradient reducer
        self.manual_backward(loss)
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()  # type: ignore[union-attr]
        # Accumulated on the side and logged once per epoch: self.log on every step doubled
        # the per-step cost of these small models.
        self._loss_sum += value
        self._loss_count += 1

    def epoch_train_loss(self) -> float:
        """Mean training loss of the current (or just finished) epoch so far."""
        return self._loss_sum / self._loss_count if self._loss_count else self.last_train_loss

    def on_train_epoch_start(self) -> None:
        self._loss_sum = 0.0
        self._loss_count = 0

    def on_train_epoch_end(self) -> None:
        if self._loss_count:
            self.last_train_loss = self._loss_sum / self._loss_count
            self.log("train_loss", self.last_train_loss, prog_bar=False, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        logits = self(x)
        acc = (logits.argmax(dim=1) == y).float().mean()
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
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=max(total, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def quiet_trainer_kwargs() -> dict[str, Any]:
    """Trainer settings for non-interactive runs: no progress bars, no summaries, no default logger."""
    return {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
