"""Distillation: a small student trained on the ensemble's soft targets plus the hard labels."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mopflow.base import progress
from mopflow.compression.config import DistillConfig
from mopflow.training.compute.devices import CPU, DeviceSpec
from mopflow.training.models.builtin import ArchSpec, build_model, count_params, largest_size_within
from mopflow.training.models.families import DataSpec

log = logging.getLogger(__name__)

# The validation split as ``(features, labels)`` shards, read anew at each call.
ValidationShards = Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]


class StudentBudgetError(ValueError):
    """The student does not fit its budget (parameters or serving latency)."""


# The serving latency of a student of an architecture (registry.latency.architecture_latency,
# with the request bound): injected, so planning stays free of serving and storage.
LatencyOf = Callable[[ArchSpec], Any]


@dataclass(frozen=True)
class StudentPlan:
    """The student's architecture, the parameter budget it was sized against and, under a serving
    budget (``budget_ms``), its measured latency (a :class:`~mopflow.registry.latency.Latency`)."""

    arch: ArchSpec
    num_params: int
    budget: int
    budget_ms: float | None = None
    latency: Any = None


def parameter_budget(cfg: DistillConfig, ensemble_params: int) -> tuple[int, str]:
    """The student's most parameters and where that comes from (for messages)."""
    if cfg.max_params is not None:
        return cfg.max_params, f"student_max_params={cfg.max_params}"
    return int(
        cfg.max_param_ratio * ensemble_params
    ), f"{cfg.max_param_ratio} x the ensemble's {ensemble_params}"


def plan_student(
    cfg: DistillConfig, ensemble_params: int, data: DataSpec, latency: LatencyOf | None = None
) -> StudentPlan:
    """Size the student: the configured size, or the largest size within the parameter budget
    (``student_max_params``, else ``ratio x ensemble``; the family's size parameter, its other
    parameters at their defaults, ``depth`` as set). Under a serving budget (``budget_ms``,
    ``latency`` measures a candidate) the largest size whose p95 fits it too."""
    cfg = cfg.resolved(data.modality, data.ordered)
    budget, source = parameter_budget(cfg, ensemble_params)
    width = cfg.width
    if width is None:
        width = largest_size_within(cfg.family, cfg.student_params(), data, budget)
        if width is None:
            raise StudentBudgetError(
                f"no {cfg.family} student of depth {cfg.depth} fits in {budget} parameters ({source})"
            )
    arch = ArchSpec.of(cfg.family, cfg.student_params(width), data)
    n = count_params(arch)
    if n > budget:
        raise StudentBudgetError(
            f"student_width={width} gives {n} parameters; the budget is {budget} ({source})"
        )
    if cfg.budget_ms is None:
        return StudentPlan(arch, n, budget)
    if latency is None:
        raise ValueError("student_budget_ms is set but no way to measure a student's latency was given")
    arch, measured = _fastest_fit(cfg, data, arch, width, latency)
    return StudentPlan(arch, count_params(arch), budget, cfg.budget_ms, measured)


# A student sized before training fits this share of the serving budget: the trained student is
# timed again once logged, and on a shared machine a second timing of the same model came out up
# to 8% slower than the first (docs/benchmarks.md, "A student for a serving budget").
SIZING_HEADROOM = 0.9


def _fastest_fit(
    cfg: DistillConfig, data: DataSpec, widest: ArchSpec, width: int, latency: LatencyOf
) -> tuple[ArchSpec, Any]:
    """The largest size up to ``width`` whose measured p95 is within :data:`SIZING_HEADROOM` of
    ``cfg.budget_ms`` (a bisection: latency grows with size), with its latency; a configured
    width is only checked."""
    budget_ms = SIZING_HEADROOM * float(cfg.budget_ms or 0.0)
    measured = latency(widest)
    log.info("distill: %s width %d serves in p95 %.2f ms", cfg.family, width, measured.p95_ms)
    if measured.p95_ms <= budget_ms:
        return widest, measured
    from mopflow.training.models.families import get_family

    family = get_family(cfg.family)
    smallest = int(family.params[str(family.size_param)]["low"])
    low = smallest if cfg.width is None else width
    best: tuple[ArchSpec, Any] | None = None
    fastest = (width, measured)
    lo, hi = low, width - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        arch = ArchSpec.of(cfg.family, cfg.student_params(mid), data)
        found = latency(arch)
        log.info("distill: %s width %d serves in p95 %.2f ms", cfg.family, mid, found.p95_ms)
        if found.p95_ms < fastest[1].p95_ms:
            fastest = (mid, found)
        if found.p95_ms <= budget_ms:
            best, lo = (arch, found), mid + 1
        else:
            hi = mid - 1
    if best is None:
        rows = measured.rows
        raise StudentBudgetError(
            f"student_budget_ms={cfg.budget_ms}: no {cfg.family} student of depth {cfg.depth} answers a "
            f"request of {rows} rows within {SIZING_HEADROOM:.0%} of it ({budget_ms:.3g} ms, room for "
            f"timing noise); the fastest, width {fastest[0]}, takes p95 {fastest[1].p95_ms:.2f} ms"
        )
    return best


def soft_targets(teacher: nn.Module, x: np.ndarray, temperature: float) -> torch.Tensor:
    """The teacher's class probabilities at ``temperature`` (computed once, without gradients)."""
    with torch.no_grad():
        xt = torch.as_tensor(x, dtype=torch.float32)
        return torch.cat(
            [teacher(xt[i : i + 4096], temperature=temperature) for i in range(0, len(xt), 4096)]
        )


