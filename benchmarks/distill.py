"""Benchmark of ensemble distillation and compression on MNIST-1D (CPU, real training, no downloads).

What is measured
----------------
1. Data. Default MNIST-1D (``DataConfig()``: 5000 generated samples, seed 42, 4 training shards)
   is sharded into a temporary data root with ``mopflow.training.data.shard_dataset`` on a 2-worker Dask
   ``LocalCluster`` (``mopflow.training.compute.cluster.dask_client("", 2)``).
2. Teacher. ``--members`` CNN ensemble members (default 4) with fixed, known-good configurations
   (two architectures, two seeds each; see ``MEMBER_CONFIGS``) are trained for ``--epochs``
   epochs (default 80) by ``mopflow.training.executors.task.TaskExecutor`` on the Dask workers (an epoch
   per task, as the search's ``task`` strategy trains; no Optuna storage). The COMPLETE members are combined with
   ``mopflow.compression.ensemble.build_ensemble`` into a ``ProbabilityEnsemble`` (equal weights); the
   cluster is closed before the students are trained.
3. Students. ``plan_student(DistillConfig(epochs=...), ensemble_params, DataSpec.from_manifest(manifest))`` sizes a CNN
   student to at most 10% of the ensemble's parameters (the pipeline's ``DistillConfig``
   defaults otherwise: T, alpha, MUNGE multiplier, lr, batch size). The teacher is the ensemble
   in the form ``mopflow.compression.ensemble.faster_form`` picks (member loop or ``StackedEnsemble``,
   whichever is faster here, as in the pipeline). The transfer set is built as in the pipeline
   (``mopflow.compression.distill.distill.transfer_set``: the training split plus ``munge_multiplier`` MUNGE
   points per example labelled by the teacher). For each of ``--seeds`` seeds (default 3; the seed also draws the transfer set's MUNGE points) the
   same student architecture is trained twice, in this process (one torch thread), with
   ``studies.student.train_student``: (a) distilled on the transfer set (soft targets at T
   with weight alpha plus hard labels), and (b) on the real training rows with hard labels
   alone (``teacher=None``) for ``matching_epochs`` epochs: as many optimizer steps, hence the
   same one-cycle schedule, as (a). Both use the manifest's normalisation. Each distilled
   student is quantized with ``mopflow.compression.evaluate.quantize_static_int8`` (static INT8 of every
   convolution and the head, ReLU fused, fbgemm-packed, calibrated on 2048 training rows;
   dynamic INT8 converts only Linear layers). The ensemble is trained once and kept fixed
   across student seeds.
4. Figures. Test accuracy (1000 test rows), parameter count, serialised size
   (``serialized_bytes``) and single-thread CPU latency (``latency_ms`` on random inputs, batch 1
   and batch 256; ``--repeats`` forward passes per figure, taken in 5 round-robin passes over all
   models and reported as the median over the passes, so load drift hits every row alike) of: the ensemble as the loop
   ``ProbabilityEnsemble`` and as the vmapped ``StackedEnsemble``, the best single member (by
   validation accuracy), the distilled student, the hard-label student and the INT8 student.
   Every model is timed as a probability-returning module: the students are wrapped in
   ``ProbabilityEnsemble([student])`` (the INT8 student too), so all rows include the same
   softmax. Student accuracies in the table are the means over the seeds; latencies are those of
   the first seed's models (the architecture, hence the cost, is the same for every seed).
   Per-seed figures are in the JSON.

Targets (each printed as PASS/FAIL)
-----------------------------------
* recovered gain = (distilled acc - hard-label acc) / (ensemble acc - hard-label acc) >= 0.80,
  on the seed means; UNDEFINED when the ensemble is not more accurate than the hard-label
  student (there is no gain to recover).
* student parameters <= 10% of the ensemble's.
* student >= 5x faster than the ensemble at batch 256, against the *faster* of the two ensemble
  forms (loop or stacked).
* INT8 student >= 2x faster than the fp32 student at batch 256, losing < 0.5 points of test
  accuracy (mean over seeds).
The stacked-vs-loop ensemble latency ratio is printed for information only.

Output: a plain-text table on stdout, the target lines, and every figure in
``benchmarks/results/distill.json`` (with the CPU count, load averages and the date; ``--out``
names another folder or file, and a ``--quick`` run writes there or into a temporary folder). Latencies
are wall-clock on a shared machine: other processes running at the same time inflate them.

Run it from the repository root::

    .venv/bin/python benchmarks/distill.py                # full: 4 members x 80 epochs, students on the DistillConfig defaults
    .venv/bin/python benchmarks/distill.py --seeds 5      # students repeated over 5 seeds (default 3)
    .venv/bin/python benchmarks/distill.py --quick --out /tmp/bench  # smoke test: 2 members, 2 epochs, 2 student epochs
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from studies import harness  # noqa: E402
from studies.student import train_student  # noqa: E402
from torch import nn  # noqa: E402

from mopflow.compression.config import DistillConfig  # noqa: E402
from mopflow.compression.distill.distill import (  # noqa: E402
    StudentPlan,
    matching_epochs,
    plan_student,
    transfer_set,
)
from mopflow.compression.ensemble import Candidate, build_ensemble, faster_form  # noqa: E402
from mopflow.compression.evaluate import format_table, latency_ms, quantize_static_int8, serialized_bytes  # noqa: E402
from mopflow.training.compute.cluster import dask_client  # noqa: E402
from mopflow.training.data import load_manifest, load_split, shard_dataset  # noqa: E402
from mopflow.training.data.config import DataConfig  # noqa: E402
from mopflow.training.models.builtin import ArchSpec  # noqa: E402
from mopflow.training.models.bundle import ProbabilityEnsemble, StackedEnsemble  # noqa: E402
from mopflow.training.models.bundle import accuracy as student_accuracy  # noqa: E402
from mopflow.training.models.families import DataSpec  # noqa: E402
from mopflow.training.search.trial import TrialResult  # noqa: E402

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "distill.json"
N_DASK_WORKERS = 2
TRAIN_THREADS = 1
MAX_PARAM_RATIO = 0.10
RECOVERED_GAIN_TARGET = 0.80
STUDENT_SPEEDUP_TARGET = 5.0
INT8_SPEEDUP_TARGET = 2.0
INT8_MAX_LOSS_POINTS = 0.5

# Known-good CNN configurations (MNIST-1D), two architectures with two seeds each.
MEMBER_CONFIGS: tuple[tuple[dict[str, Any], int], ...] = (
    (
        {"family": "cnn", "width": 64, "depth": 3, "lr": 0.01, "weight_decay": 1e-5, "batch_size": 128},
        0,
    ),
    (
        {"family": "cnn", "width": 64, "depth": 3, "lr": 0.01, "weight_decay": 1e-5, "batch_size": 128},
        1,
    ),
    (
        {"family": "cnn", "width": 48, "depth": 4, "lr": 0.015, "weight_decay": 1e-5, "batch_size": 128},
        2,
    ),
    (
        {"family": "cnn", "width": 48, "depth": 4, "lr": 0.015, "weight_decay": 1e-5, "batch_size": 128},
        3,
    ),
)

log = logging.getLogger("benchmarks.distill")

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Settings:
    """The run's sizes (full or ``--quick``)."""

    members: int
    epochs: int
    student_epochs: int
    seeds: int
    repeats: int
    quick: bool


