"""A student trained in memory on arrays, distilled from a teacher or on hard labels alone: the
distillation benchmark's trainer (``benchmarks/distill.py``), on the pipeline's
:func:`~mopflow.compression.distill.distill.fit_student`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import StudentPlan, ValidationShards, fit_student, soft_targets
from mopflow.training.compute.devices import CPU, DeviceSpec


def held_validation(x_val: np.ndarray, y_val: np.ndarray) -> ValidationShards:
    """A validation split held in memory, as one shard."""
    return lambda: [(x_val, y_val)]


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
    epochs: int | None = None,
    device: DeviceSpec = CPU,
) -> tuple[nn.Module, list[dict[str, float]]]:
    """Train the student on ``device``; with ``teacher=None`` it learns from hard labels alone
    (the baseline). ``epochs`` overrides ``cfg.epochs`` (the baseline uses
    :func:`~mopflow.compression.distill.distill.matching_epochs`).
    The model comes back on the CPU (quantization and the pyfunc run there).
    """
    tensors = [torch.from_numpy(x_train), torch.from_numpy(y_train)]
    if teacher is not None:
        tensors.append(soft_targets(teacher, x_train, cfg.temperature))
    return fit_student(
        plan,
        cfg,
        tensors,
        held_validation(x_val, y_val),
        mean,
        std,
        seed,
        teacher is not None,
        epochs,
        device,
    )
