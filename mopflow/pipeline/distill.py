"""Stage 4: a student (<= ratio x the ensemble's params) trained on soft targets plus hard labels,
beside the same student on hard labels alone, both on the Dask workers; the one with the better
validation accuracy is kept (and logged as the pyfunc to register); INT8 quantization of the kept
student; the evaluation report on the test shards."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mopflow.base.settings import Settings
from mopflow.base.tag_names import MANIFEST_HASH
from mopflow.compression.distill.keep import REPORT_NAMES, KeptStudent
from mopflow.pipeline.context import Stage, stage
from mopflow.pipeline.ensemble import example_input, json_figures
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

    @property
    def kept_trained(self) -> TrainedStudent:
        """The kept student as trained on the workers (its bundle is the one registered)."""
        return self.hard_label if self.kept.student == "hard_label" else self.distilled


def distill_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    ensemble: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Distill the ensemble into a student beside its hard-label twin, keep the one with the better
    validation accuracy, evaluate every model, and log the kept student as a pyfunc."""
    import torch

    from mopflow.compression.ensemble import faster_form
    from mopflow.compression.registry.model_registry import log_bundle_model
    from mopflow.training.data import load_manifest
    from mopflow.training.models.bundle import load_bundle

    lineage = {MANIFEST_HASH: str(shard["manifest_hash"])}
    with stage("distill", conf, ctx_dict, settings, lineage) as st:
        torch.set_num_threads(1)  # small models: one thread is fastest, more only contend with each other
        so, dcfg = st.storage_options, st.cfg.distill
        manifest_uri = str(shard["manifest_uri"])
        manifest = load_manifest(manifest_uri, so)
        data = DataSpec.from_manifest(manifest)
        dcfg = dcfg.resolved(data.modality, data.ordered)
        teacher_bundle = load_bundle(str(ensemble["bundle_uri"]), so)
        # The loop or the stacked (vmap) form of the ensemble, whichever is faster on this machine.
        teacher, form_ms = faster_form(teacher_bundle.module, len(manifest["feature_columns"]))
        students = train_students(
            st, dcfg, manifest_uri, data, teacher, ensemble, teacher_bundle.num_params()
        )
        report = evaluation_report(st, ensemble, teacher, teacher_bundle, students, manifest_uri)
        metrics = distill_metrics(report, students, teacher_bundle.num_params(), float(ensemble["test_acc"]))
        _log_distill(st, dcfg, students, type(teacher).__name__, form_ms, metrics)
        bundle_uri = students.kept_trained.bundle_uri
        model_uri = log_bundle_model(st.run_id, "student", bundle_uri, example_input(manifest_uri, so), so)
    log.info(
        "distill: kept the %s student, test_acc=%.4f (distilled %.4f, hard-label %.4f, int8 %.4f) with %d params (%.1f%% of the ensemble)",
        students.kept.student.replace("_", "-"),
        metrics["test_acc"],
        metrics["distilled_test_acc"],
        metrics["hard_label_test_acc"],
        metrics["int8_test_acc"],
        students.plan.num_params,
        100 * metrics["param_ratio"],
    )
    return {
        "bundle_uri": bundle_uri,
        "model_uri": model_uri,
        "run_id": st.run_id,
        "arch": students.plan.arch.to_dict(),
        "kept": students.kept.to_dict(),
        "evaluation": report,
        **json_figures(metrics),
    }


def distill_metrics(
    report: list[dict[str, Any]], students: Students, teacher_params: int, ensemble_test_acc: float
) -> dict[str, float]:
    """The stage's figures, from the evaluation report's test accuracies and the students' last
    validation: ``val_acc``/``test_acc`` are the kept student's (the one registered), both students'
    are there by name, and ``recovered_gain`` is how much of the ensemble's gain over the
    hard-label student distillation kept."""
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


