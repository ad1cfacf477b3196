"""The distillation's students: the distilled one and its hard-label twin trained side by side on
the Dask workers, the better one on validation kept and quantized, and every model of a run
measured on the same test set."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mopflow.compression.distill.keep import REPORT_NAMES, KeptStudent
from mopflow.training.models.families import DataSpec, get_family

if TYPE_CHECKING:
    from mopflow.compression.distill.student_job import TrainedStudent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Students:
    """The distilled student and its hard-label twin (as trained on the workers, and as modules on
    the CPU), which one is kept, and the kept one's INT8 forms."""

    plan: Any
    distilled: TrainedStudent
    hard_label: TrainedStudent
    distilled_module: Any
    hard_label_module: Any
    kept: KeptStudent
    baseline_epochs: int
    quantized: Any
    quantized_static: Any | None
    search: Any = None  # the student search's result (StudentSearchResult), when one ran

    @property
    def kept_trained(self) -> TrainedStudent:
        """The kept student as trained on the workers (its bundle is the one registered)."""
        return self.hard_label if self.kept.student == "hard_label" else self.distilled


@dataclass(frozen=True)
class StudentOutputs:
    """Where the students' training writes: the transfer set and the two students' bundles."""

    transfer: str
    student: str
    hard_label: str
    candidates: str = ""  # a student search's candidates' bundles (one folder each)


@dataclass(frozen=True)
class Teacher:
    """The ensemble the students learn from: its bundle's URI, its module in the faster form, and
    its size."""

    bundle_uri: str
    module: Any
    num_params: int


def train_students(
    client: Any,
    device: Any,
    dcfg: Any,
    manifest_uri: str,
    manifest: Mapping[str, Any],
    data: DataSpec,
    teacher: Teacher,
    seed: int,
    outputs: StudentOutputs,
    storage_options: Mapping[str, Any],
    latency: Any = None,
    search: Any = None,
) -> Students:
    """Plan the student within its budget, make the transfer set with the teacher's soft targets on
    the workers (:mod:`mopflow.compression.distill.transfer_shards`), train the student on it and
    the same student on the real data alone (the baseline) side by side on the workers
    (:mod:`mopflow.compression.distill.student_job`), keep the one with the better validation
    accuracy (:func:`~mopflow.compression.distill.keep.keep_student`) and quantize that one.
    ``latency`` measures a candidate's serving latency (``plan_student``) under a serving budget;
    with ``search`` (a :class:`~mopflow.compression.distill.student_search.StudentSearchSetup`)
    the student is the one a multi-objective search over families, depths and widths chose."""
    from mopflow.compression.distill.distill import matching_epochs, plan_student
    from mopflow.compression.distill.keep import keep_student
    from mopflow.compression.distill.student_job import StudentJob, train_students_on_workers
    from mopflow.compression.distill.transfer_shards import build_transfer_set, calibration_rows
    from mopflow.compression.evaluate import quantize_int8, quantize_static_int8
    from mopflow.training.models.bundle import StackedEnsemble

    so = storage_options
    plan = plan_student(dcfg, teacher.num_params, data, latency) if search is None else None
    # Transfer set: the training data, plus synthetic points near it labelled by the ensemble.
    stacked = isinstance(teacher.module, StackedEnsemble)
    transfer = build_transfer_set(
        client, manifest_uri, teacher.bundle_uri, stacked, dcfg, seed, outputs.transfer, so, manifest
    )
    log.info(
        "distill: transfer set has %d real + %d %s points, with soft targets, in %d block(s) made on the workers",
        transfer.real_rows,
        transfer.synthetic_rows,
        dcfg.transfer,
        len(transfer.blocks),
    )
    extra = {"teacher": teacher.bundle_uri, "temperature": dcfg.temperature, "alpha": dcfg.alpha}
    found = None
    if plan is None:

        def job_of(candidate: Any) -> StudentJob:
            return StudentJob(candidate, dcfg, manifest_uri, seed, device, dict(so), extra)

        plan, found = _searched_plan(client, dcfg, job_of, data, teacher, search, latency, transfer, outputs)
    log.info(
        "distill: student %s %s, %d params (budget %d, ensemble %d)",
        plan.arch.family,
        plan.arch.params,
        plan.num_params,
        plan.budget,
        teacher.num_params,
    )
    # The baseline: same student, real data only, as many steps (same LR schedule).
    baseline_epochs = matching_epochs(dcfg.epochs, transfer.rows, transfer.real_rows)
    log.info(
        "distill: training the student (%d epochs) and the hard-label baseline (%d epochs) on the workers (%s, precision %s)",
        dcfg.epochs,
        baseline_epochs,
        device.accelerator,
        device.precision,
    )
    job = StudentJob(plan, dcfg, manifest_uri, seed, device, dict(so), extra)
    soft, hard = train_students_on_workers(
        client, job, transfer, baseline_epochs, (outputs.student, outputs.hard_label)
    )
    # the last epoch's validation: the weights each bundle holds
    kept = keep_student(soft.history[-1]["val_acc"], hard.history[-1]["val_acc"])
    log.info("distill: kept the %s student: %s", kept.student.replace("_", "-"), kept.reason)
    student, baseline = soft.module(so), hard.module(so)
    chosen = baseline if kept.student == "hard_label" else student
    # static INT8 needs the quantizable families' layout (conv-ReLU pairs); others skip it
    static = (
        quantize_static_int8(chosen, calibration_rows(manifest_uri, 2048, so, manifest))
        if get_family(plan.arch.family).quantizable
        else None
    )
    return Students(
        plan, soft, hard, student, baseline, kept, baseline_epochs, quantize_int8(chosen), static, found
    )


