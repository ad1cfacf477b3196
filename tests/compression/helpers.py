"""A separable problem and a plain training loop, for the compression tests that need a model
that has learned something."""

from __future__ import annotations

import numpy as np
import torch

from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import StudentPlan, fit_student, soft_targets
from mopflow.training.compute.devices import CPU, DeviceSpec


def separable_blobs(n: int, seed: int, width: int = 40, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows (float32) around ``classes`` well-apart centres, and their labels."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 3, size=(classes, width))
    y = rng.integers(0, classes, size=n)
    return (centers[y] + rng.normal(size=(n, width))).astype(np.float32), y


def fit(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, steps: int, lr: float = 0.01) -> None:
    """``steps`` full-batch Adam steps of cross-entropy on (``x``, ``y``)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()


def train_student(
    plan: StudentPlan,
    cfg: DistillConfig,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    mean: list[float],
    std: list[float],
    teacher: torch.nn.Module | None,
    seed: int,
    epochs: int | None = None,
    device: DeviceSpec = CPU,
) -> tuple[torch.nn.Module, list[dict[str, float]]]:
    """The student fitted (:func:`~mopflow.compression.distill.distill.fit_student`) on arrays held
    in memory: on the teacher's soft targets at ``cfg.temperature``, or with ``teacher=None`` on
    the hard labels alone; validated on (``x_val``, ``y_val``) as one shard."""
    tensors = [torch.from_numpy(x_train), torch.from_numpy(y_train)]
    if teacher is not None:
        tensors.append(soft_targets(teacher, x_train, cfg.temperature))
    validation = lambda: [(x_val, y_val)]  # noqa: E731
    soft = teacher is not None
    return fit_student(plan, cfg, tensors, validation, mean, std, seed, soft, epochs, device)
