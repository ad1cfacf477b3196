"""Data-parallel SGD with a growing number of workers, optionally on volatile (spot) workers.

After Zhang, Wang, Joshi, Joe-Wong, "Machine Learning on Volatile Instances" (INFOCOM 2020): at
iteration j, ``n_j`` workers (a :class:`~mopflow.training.volatile.schedules.WorkerSchedule`) each compute the gradient
of a mini-batch of ``b`` samples, the parameter server averages them and takes a step whose size is
scaled with the workers (``linear`` / ``sqrt`` / ``none``, :func:`studies.schedules.scaled_step_size`).

**Emulation.** The workers are emulated in one process: worker k's gradient is the gradient of the
mean loss over micro-batch k, and the average of ``y`` such gradients of equal-sized micro-batches is
exactly the gradient of the mean loss over their concatenation (the models here have no batch
statistics). ``emulation="concatenated"`` (default) computes that one gradient in one
forward/backward; ``"per_worker"`` computes each worker's gradient separately and averages them (the
literal parameter-server sum, slower, for checking). This is the emulation issue #8 allows when there
are fewer real processes than workers; it reproduces the maths of synchronous SGD, not its timing.

**Volatility.** With a :class:`Volatility` (a price trace and one bid per worker), time runs in slots of
``iteration_seconds``; in each slot, iteration j's provisioned workers (the first ``n_j`` bids) whose bid
is >= the slot's price are active (``y_j``). Only they contribute micro-batches; a slot with no active
worker is idle: no update, j waits. The run is accounted with :func:`mopflow.training.volatile.cost.account_run` (cost,
active / idle time, wasted work) over the same slots; :mod:`mopflow.training.volatile.growing_report` gives
its cost over time and logs records and account through the :class:`~mopflow.base.tracking.Tracker` protocol.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.models.metrics import top1_accuracy
from mopflow.training.volatile.cost import account_run
from mopflow.training.volatile.price_trace import PriceTrace
from mopflow.training.volatile.prices import PriceError, TraceExhaustedError
from mopflow.training.volatile.run_account import RunAccount
from mopflow.training.volatile.schedules import WorkerSchedule
from studies.schedules import ScalingRule, scaled_step_size, workers_at_iteration

Emulation = Literal["concatenated", "per_worker"]
_ALIGN_TOL = 1e-6  # relative slack when checking that price changes fall on slot boundaries


class GrowingConfig(BaseModel):
    """One data-parallel run with a worker schedule (frozen, validated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: WorkerSchedule = WorkerSchedule()
    iterations: int = Field(1000, ge=1, le=10_000_000, description="J: iterations with an update")
    batch_size: int = Field(8, ge=1, le=65_536, description="b: each worker's micro-batch")
    base_lr: float = Field(
        0.03, gt=0.0, le=1e3, allow_inf_nan=False, description="step size for reference_workers"
    )
    scaling: ScalingRule = "linear"
    reference_workers: int = Field(1, ge=1, description="worker count the base step size is tuned for")
    scale_with: Literal["provisioned", "active"] = Field(
        "provisioned", description="scale the step with n_j (the paper's rule) or with the active y_j"
    )
    momentum: float = Field(0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    iterations_per_epoch: int = Field(1, ge=1, description="per-epoch schedules: iterations in an epoch")
    eval_every: int = Field(0, ge=0, description="evaluate every k iterations (0: only at the end)")
    iteration_seconds: float = Field(
        1.0, gt=0.0, allow_inf_nan=False, description="R: one iteration's (nominal) time, a price slot"
    )
    emulation: Emulation = "concatenated"
    seed: int = Field(0, ge=0)


@dataclass(frozen=True)
class Volatility:
    """Spot prices and bids: worker w (0-based) is active in a slot while the price is <= ``bids[w]``.

    Price changes must fall on slot boundaries (``start + k * iteration_seconds``), as with
    :func:`mopflow.training.volatile.price_trace.sample_price_trace` at ``slot_seconds = iteration_seconds``: a worker then never
    loses an iteration half-way, and :func:`mopflow.training.volatile.cost.account_run` sees the same y_j as training.
    """

    trace: PriceTrace
    bids: tuple[float, ...]
    start: float | None = None  # default: the trace's start

    def __post_init__(self) -> None:
        if not self.bids:
            raise PriceError("bids: need one bid per worker, got none")
        for w, b in enumerate(self.bids):
            if not b >= 0 or math.isnan(b):
                raise PriceError(f"bids[{w}]={b}: a bid must be a number >= 0")

    @property
    def run_start(self) -> float:
        """The trace time of the run's first slot."""
        return self.trace.start if self.start is None else self.start


@dataclass(frozen=True)
class IterationRecord:
    """One time slot: an update with y_j of n_j workers, or an idle slot (``active == 0``)."""

    slot: int  # 0-based time slot (equals iteration - 1 without volatility)
    iteration: int  # j: the iteration this slot ran (or waited for, when idle)
    provisioned: int  # n_j
    active: int  # y_j: workers whose gradients were averaged (0: idle, no update)
    lr: float  # step size used (0.0 when idle)
    loss: float | None  # mean training loss over the active workers' micro-batches (None when idle)
    worker_iterations: int  # cumulative worker-iterations used (sum of y), proportional to cost
    eval_loss: float | None = None
    eval_accuracy: float | None = None


@dataclass(frozen=True)
class GrowingResult:
    """What :func:`train_growing` returns."""

    records: tuple[IterationRecord, ...]
    model: nn.Module
    account: RunAccount | None  # only with volatility
    bids: tuple[float, ...] | None

    @property
    def updates(self) -> tuple[IterationRecord, ...]:
        """The slots that made an update (idle ones left out)."""
        return tuple(r for r in self.records if r.active > 0)

    @property
    def final_accuracy(self) -> float | None:
        """Accuracy at the last evaluation (None without evaluation data)."""
        evaluated = [r.eval_accuracy for r in self.records if r.eval_accuracy is not None]
        return evaluated[-1] if evaluated else None


def aggregated_gradient(
    model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The parameter server's gradient: the mean of each worker's mean-loss gradient (literal emulation)."""
    if not micro_batches:
        raise ValueError("need at least one worker's micro-batch")
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for x, y in micro_batches:
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        for acc, g in zip(total, grads, strict=True):
            acc.add_(g)
    return [g / len(micro_batches) for g in total]


def concatenated_gradient(
    model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The gradient of the mean loss over the concatenated micro-batches (one forward/backward)."""
    if not micro_batches:
        raise ValueError("need at least one worker's micro-batch")
    x = torch.cat([m[0] for m in micro_batches])
    y = torch.cat([m[1] for m in micro_batches])
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), params))


