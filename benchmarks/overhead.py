"""Benchmark of the Lightning training loop's per-step overhead against a plain PyTorch loop.

What is measured
----------------
Small models are where a framework's overhead shows, so both loops train the same small model,
``build_model(ArchSpec("cnn", {"width": 16, "depth": 3}, 40, 10))`` (seeded, so every run starts from the same
weights), on the same data: ``--rows`` rows (default 20,000) of MNIST-1D-like random data
(40 float32 features, 10 classes whose labels come from a fixed random linear teacher), in the
same batches of 64 (``mopflow.training.trainable.batches.Batches`` in the unit's seeded per-epoch order), for
``--epochs`` epochs (default 3), with one torch thread.

* ``lightning``: the product path, ``mopflow.training.trainable.unit.TrainableUnit.train_pass`` once per epoch,
  as every strategy trains (a Lightning ``Trainer`` per pass with the quiet settings, the
  ``Classifier`` module with AdamW and the per-step one-cycle schedule positioned at the unit's
  global step, the optimizer moments carried between passes; manual optimization, which on one
  CPU device with no backward/step hook in use takes the module's fast path; the batches reach
  Lightning in runs of ``BATCH_RUN``, one optimizer step each, so its per-batch loop runs once
  a run).
* ``plain``: the same AdamW and ``OneCycleLR`` (same total steps) in a bare loop over the same
  batches: ``zero_grad(set_to_none=True)``, forward, cross-entropy, backward, ``step``,
  scheduler ``step``.
* ``plain_checks`` (information): ``plain`` plus what ``Classifier.training_step`` adds on top of
  the maths (the ``torch.isfinite(loss)`` check in a Python ``if`` and ``float(loss.detach())``),
  to separate the module's own per-step work from the framework's.

Each loop is timed end to end (every pass / the whole loop, including each Trainer's set-up,
excluding the data creation), divided by the number of optimizer steps. The three loops are run
interleaved ``--repeats`` times (default 3); the figure is the median time per step over the
repeats. ``ratio`` = lightning / plain; target: <= 1.15x. The median time per optimizer step
in the steady state (set-up excluded; a run's interval divided by its batches) is reported too,
and, for information on a shared machine, the ratio of the best repeats and of this process's
CPU time per step (``time.process_time``), which time spent waiting for a CPU taken by other
processes does not inflate.

Output: a plain-text table on stdout, the target line, and every figure in
``benchmarks/results/overhead.json`` (with the CPU count, load averages and the date; ``--out``
names another folder or file, and a ``--quick`` run writes there or into a temporary folder). Timings
are wall-clock on a shared machine: other processes running at the same time inflate them.

Run it from the repository root::

    .venv/bin/python benchmarks/overhead.py            # full: 20,000 rows, 3 epochs, 3 repeats
    .venv/bin/python benchmarks/overhead.py --quick --out /tmp/bench  # smoke test: 2,000 rows, 1 epoch, 1 repeat
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from studies import harness  # noqa: E402
from torch import nn  # noqa: E402

from mopflow.training.models.builtin import ArchSpec, build_model  # noqa: E402
from mopflow.training.trainable.batches import Batches, pass_order  # noqa: E402
from mopflow.training.trainable.lit import BatchRun, quiet_lightning  # noqa: E402
from mopflow.training.trainable.unit import ModelSpec, TrainableUnit  # noqa: E402

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "overhead.json"
ARCH = ArchSpec("cnn", {"width": 16, "depth": 3}, 40, 10)
BATCH_SIZE = 64
LR = 0.01
WEIGHT_DECAY = 1e-5
MODEL_SEED = 0
DATA_SEED = 1234
TARGET_RATIO = 1.15
LOOPS = ("lightning", "plain", "plain_checks")


@dataclass(frozen=True)
class Settings:
    rows: int
    epochs: int
    repeats: int
    quick: bool


@dataclass
class Timing:
    """One timed run of one loop."""

    loop: str
    repeat: int
    steps: int
    total_s: float
    per_step_ms: float
    median_iteration_ms: float
    final_loss: float
    cpu_per_step_ms: float = 0.0  # this process's CPU time per step (time lost to other processes excluded)


arch_params = harness.arch_params


def results_file(out: Path | None, quick: bool) -> Path:
    """Where the JSON goes (:func:`studies.harness.results_file`)."""
    return harness.results_file(out, quick, RESULTS_PATH)


Data = tuple[torch.Tensor, torch.Tensor]


def make_data(rows: int) -> Data:
    """MNIST-1D-like data: 40 float32 features, labels from a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(rows, ARCH.input_dim, generator=generator)
    teacher = torch.randn(ARCH.input_dim, ARCH.num_classes, generator=generator)
    noise = 0.5 * torch.randn(rows, ARCH.num_classes, generator=generator)
    y = (x @ teacher + noise).argmax(dim=1).to(torch.int64)
    return x, y


