"""Distillation: a small student trained on the ensemble's soft targets plus the hard labels."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from compression.config import DistillConfig
from training.bundle import predict_proba
from training.lit import Classifier, quiet_trainer_kwargs
from training.models import ArchSpec, build_model, count_params, largest_width_within

log = logging.getLogger(__name__)


class StudentBudgetError(ValueError):
    """The student does not fit the parameter budget."""


@dataclass(frozen=True)
class StudentPlan:
    """The student's architecture and the budget it was sized against."""

    arch: ArchSpec
    num_params: int
    budget: int


def plan_student(cfg: DistillConfig, ensemble_params: int, input_dim: int, num_classes: int) -> StudentPlan:
    """Size the student: the configured width, or the largest width within ``ratio x ensemble``."""
    budget = int(cfg.max_param_ratio * ensemble_params)
    width = cfg.width
    if width is None:
        width = largest_width_within(cfg.family, cfg.depth, input_dim, num_classes, budget)
        if width is None:
            raise StudentBudgetError(
                f"no {cfg.family} student of depth {cfg.depth} fits in {budget} parameters "
                f"({cfg.max_param_ratio} x ensemble's {ensemble_params})"
            )
    arch = ArchSpec(cfg.family, width, cfg.depth, input_dim, num_classes)
    n = count_params(arch)
    if n > budget:
        raise StudentBudgetError(
            f"student_width={width} gives {n} parameters; the budget is {budget} "
            f"({cfg.max_param_ratio} x the ensemble's {ensemble_params})"
        )
    return StudentPlan(arch, n, budget)


def soft_targets(teacher: nn.Module, x: np.ndarray, temperature: float) -> torch.Tensor:
    """The teacher's class probabilities at ``temperature`` (computed once, without gradients)."""
    with torch.no_grad():
        xt = torch.as_tensor(x, dtype=torch.float32)
        return torch.cat(
            [teacher(xt[i : i + 4096], temperature=temperature) for i in range(0, len(xt), 4096)]
        )


def train_student(
    plan: StudentPlan,
    cfg: DistillConfig,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    mean: list[float],
    std: list[float],
    teacher: nn.Module | None,
    seed: int,
) -> tuple[nn.Module, list[dict[str, float]]]:
    """Train the student; with ``teacher=None`` it learns from hard labels alone (the baseline)."""
    from training.trial import quiet_lightning

    quiet_lightning()
    pl.seed_everything(seed, workers=False, verbose=False)
    model = build_model(plan.arch, mean, std)
    alpha = cfg.alpha if teacher is not None else 0.0
    module = Classifier(model, lr=cfg.lr, weight_decay=1e-5, temperature=cfg.temperature, alpha=alpha)
    tensors = [torch.from_numpy(x_train), torch.from_numpy(y_train)]
    if teacher is not None:
        tensors.append(soft_targets(teacher, x_train, cfg.temperature))
    loader = DataLoader(
        TensorDataset(*tensors),
        batch_size=cfg.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    val_loader = DataLoader(TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val)), batch_size=4096)
    history: list[dict[str, float]] = []
    started = time.monotonic()

    class Progress(pl.Callback):
        def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            epoch = trainer.current_epoch
            acc = float(trainer.callback_metrics["val_acc"])
            history.append(
                {
                    "epoch": epoch,
                    "val_acc": acc,
                    "train_loss": pl_module.epoch_train_loss(),  # type: ignore[operator]
                }
            )
            if (epoch + 1) % 10 == 0 or epoch + 1 == cfg.epochs:
                log.info(
                    "distill: %s student epoch %d/%d val_acc=%.4f (%.0fs)",
                    "soft-target" if teacher is not None else "hard-label",
                    epoch + 1,
                    cfg.epochs,
                    acc,
                    time.monotonic() - started,
                )

    trainer = pl.Trainer(max_epochs=cfg.epochs, callbacks=[Progress()], **quiet_trainer_kwargs())
    trainer.fit(module, loader, val_loader)
    model.eval()
    return model, history


def student_accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of a model returning scores per class (logits or probabilities)."""
    probs = predict_proba(model, x)
    return float((probs.argmax(dim=1) == torch.as_tensor(y)).float().mean())