class _SampleStream:
    """Indices from a stream of seeded shuffles of the training set (epochs without replacement)."""

    def __init__(self, n_rows: int, generator: torch.Generator) -> None:
        self.n_rows = n_rows
        self.generator = generator
        self.buffer = torch.empty(0, dtype=torch.long)

    def take(self, count: int) -> torch.Tensor:
        parts = [self.buffer]
        have = len(self.buffer)
        while have < count:
            perm = torch.randperm(self.n_rows, generator=self.generator)
            parts.append(perm)
            have += len(perm)
        pool = torch.cat(parts)
        self.buffer = pool[count:]
        return pool[:count]


def _check_inputs(
    config: GrowingConfig, arch: ArchSpec, x: torch.Tensor, y: torch.Tensor, volatility: Volatility | None
) -> None:
    if x.ndim != 2 or x.shape[1] != arch.input_dim:
        raise ValueError(f"train features have shape {tuple(x.shape)}; expected (rows, {arch.input_dim})")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"train labels have shape {tuple(y.shape)}; expected ({len(x)},)")
    if len(x) < config.batch_size:
        raise ValueError(f"batch_size={config.batch_size} exceeds the {len(x)} training rows")
    if volatility is None:
        return
    if len(volatility.bids) < config.schedule.n_max:
        raise PriceError(
            f"{len(volatility.bids)} bids for a schedule of up to n_max={config.schedule.n_max} workers;"
            " expected one bid per worker"
        )
    start, r = volatility.run_start, config.iteration_seconds
    for t in volatility.trace.times[1:]:
        k = (t - start) / r
        if t > start and abs(k - round(k)) > _ALIGN_TOL * max(1.0, abs(k)):
            raise PriceError(
                f"price change at t={t} falls inside an iteration slot (start {start}, iteration_seconds"
                f" {r}); expected price changes at start + k * iteration_seconds"
            )