def train_students(
    st: Stage,
    dcfg: Any,
    manifest_uri: str,
    data: DataSpec,
    teacher: Any,
    ensemble: Mapping[str, Any],
    teacher_params: int,
) -> Students:
    """Plan the student within its budget, make the transfer set with the teacher's soft targets on
    the workers (:mod:`mopflow.compression.distill.transfer_shards`), train the student on it and the same student
    on the real data alone (the baseline) side by side on the workers
    (:mod:`mopflow.compression.distill.student_job`), keep the one with the better validation
    accuracy (:func:`~mopflow.compression.distill.keep.keep_student`) and quantize that one."""
    from mopflow.compression.distill.distill import matching_epochs, plan_student
    from mopflow.compression.distill.keep import keep_student
    from mopflow.compression.distill.student_job import StudentJob, train_students_on_workers
    from mopflow.compression.distill.transfer_shards import build_transfer_set, calibration_rows
    from mopflow.compression.evaluate import quantize_int8, quantize_static_int8
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.compute.devices import device_for_cluster
    from mopflow.training.models.bundle import StackedEnsemble

    seed, so, teacher_uri = st.cfg.search.seed, st.storage_options, str(ensemble["bundle_uri"])
    plan = plan_student(dcfg, teacher_params, data)
    log.info(
        "distill: student %s %s, %d params (budget %d, ensemble %d)",
        plan.arch.family,
        plan.arch.params,
        plan.num_params,
        plan.budget,
        teacher_params,
    )
    # Transfer set: the training data, plus synthetic points near it labelled by the ensemble.
    stacked = isinstance(teacher, StackedEnsemble)
    with dask_client(st.settings.dask_address, st.settings.dask_workers) as client:
        transfer = build_transfer_set(
            client, manifest_uri, teacher_uri, stacked, dcfg, seed, st.output_uri("transfer"), so
        )
        log.info(
            "distill: transfer set has %d real + %d %s points, with soft targets, in %d block(s) made on the workers",
            transfer.real_rows,
            transfer.synthetic_rows,
            dcfg.transfer,
            len(transfer.blocks),
        )
        device = device_for_cluster(client, st.settings.accelerator, st.settings.precision)
        # The baseline: same student, real data only, as many steps (same LR schedule).
        baseline_epochs = matching_epochs(dcfg.epochs, transfer.rows, transfer.real_rows)
        log.info(
            "distill: training the student (%d epochs) and the hard-label baseline (%d epochs) on the workers (%s, precision %s)",
            dcfg.epochs,
            baseline_epochs,
            device.accelerator,
            device.precision,
        )
        extra = {"teacher": teacher_uri, "temperature": dcfg.temperature, "alpha": dcfg.alpha}
        job = StudentJob(plan, dcfg, manifest_uri, seed, device, dict(so), extra)
        outputs = (st.output_uri("student"), st.output_uri("hard-label-student"))
        soft, hard = train_students_on_workers(client, job, transfer, baseline_epochs, outputs)
    # the last epoch's validation: the weights each bundle holds
    kept = keep_student(soft.history[-1]["val_acc"], hard.history[-1]["val_acc"])
    log.info("distill: kept the %s student: %s", kept.student.replace("_", "-"), kept.reason)
    student, baseline = soft.module(so), hard.module(so)
    chosen = baseline if kept.student == "hard_label" else student
    # static INT8 needs the quantizable families' layout (conv-ReLU pairs); others skip it
    static = (
        quantize_static_int8(chosen, calibration_rows(manifest_uri, 2048, so))
        if get_family(plan.arch.family).quantizable
        else None
    )
    return Students(plan, soft, hard, student, baseline, kept, baseline_epochs, quantize_int8(chosen), static)


def evaluation_report(
    st: Stage,
    ensemble: Mapping[str, Any],
    teacher: Any,
    teacher_bundle: Any,
    students: Students,
    manifest_uri: str,
) -> list[dict[str, Any]]:
    """Every model the pipeline produced on the same test set (read one shard at a time), logged
    as a JSON and Markdown table. The students' rows carry their validation accuracy and which one
    was kept; the INT8 rows are the kept student's."""
    from mopflow.compression.distill.keep import kept_line, mark_kept
    from mopflow.compression.evaluate import evaluate, format_table, serialized_bytes
    from mopflow.training.data import split_shards
    from mopflow.training.models.bundle import ProbabilityEnsemble, load_bundle

    best = load_bundle(str(ensemble["best_trial_bundle"]), st.storage_options)
    n = students.plan.num_params
    models = {
        f"best trial #{ensemble['best_trial']['number']}": (
            best.module,
            best.num_params(),
            serialized_bytes(best.module),
        ),
        "ensemble": (teacher, teacher_bundle.num_params(), serialized_bytes(teacher_bundle.module)),
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
    measured = evaluate(models, split_shards(manifest_uri, "test", st.storage_options))
    report = mark_kept(measured, students.kept)
    table = format_table(report) + "\n\n" + kept_line(students.kept)
    log.info("distill: evaluation report (test set, CPU, 1 thread)\n%s", table)
    st.tracker.log_dict(st.run_id, report, "evaluation.json")
    st.tracker.log_text(st.run_id, table + "\n", "evaluation.md")
    st.tracker.log_dict(st.run.parent_run_id, report, "evaluation.json")
    for run_id in (st.run_id, st.run.parent_run_id):
        st.tracker.log_dict(run_id, students.kept.to_dict(), "kept_student.json")
    return report


def _log_distill(
    st: Stage,
    dcfg: Any,
    students: Students,
    teacher_form: str,
    form_ms: Mapping[str, float],
    metrics: Mapping[str, float],
) -> None:
    import math

    st.tracker.log_params(
        st.run_id,
        dcfg.model_dump()
        | {
            "student_width_used": students.plan.arch.params.get("width"),
            "hard_label_epochs": students.baseline_epochs,
            "teacher_form": teacher_form,
            "teacher_form_ms": {k: round(v, 3) for k, v in form_ms.items()},
        },
    )
    for key, trained in (
        ("epoch_val_acc", students.distilled),
        ("hard_label_epoch_val_acc", students.hard_label),
    ):
        history = [(int(h["epoch"]), h["val_acc"]) for h in trained.history]
        st.tracker.log_metric_history(st.run_id, key, history)
    st.tracker.set_tags(
        st.run_id,
        {"mopflow.kept_student": students.kept.student, "mopflow.kept_reason": students.kept.reason},
    )
    st.tracker.log_metrics(st.run_id, {k: v for k, v in metrics.items() if math.isfinite(v)})