def make_batches(data: Data, epoch: int, repeat: int) -> Batches:
    """The batches a unit trains on in ``epoch`` (its seeded order), for both loops."""
    return Batches(data, pass_order(DATA_SEED + repeat, epoch, 0, len(data[0])), BATCH_SIZE)


def make_model() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return build_model(ARCH)


class IterationClock(pl.Callback):
    """Start time of every Lightning batch and the optimizer steps it holds (a ``BatchRun``'s
    batches, else 1): the per-step steady-state cost."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.stamps.append(time.perf_counter())
        self.steps.append(len(batch.batches) if isinstance(batch, BatchRun) else 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.stamps.append(time.perf_counter())


def _median_interval_ms(stamps: Sequence[float], steps: Sequence[int] | None = None) -> float:
    """The median time per optimizer step between consecutive stamps (``steps[i]`` steps
    between stamp ``i`` and the next; 1 each by default)."""
    counts = steps or [1] * len(stamps)
    diffs = [(b - a) / n for a, b, n in zip(stamps, stamps[1:], counts, strict=False)]
    return 1000 * statistics.median(diffs) if diffs else float("nan")


def run_lightning(data: Data, epochs: int, repeat: int) -> Timing:
    """The product path: a trainable unit, one Lightning pass per epoch."""
    params = {"lr": LR, "weight_decay": WEIGHT_DECAY, "batch_size": BATCH_SIZE}
    unit = TrainableUnit(ModelSpec("bench", params, DATA_SEED + repeat), make_model(), 0)
    unit.total_steps = epochs * len(make_batches(data, 0, repeat))
    clock = IterationClock()
    started, cpu_started = time.perf_counter(), time.process_time()
    record = None
    for epoch in range(epochs):
        record = unit.train_pass(data, epoch, callbacks=[clock])
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    steps = unit.global_step
    return Timing(
        "lightning",
        repeat,
        steps,
        total,
        1000 * total / steps,
        _median_interval_ms(clock.stamps, clock.steps),
        float(record.train_loss) if record else float("nan"),
        1000 * cpu / steps,
    )


def run_plain(data: Data, epochs: int, repeat: int, checks: bool) -> Timing:
    model = make_model()
    stamps: list[float] = []
    last_loss = float("nan")
    started, cpu_started = time.perf_counter(), time.process_time()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    total_steps = epochs * len(make_batches(data, 0, repeat))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=max(total_steps, 1))
    model.train()
    steps = 0
    for epoch in range(epochs):
        for x, y in make_batches(data, epoch, repeat):
            stamps.append(time.perf_counter())
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            if checks:
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"training loss became {loss.item()}")
                last_loss = float(loss.detach())
            loss.backward()
            optimizer.step()
            scheduler.step()
            steps += 1
    stamps.append(time.perf_counter())
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    if not checks:
        last_loss = float(loss.detach())
    return Timing(
        "plain_checks" if checks else "plain",
        repeat,
        steps,
        total,
        1000 * total / steps,
        _median_interval_ms(stamps),
        last_loss,
        1000 * cpu / steps,
    )


def run(settings: Settings, out: Path | None) -> int:
    torch.set_num_threads(1)
    dataset = make_data(settings.rows)
    runners: dict[str, Callable[[int], Timing]] = {
        "lightning": lambda r: run_lightning(dataset, settings.epochs, r),
        "plain": lambda r: run_plain(dataset, settings.epochs, r, checks=False),
        "plain_checks": lambda r: run_plain(dataset, settings.epochs, r, checks=True),
    }
    # Warm-up (not timed): first-call costs of imports, allocator and kernels hit neither loop.
    warm = (dataset[0][: 4 * BATCH_SIZE], dataset[1][: 4 * BATCH_SIZE])
    run_lightning(warm, 1, -1)
    run_plain(warm, 1, -1, checks=False)
    load_before = list(os.getloadavg())
    timings: list[Timing] = []
    for repeat in range(settings.repeats):
        order = LOOPS if repeat % 2 == 0 else tuple(reversed(LOOPS))  # interleaved, alternating order
        for loop in order:
            timing = runners[loop](repeat)
            timings.append(timing)
            print(
                f"  repeat {repeat + 1}/{settings.repeats} {loop:<13} {timing.steps} steps "
                f"{timing.total_s:.2f}s ({timing.per_step_ms:.3f} ms/step)",
                flush=True,
            )
    load_after = list(os.getloadavg())
    summary: dict[str, dict[str, float]] = {}
    for loop in LOOPS:
        mine = [t for t in timings if t.loop == loop]
        summary[loop] = {
            "per_step_ms_median": statistics.median(t.per_step_ms for t in mine),
            "per_step_ms_min": min(t.per_step_ms for t in mine),
            "cpu_per_step_ms_median": statistics.median(t.cpu_per_step_ms for t in mine),
            "median_iteration_ms_median": statistics.median(t.median_iteration_ms for t in mine),
            "steps": float(mine[0].steps),
        }
    ratio = summary["lightning"]["per_step_ms_median"] / summary["plain"]["per_step_ms_median"]
    ratio_checks = summary["lightning"]["per_step_ms_median"] / summary["plain_checks"]["per_step_ms_median"]
    ratio_iter = (
        summary["lightning"]["median_iteration_ms_median"] / summary["plain"]["median_iteration_ms_median"]
    )
    # Less sensitive to other processes on a shared machine: the best repeat, and CPU time.
    ratio_min = summary["lightning"]["per_step_ms_min"] / summary["plain"]["per_step_ms_min"]
    ratio_cpu = summary["lightning"]["cpu_per_step_ms_median"] / summary["plain"]["cpu_per_step_ms_median"]
    header = (
        f"overhead: {ARCH.family} {arch_params(ARCH)}, {settings.rows} rows, batch "
        f"{BATCH_SIZE}, {settings.epochs} epochs, {settings.repeats} repeats, 1 torch thread, "
        f"{os.cpu_count()} CPUs"
    )
    base = summary["plain"]["per_step_ms_median"]
    cells = [
        [
            loop,
            int(summary[loop]["steps"]),
            f"{summary[loop]['per_step_ms_median']:.3f}",
            f"{summary[loop]['median_iteration_ms_median']:.3f}",
            f"{summary[loop]['per_step_ms_median'] / base:.2f}x",
        ]
        for loop in LOOPS
    ]
    columns = ["loop", "steps", "ms/step (end to end)", "ms/iteration (steady)", "ratio"]
    table = "\n".join(harness.table_lines(columns, cells))
    status = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    target_line = f"{status:<9} Lightning / plain PyTorch per step: {ratio:.2f}x (target <= {TARGET_RATIO}x)"
    info_lines = [
        f"info      Lightning / plain loop with the same NaN check and loss read: {ratio_checks:.2f}x",
        f"info      Lightning / plain, median steady-state iteration (set-up excluded): {ratio_iter:.2f}x",
        f"info      Lightning / plain, best repeat of each: {ratio_min:.2f}x; process CPU time per step: "
        f"{ratio_cpu:.2f}x",
        f"info      load average before / after: {load_before[0]:.1f} / {load_after[0]:.1f} on {os.cpu_count()} CPUs",
    ]
    print()
    print(header)
    print(table)
    print()
    print(target_line)
    for line in info_lines:
        print(line)
    report = {
        "benchmark": "overhead",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pytorch_lightning": pl.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "settings": asdict(settings)
        | {
            "arch": ARCH.to_dict(),
            "batch_size": BATCH_SIZE,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "data": "random normal features, labels = argmax of a fixed random linear teacher + noise",
        },
        "summary": summary,
        "ratio": ratio,
        "ratio_vs_plain_with_checks": ratio_checks,
        "ratio_steady_iteration": ratio_iter,
        "ratio_best_repeat": ratio_min,
        "ratio_cpu_time": ratio_cpu,
        "target": {"bound": TARGET_RATIO, "status": status},
        "timings": [asdict(t) for t in timings],
        "printed": [header, table, target_line, *info_lines],
    }
    harness.write_report(out, report, lead="\n", config=report["settings"])
    return 0


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path]:
    parser = harness.parser(__doc__, "2000 rows, 1 epoch, 1 repeat")
    parser.add_argument("--rows", type=int, default=None, help="training rows (default 20000)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3)")
    args = parser.parse_args(argv)
    rows = args.rows or (2000 if args.quick else 20_000)
    epochs = args.epochs or (1 if args.quick else 3)
    repeats = args.repeats or (1 if args.quick else 3)
    if rows < BATCH_SIZE or epochs < 1 or repeats < 1:
        parser.error(f"--rows must be >= {BATCH_SIZE}; --epochs and --repeats >= 1")
    return Settings(rows, epochs, repeats, args.quick), results_file(args.out, args.quick)


def main(argv: Sequence[str] | None = None) -> int:
    settings, out = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    quiet_lightning()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    return run(settings, out)


if __name__ == "__main__":
    sys.exit(main())