def _searched_plan(
    client: Any,
    dcfg: Any,
    job_of: Any,
    data: DataSpec,
    teacher: Teacher,
    search: Any,
    latency: Any,
    transfer: Any,
    outputs: StudentOutputs,
) -> tuple[Any, Any]:
    """The student a multi-objective search chose (its candidates distilled on the workers, on the
    transfer set, each as ``job_of(its plan)`` says), and the search's result."""
    from mopflow.base import storage
    from mopflow.compression.distill.distill import (
        StudentBudgetError,
        StudentPlan,
        parameter_budget,
        plan_student,
    )
    from mopflow.compression.distill.student_job import train_candidates_on_workers
    from mopflow.compression.distill.student_search import search_student_plan
    from mopflow.training.compute.workers import cluster_workers

    budget, _ = parameter_budget(dcfg, teacher.num_params)

    def train(candidates: Any) -> list[tuple[str, float]]:
        plans = [
            (
                StudentPlan(c.arch, c.num_params, budget),
                storage.join(outputs.candidates, f"candidate-{c.number:04d}"),
            )
            for c in candidates
        ]
        trained = train_candidates_on_workers(client, job_of(plans[0][0]), transfer, plans)
        return [(t.bundle_uri, float(t.history[-1]["val_acc"])) for t in trained]

    try:  # the student the config alone gives within the budgets: the search's first candidate
        start = plan_student(dcfg, teacher.num_params, data, latency).arch
    except StudentBudgetError as exc:
        log.info(
            "distill: the configured student family fits no budget (%s); the search starts anywhere", exc
        )
        start = None
    parallel = max(1, len(cluster_workers(client)))
    return search_student_plan(dcfg, data, budget, search, parallel, latency, train, start)


def evaluation_report(
    best_trial: tuple[int, str],
    teacher: Teacher,
    teacher_bundle: Any,
    students: Students,
    manifest_uri: str,
    manifest: Mapping[str, Any],
    storage_options: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], str]:
    """Every model the pipeline produced (the best trial, given as its number and bundle URI; the
    ensemble; the students and the kept one's INT8 forms) on the same test set, read one shard at
    a time: the report's rows, and the report as a Markdown table naming the kept student."""
    from mopflow.compression.distill.keep import kept_line, mark_kept
    from mopflow.compression.evaluate import evaluate, format_table, serialized_bytes
    from mopflow.training.data import split_shards
    from mopflow.training.models.bundle import ProbabilityEnsemble, load_bundle

    number, bundle_uri = best_trial
    best = load_bundle(bundle_uri, storage_options)
    n = students.plan.num_params
    models = {
        f"best trial #{number}": (best.module, best.num_params(), serialized_bytes(best.module)),
        "ensemble": (teacher.module, teacher.num_params, serialized_bytes(teacher_bundle.module)),
        REPORT_NAMES["distilled"]: (
            ProbabilityEnsemble([students.distilled_module]).eval(),
            n,
            serialized_bytes(students.distilled_module),
        ),
        "student int8 (dynamic)": (students.quantized, n, serialized_bytes(students.quantized)),
    }
    if students.quantized_static is not None:
        static = students.quantized_static
        models["student int8 (static)"] = (static, n, serialized_bytes(static))
    baseline = students.hard_label_module
    models[REPORT_NAMES["hard_label"]] = (
        ProbabilityEnsemble([baseline]).eval(),
        n,
        serialized_bytes(baseline),
    )
    measured = evaluate(models, split_shards(manifest_uri, "test", storage_options, manifest))
    report = mark_kept(measured, students.kept)
    return report, format_table(report) + "\n\n" + kept_line(students.kept)


def distill_metrics(
    report: list[dict[str, Any]], students: Students, teacher_params: int, ensemble_test_acc: float
) -> dict[str, float]:
    """The distillation's figures, from the evaluation report's test accuracies and the students'
    last validation: ``val_acc``/``test_acc`` are the kept student's (the one registered), both
    students' are there by name, and ``recovered_gain`` is how much of the ensemble's gain over
    the hard-label student distillation kept."""
    test_acc = {row["model"]: float(row["test_acc"]) for row in report}
    kept = students.kept
    metrics = {
        "val_acc": kept.val_acc,
        "test_acc": test_acc[kept.report_name],
        "num_params": float(students.plan.num_params),
        "param_ratio": students.plan.num_params / teacher_params,
        "distilled_val_acc": kept.distilled_val_acc,
        "distilled_test_acc": test_acc[REPORT_NAMES["distilled"]],
        "hard_label_val_acc": kept.hard_label_val_acc,
        "hard_label_test_acc": test_acc[REPORT_NAMES["hard_label"]],
        "int8_test_acc": test_acc["student int8 (dynamic)"],
    }
    if "student int8 (static)" in test_acc:
        metrics["int8_static_test_acc"] = test_acc["student int8 (static)"]
    headroom = ensemble_test_acc - metrics["hard_label_test_acc"]
    gain = metrics["distilled_test_acc"] - metrics["hard_label_test_acc"]
    metrics["recovered_gain"] = gain / headroom if headroom > 0 else float("nan")
    return metrics