def _evaluate(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(data[0])
        loss = float(F.cross_entropy(logits, data[1]))
        accuracy = top1_accuracy(logits, data[1])
    model.train()
    return loss, accuracy


def _active_workers(
    config: GrowingConfig, volatility: Volatility | None, n: int, slot: int, done: int
) -> list[int]:
    """The provisioned workers (the first ``n``) active in ``slot``: those whose bid is >= its price."""
    if volatility is None:
        return list(range(n))
    trace, r = volatility.trace, config.iteration_seconds
    t = volatility.run_start + slot * r
    try:
        price = trace.prices[trace.index_at(t)]
    except TraceExhaustedError as exc:
        raise TraceExhaustedError(
            f"the price trace ends at {trace.end} after {done} of {config.iterations}"
            f" iterations ({slot} slots of {r} s): {exc}"
        ) from exc
    return [w for w in range(n) if price <= volatility.bids[w]]


def _backward(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], emulation: Emulation
) -> float:
    """Put the parameter server's averaged gradient into ``.grad``; returns the mean training loss."""
    if emulation == "concatenated":
        loss = F.cross_entropy(model(torch.cat([m[0] for m in batches])), torch.cat([m[1] for m in batches]))
        loss.backward()
        return float(loss.detach())
    total = 0.0
    for xb, yb in batches:
        worker_loss = F.cross_entropy(model(xb), yb)
        (worker_loss / len(batches)).backward()  # the PS sums gradients / y
        total += float(worker_loss.detach())
    return total / len(batches)


def train_growing(
    config: GrowingConfig,
    arch: ArchSpec,
    train: tuple[torch.Tensor, torch.Tensor],
    eval_data: tuple[torch.Tensor, torch.Tensor] | None = None,
    volatility: Volatility | None = None,
) -> GrowingResult:
    """Train ``arch`` with SGD on ``n_j`` emulated workers per iteration; seeded and deterministic.

    ``train`` and ``eval_data`` are (float features, int64 labels). Each provisioned worker takes the
    next ``batch_size`` indices of a seeded stream of shuffles (so the samples of iteration j do not
    depend on the prices); the active ones' gradients are averaged and the step size is
    ``scaled_step_size(base_lr, n_j (or y_j), scaling, reference_workers)``. With ``volatility``,
    idle slots (no active worker) are recorded with ``active == 0`` and no update, and the run is
    accounted with :func:`mopflow.training.volatile.cost.account_run`.
    """
    x, y = train
    _check_inputs(config, arch, x, y, volatility)
    torch.manual_seed(config.seed)  # the initial weights
    model = build_model(arch, x.mean(0).tolist(), x.std(0).tolist())
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.base_lr, momentum=config.momentum)
    stream = _SampleStream(len(x), torch.Generator().manual_seed(config.seed))
    b = config.batch_size
    records: list[IterationRecord] = []
    used = j = slot = 0
    while j < config.iterations:
        n = workers_at_iteration(config.schedule, j + 1, config.iterations_per_epoch)
        active = _active_workers(config, volatility, n, slot, j)
        if not active:  # idle slot: no update, iteration j + 1 waits
            records.append(IterationRecord(slot, j + 1, n, 0, 0.0, None, used))
            slot += 1
            continue
        j += 1
        indices = stream.take(n * b)  # every provisioned worker's samples, so prices don't change them
        batches = [(x[indices[w * b : (w + 1) * b]], y[indices[w * b : (w + 1) * b]]) for w in active]
        workers = n if config.scale_with == "provisioned" else len(active)
        lr = scaled_step_size(config.base_lr, workers, config.scaling, config.reference_workers)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = _backward(model, batches, config.emulation)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"training loss became {loss} at iteration {j} (lr {lr:g}, {n} workers); lower base_lr"
            )
        optimizer.step()
        used += len(active)
        eval_loss = eval_acc = None
        due = config.eval_every > 0 and j % config.eval_every == 0
        if eval_data is not None and (due or j == config.iterations):
            eval_loss, eval_acc = _evaluate(model, eval_data)
        records.append(IterationRecord(slot, j, n, len(active), lr, loss, used, eval_loss, eval_acc))
        slot += 1
    if volatility is None:
        return GrowingResult(tuple(records), model, None, None)
    bids, account = _account_training(config, volatility, records)
    return GrowingResult(tuple(records), model, account, bids)


def _account_training(
    config: GrowingConfig, volatility: Volatility, records: Sequence[IterationRecord]
) -> tuple[tuple[float, ...], RunAccount]:
    """The bids of the schedule's workers and the run's account over the same slots as training."""
    bids = tuple(volatility.bids[: config.schedule.n_max])
    updates = [rec for rec in records if rec.active > 0]
    account = account_run(
        volatility.trace,
        bids,
        [config.iteration_seconds] * config.iterations,
        provisioned=[rec.provisioned for rec in updates],
        start=volatility.run_start,
    )
    if account.workers_per_unit != tuple(rec.active for rec in updates):
        # cannot happen with aligned slots; guard the invariant
        raise RuntimeError("cost accounting and training disagree on the active workers per iteration")
    return bids, account