@dataclass
class StudentRun:
    """One seed's students and their test accuracies."""

    seed: int
    distilled: nn.Module
    hard: nn.Module
    int8: nn.Module
    distilled_acc: float
    hard_acc: float
    int8_acc: float
    distilled_val_acc: float
    hard_val_acc: float
    distilled_train_s: float
    hard_train_s: float
    hard_epochs: int


arch_params = harness.arch_params


def results_file(out: Path | None, quick: bool) -> Path:
    """Where the JSON goes (:func:`studies.harness.results_file`)."""
    return harness.results_file(out, quick, RESULTS_PATH)


def n_params(module: nn.Module) -> int:
    """Trainable parameters of a module."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def train_members(settings: Settings, data_root: str) -> tuple[str, list[TrialResult], float, float]:
    """Shard MNIST-1D and train the ensemble members on a 2-worker Dask LocalCluster with the
    ``task`` executor (an epoch per Dask task, as the search trains trials)."""
    from mopflow.training.executors import DataRef, ModelSpec
    from mopflow.training.executors.task import TaskExecutor
    from mopflow.training.executors.units import state_to_bundle
    from mopflow.training.models.builtin import count_params

    with dask_client("", N_DASK_WORKERS) as client:
        started = time.monotonic()
        shard = shard_dataset(DataConfig(), data_root, client)
        shard_s = time.monotonic() - started
        log.info("sharded MNIST-1D in %.1fs: %s", shard_s, shard.manifest_uri)
        data = DataRef.open(shard.manifest_uri)
        manifest = load_manifest(shard.manifest_uri)
        shards = [e["name"] for e in manifest["splits"]["train"]]
        specs = [
            ModelSpec(f"member-{i}", dict(params), seed)
            for i, (params, seed) in enumerate(MEMBER_CONFIGS[: settings.members])
        ]
        started = time.monotonic()
        executor = TaskExecutor(client, data, shards)
        outcomes = executor.run(specs, settings.epochs)
        train_s = time.monotonic() - started
    results: list[TrialResult] = []
    for i, spec in enumerate(specs):
        outcome = outcomes[spec.model_id]
        ok = outcome.error is None and outcome.state is not None and outcome.history
        bundle = os.path.join(data_root, "bundles", spec.model_id)
        arch = ArchSpec.from_params(spec.params, DataSpec.from_manifest(manifest))
        results.append(
            TrialResult(
                number=i,
                params=dict(spec.params),
                state="COMPLETE" if ok else "FAIL",
                value=outcome.history[-1].val_acc if ok else None,
                history=[{"epoch": r.epoch, "val_acc": r.val_acc} for r in outcome.history],
                bundle_uri=state_to_bundle(spec, outcome.state or b"", data, bundle) if ok else None,
                error=outcome.error,
                duration_s=train_s,
                worker=", ".join(
                    sorted({str(r["worker"]) for r in executor.records if r["model"] == spec.model_id})
                ),
                num_params=count_params(arch),
            )
        )
    for r in results:
        log.info(
            "member %d: %s val_acc=%s (%s)",
            r.number,
            r.state,
            f"{r.value:.4f}" if r.value is not None else "-",
            r.error or r.worker,
        )
    return shard.manifest_uri, results, shard_s, train_s


def train_students(
    settings: Settings,
    plan: StudentPlan,
    dcfg: DistillConfig,
    teacher: nn.Module,
    data: dict[str, tuple[np.ndarray, np.ndarray]],
    norm: dict[str, list[float]],
) -> list[StudentRun]:
    """For each seed: the distilled student, the hard-label student and the INT8 distilled student."""
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = data["train"], data["validation"], data["test"]
    runs = []
    for seed in range(settings.seeds):
        # The student's seed decides its transfer set too (as in the pipeline: the training data
        # plus MUNGE points labelled by the teacher), besides its initialisation and batch order.
        x_transfer, y_transfer = transfer_set(x_train, y_train, teacher, dcfg, seed, plan.arch.data)
        # The baseline gets as many optimizer steps (the same schedule) on the real data alone.
        hard_epochs = matching_epochs(dcfg.epochs, len(x_transfer), len(x_train))
        started = time.monotonic()
        distilled, _ = train_student(
            plan, dcfg, x_transfer, y_transfer, x_val, y_val, norm["mean"], norm["std"], teacher, seed
        )
        distilled_s = time.monotonic() - started
        started = time.monotonic()
        hard, _ = train_student(
            plan, dcfg, x_train, y_train, x_val, y_val, norm["mean"], norm["std"], None, seed, hard_epochs
        )
        hard_s = time.monotonic() - started
        int8 = quantize_static_int8(distilled, x_train[:2048])
        run = StudentRun(
            seed=seed,
            distilled=distilled,
            hard=hard,
            int8=int8,
            distilled_acc=student_accuracy(distilled, x_test, y_test),
            hard_acc=student_accuracy(hard, x_test, y_test),
            int8_acc=student_accuracy(int8, x_test, y_test),
            distilled_val_acc=student_accuracy(distilled, x_val, y_val),
            hard_val_acc=student_accuracy(hard, x_val, y_val),
            distilled_train_s=distilled_s,
            hard_train_s=hard_s,
            hard_epochs=hard_epochs,
        )
        log.info(
            "seed %d: distilled %.4f (%.0fs), hard-label %.4f (%.0fs), int8 %.4f",
            seed,
            run.distilled_acc,
            distilled_s,
            run.hard_acc,
            hard_s,
            run.int8_acc,
        )
        runs.append(run)
    return runs


def measure_rows(
    models: Sequence[tuple[str, Forward, float, int, int]], n_features: int, repeats: int, rounds: int = 5
) -> list[dict[str, Any]]:
    """One table row per (name, forward, accuracy, params, size): the given figures plus latency.

    Latency is measured in ``rounds`` round-robin passes over all models (``repeats / rounds``
    timed calls each), and the median over the passes is reported: on a shared machine the load
    drifts, and interleaving exposes every model to the same drift (ratios stay comparable).
    """
    per_round = max(1, repeats // rounds)
    samples: dict[str, dict[int, list[float]]] = {name: {1: [], 256: []} for name, *_ in models}
    for _ in range(rounds):
        for name, forward, *_ in models:
            for batch in (1, 256):
                samples[name][batch].append(latency_ms(forward, n_features, batch, per_round, budget_s=None))
    return [
        {
            "model": name,
            "test_acc": acc,
            "params": int(params),
            "size_kb": round(size / 1024, 1),
            "latency_ms_b1": float(np.median(samples[name][1])),
            "latency_ms_b256": float(np.median(samples[name][256])),
        }
        for name, _, acc, params, size in models
    ]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def spread(values: Sequence[float]) -> str:
    """The range of ``values`` as fractions: ``min-max`` with four places."""
    return f"{min(values):.4f}-{max(values):.4f}"


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values))


def run(settings: Settings, results_path: Path | None) -> int:
    started_at = datetime.now(UTC)
    wall_start = time.monotonic()
    # One thread: these models are tiny, and on a small shared machine more intra-op threads
    # make each training step many times slower (spin-waiting), not faster.
    torch.set_num_threads(TRAIN_THREADS)
    data_root = tempfile.mkdtemp(prefix="mopflow-distill-bench-")
    try:
        manifest_uri, results, shard_s, members_train_s = train_members(settings, data_root)
        manifest = load_manifest(manifest_uri)
        norm = manifest["normalization"]
        data = {split: load_split(manifest_uri, split) for split in ("train", "validation", "test")}
        x_test, y_test = data["test"]
        n_features = x_test.shape[1]

        candidates = [Candidate(r.number, r.state, r.value, r.bundle_uri, r.params) for r in results]
        complete = [c for c in candidates if c.state == "COMPLETE" and c.bundle_uri and c.value is not None]
        if len(complete) < len(candidates):
            failed = [(r.number, r.state, r.error) for r in results if r.state != "COMPLETE"]
            log.warning("members that did not complete (left out of the ensemble): %s", failed)
        if not complete:
            raise RuntimeError("no ensemble member completed")
        ensemble, archs, _ = build_ensemble(complete)
        ensemble.eval()
        stacked = StackedEnsemble(ensemble).eval()
        ensemble_params = n_params(ensemble)
        ensemble_acc = student_accuracy(ensemble, x_test, y_test)
        stacked_acc = student_accuracy(stacked, x_test, y_test)
        member_accs = [
            student_accuracy(ProbabilityEnsemble([m]).eval(), x_test, y_test) for m in ensemble.members
        ]
        best_index = max(range(len(complete)), key=lambda i: (complete[i].value or 0.0, -i))
        best_member = ProbabilityEnsemble([ensemble.members[best_index]]).eval()
        log.info(
            "ensemble of %d: test_acc=%.4f (stacked %.4f), %d params; members %s",
            len(complete),
            ensemble_acc,
            stacked_acc,
            ensemble_params,
            [f"{a:.4f}" for a in member_accs],
        )

        # The pipeline's choices for this data: MNIST-1D is a signal table, so the transfer
        # points are mixups of shifted examples (``transfer: auto``).
        spec = DataSpec.from_manifest(manifest)
        dcfg = DistillConfig(epochs=settings.student_epochs).resolved(spec.modality, spec.ordered)
        plan = plan_student(dcfg, ensemble_params, spec)
        log.info(
            "student: %s %s, %d params (budget %d)",
            plan.arch.family,
            arch_params(plan.arch),
            plan.num_params,
            plan.budget,
        )
        students_start = time.monotonic()
        # The teacher in the form the pipeline would pick: loop or stacked, whichever is faster here.
        teacher, form_ms = faster_form(ensemble, n_features)
        teacher_form = "stacked" if isinstance(teacher, StackedEnsemble) else "loop"
        log.info("teacher form: %s (%s)", teacher_form, {k: round(v, 3) for k, v in form_ms.items()})
        runs = train_students(settings, plan, dcfg, teacher, data, norm)
        students_s = time.monotonic() - students_start

        distilled_acc = mean([r.distilled_acc for r in runs])
        hard_acc = mean([r.hard_acc for r in runs])
        int8_acc = mean([r.int8_acc for r in runs])
        first = runs[0]
        load_before = os.getloadavg()
        timed: list[tuple[str, Forward, float, int, int]] = [
            (
                f"ensemble x{len(complete)} (loop)",
                ensemble,
                ensemble_acc,
                ensemble_params,
                serialized_bytes(ensemble),
            ),
            (
                f"ensemble x{len(complete)} (stacked)",
                stacked,
                stacked_acc,
                ensemble_params,
                serialized_bytes(ensemble),  # same weights; the stacked copy is not a state dict
            ),
            (
                f"best member #{complete[best_index].number}",
                best_member,
                member_accs[best_index],
                n_params(best_member),
                serialized_bytes(ensemble.members[best_index]),
            ),
            (
                "student (distilled)",
                ProbabilityEnsemble([first.distilled]).eval(),
                distilled_acc,
                plan.num_params,
                serialized_bytes(first.distilled),
            ),
            (
                "student (hard labels)",
                ProbabilityEnsemble([first.hard]).eval(),
                hard_acc,
                plan.num_params,
                serialized_bytes(first.hard),
            ),
            (
                "student int8",
                ProbabilityEnsemble([first.int8]).eval(),
                int8_acc,
                plan.num_params,
                serialized_bytes(first.int8),
            ),
        ]
        rows = measure_rows(timed, n_features, settings.repeats)
        load_after = os.getloadavg()
        by_name = {r["model"]: r for r in rows}
        loop_row = rows[0]
        stacked_row = rows[1]
        student_row = by_name["student (distilled)"]
        int8_row = by_name["student int8"]

        # Targets.
        headroom = ensemble_acc - hard_acc
        recovered = (distilled_acc - hard_acc) / headroom if headroom > 0 else None
        per_seed_recovered = [
            (r.distilled_acc - r.hard_acc) / (ensemble_acc - r.hard_acc)
            if ensemble_acc > r.hard_acc
            else None
            for r in runs
        ]
        param_ratio = plan.num_params / ensemble_params
        speedup_loop = loop_row["latency_ms_b256"] / student_row["latency_ms_b256"]
        speedup_stacked = stacked_row["latency_ms_b256"] / student_row["latency_ms_b256"]
        speedup = min(speedup_loop, speedup_stacked)
        int8_speedup = student_row["latency_ms_b256"] / int8_row["latency_ms_b256"]
        int8_loss_points = 100 * mean([r.distilled_acc - r.int8_acc for r in runs])
        stacked_ratio_b1 = loop_row["latency_ms_b1"] / stacked_row["latency_ms_b1"]
        stacked_ratio_b256 = loop_row["latency_ms_b256"] / stacked_row["latency_ms_b256"]

        targets: dict[str, Any] = {
            "recovered_gain": {
                "value": recovered,
                "target": f">= {RECOVERED_GAIN_TARGET}",
                "status": "UNDEFINED" if recovered is None else verdict(recovered >= RECOVERED_GAIN_TARGET),
            },
            "param_ratio": {
                "value": param_ratio,
                "target": f"<= {MAX_PARAM_RATIO}",
                "status": verdict(param_ratio <= MAX_PARAM_RATIO),
            },
            "student_speedup_b256": {
                "value": speedup,
                "vs_loop": speedup_loop,
                "vs_stacked": speedup_stacked,
                "target": f">= {STUDENT_SPEEDUP_TARGET} (vs the faster ensemble form)",
                "status": verdict(speedup >= STUDENT_SPEEDUP_TARGET),
            },
            "int8": {
                "speedup_b256": int8_speedup,
                "accuracy_loss_points": int8_loss_points,
                "target": f"speedup >= {INT8_SPEEDUP_TARGET} and loss < {INT8_MAX_LOSS_POINTS} points",
                "status": verdict(
                    int8_speedup >= INT8_SPEEDUP_TARGET and int8_loss_points < INT8_MAX_LOSS_POINTS
                ),
            },
        }
        if recovered is None:
            gain_line = (
                f"recovered gain: UNDEFINED (ensemble {ensemble_acc:.4f} is not better than the "
                f"hard-label student {hard_acc:.4f}; distilled {distilled_acc:.4f})"
            )
        else:
            gain_line = (
                f"recovered gain = ({distilled_acc:.4f} - {hard_acc:.4f}) / ({ensemble_acc:.4f} - {hard_acc:.4f})"
                f" = {recovered:.3f}  (target >= {RECOVERED_GAIN_TARGET:.2f})  "
                f"{targets['recovered_gain']['status']}"
            )
        lines = [
            gain_line,
            f"student params = {plan.num_params} / {ensemble_params} = {100 * param_ratio:.1f}% "
            f"(target <= {100 * MAX_PARAM_RATIO:.0f}%)  {targets['param_ratio']['status']}",
            f"student speedup at b256 = {speedup:.1f}x (vs loop {speedup_loop:.1f}x, vs stacked "
            f"{speedup_stacked:.1f}x; target >= {STUDENT_SPEEDUP_TARGET:.0f}x vs the faster)  "
            f"{targets['student_speedup_b256']['status']}",
            f"int8 student: {int8_speedup:.2f}x faster than fp32 at b256 (target >= "
            f"{INT8_SPEEDUP_TARGET:.0f}x), accuracy lost {int8_loss_points:+.2f} points (target < "
            f"{INT8_MAX_LOSS_POINTS}) {targets['int8']['status']}",
            f"info: stacked vs loop ensemble latency: loop/stacked = {stacked_ratio_b1:.2f}x at b1, "
            f"{stacked_ratio_b256:.2f}x at b256 (stacked groups {stacked.group_sizes}); faster_form "
            f"picked the {teacher_form} form (loop {form_ms['loop_ms']:.2f} ms, stacked "
            f"{form_ms['stacked_ms']:.2f} ms, b1 + b256)",
        ]
        if settings.seeds > 1:
            lines.append(
                "info: per-seed test acc distilled "
                + ", ".join(f"{r.distilled_acc:.4f}" for r in runs)
                + "; hard-label "
                + ", ".join(f"{r.hard_acc:.4f}" for r in runs)
                + "; int8 "
                + ", ".join(f"{r.int8_acc:.4f}" for r in runs)
            )
            lines.append(
                f"info: spread over {len(runs)} seeds (min-max): distilled {spread([r.distilled_acc for r in runs])}, "
                f"hard-label {spread([r.hard_acc for r in runs])}, recovered gain per seed "
                + ", ".join("undefined" if g is None else f"{g:.3f}" for g in per_seed_recovered)
            )

        header = (
            f"MNIST-1D distillation benchmark ({'quick' if settings.quick else 'full'}): "
            f"{len(complete)} members x {settings.epochs} epochs, student {plan.arch.family} "
            f"{arch_params(plan.arch)}, {settings.student_epochs} epochs, {settings.seeds} seed(s); "
            f"test n={len(y_test)}; latency: 1 thread, median of {settings.repeats}, "
            "probability outputs; student accuracies are seed means"
        )
        print(header)
        print(format_table(rows))
        print()
        for line in lines:
            print(line)

        report = {
            "benchmark": "distill",
            "date": started_at.isoformat(timespec="seconds"),
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "torch_threads_training": torch.get_num_threads(),
                "latency_threads": 1,
                "loadavg_before_latency": list(load_before),
                "loadavg_after_latency": list(load_after),
            },
            "settings": {
                "quick": settings.quick,
                "members": settings.members,
                "member_epochs": settings.epochs,
                "student_epochs": settings.student_epochs,
                "hard_label_epochs": runs[0].hard_epochs,
                "seeds": settings.seeds,
                "latency_repeats": settings.repeats,
                "dask_workers": N_DASK_WORKERS,
                "data": DataConfig().model_dump(),
                "distill": dcfg.model_dump(),
                "latency_forward": "probability modules (students wrapped in ProbabilityEnsemble([model]))",
            },
            "members": [
                {
                    "number": r.number,
                    "params": r.params,
                    "seed": MEMBER_CONFIGS[r.number][1],
                    "state": r.state,
                    "val_acc": r.value,
                    "num_params": r.num_params,
                    "duration_s": r.duration_s,
                    "worker": r.worker,
                    "error": r.error,
                }
                for r in results
            ],
            "member_test_acc": member_accs,
            "ensemble": {
                "members": [c.number for c in complete],
                "archs": [a.to_dict() for a in archs],
                "test_acc": ensemble_acc,
                "stacked_test_acc": stacked_acc,
                "params": ensemble_params,
                "stacked_groups": stacked.group_sizes,
            },
            "student": {
                "arch": plan.arch.to_dict(),
                "params": plan.num_params,
                "budget": plan.budget,
                "test_acc_mean": distilled_acc,
                "hard_label_test_acc_mean": hard_acc,
                "int8_test_acc_mean": int8_acc,
                "per_seed": [
                    {
                        "seed": r.seed,
                        "distilled_test_acc": r.distilled_acc,
                        "hard_label_test_acc": r.hard_acc,
                        "int8_test_acc": r.int8_acc,
                        "distilled_val_acc": r.distilled_val_acc,
                        "hard_label_val_acc": r.hard_val_acc,
                        "recovered_gain": g,
                        "distilled_train_s": r.distilled_train_s,
                        "hard_label_train_s": r.hard_train_s,
                    }
                    for r, g in zip(runs, per_seed_recovered, strict=True)
                ],
            },
            "rows": rows,
            "targets": targets,
            "info": {
                "loop_over_stacked_latency_b1": stacked_ratio_b1,
                "loop_over_stacked_latency_b256": stacked_ratio_b256,
                "teacher_form": teacher_form,
                "faster_form_ms": form_ms,
            },
            "timings_s": {
                "shard": shard_s,
                "members_train": members_train_s,
                "students_train": students_s,
                "total": time.monotonic() - wall_start,
            },
            "printed": [header, format_table(rows), *lines],
        }
        seeds = [r.seed for r in runs]
        harness.write_report(results_path, report, lead="\n", config=settings, seeds=seeds)
        return 0
    finally:
        shutil.rmtree(data_root, ignore_errors=True)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path]:
    parser = harness.parser(
        __doc__,
        "2 members, 2 epochs, 2 student epochs, 10 timed passes per latency",
        seeds=None,
        seeds_help="student seeds, each with its own transfer set (distilled + hard-label each; default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--members", type=int, default=None, help=f"ensemble members (1..{len(MEMBER_CONFIGS)})"
    )
    parser.add_argument("--epochs", type=int, default=None, help="epochs per ensemble member")
    parser.add_argument("--student-epochs", type=int, default=None, help="student training epochs")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed forward passes per latency figure (default 50)"
    )
    args = parser.parse_args(argv)
    members = args.members if args.members is not None else (2 if args.quick else 4)
    epochs = args.epochs if args.epochs is not None else (2 if args.quick else 80)
    full_epochs = DistillConfig().epochs  # the pipeline's default schedule
    student_epochs = (
        args.student_epochs if args.student_epochs is not None else (2 if args.quick else full_epochs)
    )
    if not 1 <= members <= len(MEMBER_CONFIGS):
        parser.error(f"--members must be between 1 and {len(MEMBER_CONFIGS)}")
    repeats = args.repeats if args.repeats is not None else (10 if args.quick else 50)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    if seeds < 1 or epochs < 1 or student_epochs < 1 or repeats < 1:
        parser.error("--seeds, --epochs, --student-epochs and --repeats must be >= 1")
    settings = Settings(members, epochs, student_epochs, seeds, repeats, args.quick)
    return settings, results_file(args.out, args.quick)


def main(argv: Sequence[str] | None = None) -> int:
    settings, out = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("distributed", "pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    return run(settings, out)


if __name__ == "__main__":
    sys.exit(main())