def matching_epochs(epochs: int, transfer_rows: int, train_rows: int) -> int:
    """Epochs over ``train_rows`` giving as many optimizer steps as ``epochs`` over ``transfer_rows``.

    The hard-label baseline cannot use the synthetic transfer points (they have no true labels),
    so it runs more passes over the real data instead: the same number of steps and the same
    learning-rate schedule as the distilled student. (Fewer steps would flatter distillation.)
    """
    if epochs < 1 or transfer_rows < 1 or train_rows < 1:
        raise ValueError(
            f"epochs={epochs}, transfer_rows={transfer_rows} and train_rows={train_rows} must be >= 1"
        )
    return max(1, round(epochs * transfer_rows / train_rows))


def fit_student(
    plan: StudentPlan,
    cfg: DistillConfig,
    rows: Any,
    validation: ValidationShards,
    mean: list[float],
    std: list[float],
    seed: int,
    soft: bool,
    epochs: int | None = None,
    device: DeviceSpec = CPU,
    on_epoch: Callable[[Mapping[str, Any]], None] | None = None,
) -> tuple[nn.Module, list[dict[str, float]]]:
    """Train the student on ``rows``: ``(x, y)`` or, with ``soft``, ``(x, y, soft targets)``
    tensors, or a :class:`~mopflow.training.data.streaming.StreamedRows` of them read pass by pass. After each
    epoch the student is validated on ``validation()``'s shards, one at a time, and the epoch is
    told to ``on_epoch`` (default :func:`report_epoch`). The model comes back on the CPU."""
    # Lightning is imported where students train (the Dask workers), not by every process that
    # imports this module (the distill stage's coordinator: about 2 s of CPU).
    import pytorch_lightning as pl

    from mopflow.training.data.streaming import StreamedRows
    from mopflow.training.trainable.lit import quiet_lightning
    from mopflow.training.trainable.unit import ModelSpec, TrainableUnit

    quiet_lightning()
    pl.seed_everything(seed, workers=False, verbose=False)
    model = build_model(plan.arch, mean, std)
    n_rows = rows.n_rows if isinstance(rows, StreamedRows) else len(rows[0])
    alpha = cfg.alpha if soft else 0.0
    max_epochs = epochs if epochs is not None else cfg.epochs
    params = {"lr": cfg.lr, "weight_decay": 1e-5, "batch_size": cfg.batch_size}
    spec = ModelSpec("student", params, seed, device)
    total_steps = max_epochs * -(-n_rows // cfg.batch_size)
    unit = TrainableUnit(spec, model, total_steps, cfg.temperature, alpha, plan.arch)
    history: list[dict[str, float]] = []
    started = time.monotonic()
    kind = "soft-target" if soft else "hard-label"
    for epoch in range(max_epochs):  # the same unit, one pass per epoch, as the trials train
        record = unit.train_pass(rows, epoch)
        acc = _validation_accuracy(unit, validation)
        history.append({"epoch": epoch, "val_acc": acc, "train_loss": record.train_loss})
        elapsed = time.monotonic() - started
        (on_epoch or report_epoch)(
            {"student": kind, "epoch": epoch + 1, "epochs": max_epochs, "val_acc": acc, "elapsed_s": elapsed}
        )
    model.cpu().eval()
    return model, history


def report_epoch(event: Mapping[str, Any]) -> None:
    """A student's epoch for the people watching: the soft-target student's progress, and a log
    line every tenth epoch and at the last."""
    if event["student"] == "soft-target":
        progress.publish("distill_epoch", epoch=event["epoch"], epochs=event["epochs"])
    if event["epoch"] % 10 == 0 or event["epoch"] == event["epochs"]:
        log.info(
            "distill: %s student epoch %d/%d val_acc=%.4f (%.0fs)",
            event["student"],
            event["epoch"],
            event["epochs"],
            event["val_acc"],
            event["elapsed_s"],
        )


def _validation_accuracy(unit: Any, validation: ValidationShards) -> float:
    correct = rows = 0
    for x, y in validation():
        correct, rows = correct + unit.correct_rows(x, y), rows + len(y)
    return correct / rows if rows else float("nan")


def transfer_set(
    x_train: np.ndarray,
    y_train: np.ndarray,
    teacher: nn.Module,
    cfg: DistillConfig,
    seed: int,
    data: DataSpec | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The training data plus ``cfg.munge_multiplier`` synthetic points per example, labelled
    with the teacher's class (the soft targets of every point come from the teacher later,
    :func:`soft_targets`): MUNGE points (Bucilua et al. 2006) for tables, mixup of shifted
    examples for images and sequences (``cfg.transfer``; ``data`` gives the shape)."""
    from mopflow.compression.distill.augment import mixup_points
    from mopflow.compression.distill.munge import munge

    data = data or DataSpec(x_train.shape[1], int(y_train.max()) + 1)
    cfg = cfg.resolved(data.modality, data.ordered)
    if cfg.transfer == "munge":
        # Each example's neighbour is its nearest of any class, as MUNGE has it (Bucilua et al.):
        # points between classes are where the teacher's answers teach the student most. Same-class
        # neighbours kept the points inside each class and cost the MNIST-1D student 0.3-0.5
        # points of test accuracy on each seed (docs/benchmarks.md, distillation).
        synthetic = munge(x_train, cfg.munge_multiplier, cfg.munge_swap_prob, cfg.munge_spread, seed)
    else:
        synthetic = mixup_points(
            x_train,
            data.input_shape,
            data.modality,
            cfg.munge_multiplier,
            cfg.mixup_alpha,
            cfg.mixup_shift,
            seed,
        )
    if not len(synthetic):
        return x_train, y_train
    labels = soft_targets(teacher, synthetic, 1.0).argmax(dim=1).numpy().astype(y_train.dtype)
    return np.concatenate([x_train, synthetic]), np.concatenate([y_train, labels])
