"""Lightning modules: a classifier trained on hard labels, with an optional distillation target."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; the run stops at that step."""


class Classifier(pl.LightningModule):
    """Cross-entropy (optionally plus a soft-target distillation term) with AdamW + one-cycle LR.

    Batches are ``(x, y)`` or ``(x, y, soft_targets)``; with soft targets the loss is
    ``alpha * T^2 * KL(soft || softmax(z/T)) + (1 - alpha) * CE(z, y)`` (Hinton et al. 2015).
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
        self._loss_sum = torch.zeros(())
        self._loss_count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if len(batch) > 2 and self.alpha > 0:
            soft = batch[2]
            t = self.temperature
            kd = F.kl_div(F.log_softmax(logits / t, dim=1), soft, reduction="batchmean") * (t * t)
            loss = self.alpha * kd + (1 - self.alpha) * loss
        if not torch.isfinite(loss):
            # Stop at the first non-finite step: later steps would only spread NaN into the weights.
            raise NonFiniteLossError(
                f"training loss became {loss.item()} at epoch {self.current_epoch}, step {self.global_step}"
            )
        # Accumulate on the side and log once per epoch: self.log on every step doubled the
        # per-step cost of these small models (benchmarks/overhead.py).
        self._loss_sum = self._loss_sum + loss.detach()
        self._loss_count += 1
        return loss

    def epoch_train_loss(self) -> float:
        """Mean training loss of the current (or just finished) epoch so far."""
        return float(self._loss_sum / self._loss_count) if self._loss_count else self.last_train_loss

    def on_train_epoch_start(self) -> None:
        self._loss_sum = torch.zeros(())
        self._loss_count = 0

    def on_train_epoch_end(self) -> None:
        if self._loss_count:
            mean = self._loss_sum / self._loss_count
            self.last_train_loss = float(mean)
            self.log("train_loss", mean, prog_bar=False, sync_dist=True)

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
