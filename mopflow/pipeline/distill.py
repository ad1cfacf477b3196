"""Stage 4: a student (<= ratio x the ensemble's params) trained on soft targets plus hard labels,
beside the same student on hard labels alone, both on the Dask workers; the one with the better
validation accuracy is kept (and logged as the pyfunc to register); INT8 quantization of the kept
student; the evaluation report on the test shards
(:mod:`mopflow.compression.distill.students`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mopflow.base.settings import Settings
from mopflow.base.tag_names import MANIFEST_HASH
from mopflow.pipeline.context import Stage, stage
from mopflow.pipeline.paths import EVALUATION_ARTIFACT, EVALUATION_TABLE_ARTIFACT, KEPT_STUDENT_ARTIFACT
from mopflow.pipeline.records import DistillRecord, EnsembleRecord, RunContext, ShardRecord, finite_or_none
from mopflow.training.models.families import DataSpec

if TYPE_CHECKING:
    from mopflow.compression.distill.students import Students

log = logging.getLogger(__name__)


def distill_stage(
    conf: Mapping[str, Any] | None,
    run: RunContext,
    shard: ShardRecord,
    ensemble: EnsembleRecord,
    settings: Settings | None = None,
) -> DistillRecord:
    """Distill the ensemble into a student beside its hard-label twin, keep the one with the better
    validation accuracy, evaluate every model, and log the kept student as a pyfunc."""
    import torch

    from mopflow.compression.distill.students import (
        StudentOutputs,
        Teacher,
        distill_metrics,
        evaluation_report,
        train_students,
    )
    from mopflow.compression.ensemble import faster_form
    from mopflow.pipeline.student_search import log_student_search, student_search_setup
    from mopflow.registry.inputs import example_input, serving_request
    from mopflow.registry.latency import logged_model_latency
    from mopflow.registry.model_registry import log_bundle_model
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.compute.devices import device_for_cluster
    from mopflow.training.data import load_manifest
    from mopflow.training.models.bundle import load_bundle

    lineage = {MANIFEST_HASH: shard.manifest_hash}
    with stage("distill", conf, run, settings, lineage) as st:
        torch.set_num_threads(1)  # small models: one thread is fastest, more only contend with each other
        so, manifest_uri = st.storage_options, shard.manifest_uri
        manifest = load_manifest(manifest_uri, so)
        data = DataSpec.from_manifest(manifest)
        dcfg = st.cfg.distill.resolved(data.modality, data.ordered)
        teacher_bundle = load_bundle(ensemble.bundle_uri, so)
        # The loop or the stacked (vmap) form of the ensemble, whichever is faster on this machine.
        module, form_ms = faster_form(teacher_bundle.module, len(manifest["feature_columns"]))
        teacher = Teacher(ensemble.bundle_uri, module, teacher_bundle.num_params())
        paths = st.paths
        outputs = StudentOutputs(
            paths.transfer, paths.student, paths.hard_label_student, paths.student_candidates
        )
        search = student_search_setup(st, dcfg) if dcfg.trials else None
        request = serving_request(manifest_uri, manifest, so, dcfg.request_rows)
        latency = _latency_of_architectures(dcfg, manifest, request)
        with dask_client(st.settings.dask_address, st.settings.dask_workers) as client:
            device = device_for_cluster(client, st.settings.accelerator, st.settings.precision)
            students = train_students(
                client,
                device,
                dcfg,
                manifest_uri,
                manifest,
                data,
                teacher,
                st.cfg.search.seed,
                outputs,
                so,
                latency,
                search,
            )
        if students.search is not None:
            log_student_search(st, students.search)
        best_trial = (ensemble.best_trial.number, ensemble.best_trial_bundle)
        report, table = evaluation_report(
            best_trial, teacher, teacher_bundle, students, manifest_uri, manifest, so
        )
        _log_report(st, report, table, students)
        metrics = distill_metrics(report, students, teacher.num_params, ensemble.test_acc)
        _log_distill(st, dcfg, students, type(module).__name__, form_ms, metrics)
        bundle_uri = students.kept_trained.bundle_uri
        example = example_input(manifest_uri, manifest, so)
        model_uri = log_bundle_model(st.run_id, "student", bundle_uri, example, so)
        served = logged_model_latency(model_uri, request, dcfg.request_rows)
        st.tracker.log_metrics(st.run_id, {"latency_p50_ms": served.p50_ms, "latency_p95_ms": served.p95_ms})
        log.info(
            "distill: the student serves %d rows in p50 %.2f ms, p95 %.2f ms (one CPU thread)%s",
            served.rows,
            served.p50_ms,
            served.p95_ms,
            "" if dcfg.budget_ms is None else f"; budget {dcfg.budget_ms:g} ms",
        )
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
    figures = finite_or_none(metrics)
    return DistillRecord(
        bundle_uri=bundle_uri,
        model_uri=model_uri,
        run_id=st.run_id,
        arch=students.plan.arch.to_dict(),
        kept=students.kept.to_dict(),
        evaluation=report,
        val_acc=metrics["val_acc"],
        test_acc=metrics["test_acc"],
        num_params=metrics["num_params"],
        param_ratio=metrics["param_ratio"],
        distilled_val_acc=figures["distilled_val_acc"],
        distilled_test_acc=figures["distilled_test_acc"],
        hard_label_val_acc=figures["hard_label_val_acc"],
        hard_label_test_acc=figures["hard_label_test_acc"],
        int8_test_acc=figures["int8_test_acc"],
        int8_static_test_acc=figures.get("int8_static_test_acc"),
        recovered_gain=figures["recovered_gain"],
        latency_p50_ms=served.p50_ms,
        latency_p95_ms=served.p95_ms,
        latency_rows=served.rows,
        budget_ms=dcfg.budget_ms,
        search=students.search.to_dict() if students.search is not None else None,
    )


def _latency_of_architectures(dcfg: Any, manifest: Mapping[str, Any], request: Any) -> Any:
    """Under a serving budget, what measures a candidate student's latency before it trains (an
    untrained model of the architecture, served as the registered one will be); else None."""
    from mopflow.registry.latency import architecture_latency

    if dcfg.budget_ms is None:
        return None
    columns, norm, rows = manifest["feature_columns"], manifest["normalization"], dcfg.request_rows
    return lambda arch: architecture_latency(arch, columns, norm, request, rows)


def _log_report(st: Stage, report: list[dict[str, Any]], table: str, students: Students) -> None:
    """The evaluation report as JSON and Markdown on the stage's run (and as JSON on the
    pipeline's parent run), with which student was kept."""
    log.info("distill: evaluation report (test set, CPU, 1 thread)\n%s", table)
    st.tracker.log_dict(st.run_id, report, EVALUATION_ARTIFACT)
    st.tracker.log_text(st.run_id, table + "\n", EVALUATION_TABLE_ARTIFACT)
    st.tracker.log_dict(st.run.parent_run_id, report, EVALUATION_ARTIFACT)
    for run_id in (st.run_id, st.run.parent_run_id):
        st.tracker.log_dict(run_id, students.kept.to_dict(), KEPT_STUDENT_ARTIFACT)


def _log_distill(
    st: Stage,
    dcfg: Any,
    students: Students,
    teacher_form: str,
    form_ms: Mapping[str, float],
    metrics: Mapping[str, float],
) -> None:
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
