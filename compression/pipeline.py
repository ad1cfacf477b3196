"""The pipeline's stages, one function per Airflow task: shard, search, ensemble, distill, register.

Each stage re-validates the flat conf (the trigger form validated it too), opens its own
nested MLflow run under the pipeline's parent run, does its work through ``training`` /
``compression``, and returns a small dict of references (URIs, ids, figures) for XCom.
Every stage is idempotent: outputs are keyed by content hash or by the pipeline run key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from compression.config import PipelineConfig
from infra import progress, storage
from infra.memory import measured_stage
from infra.optuna_storage import redact_url
from infra.settings import Settings
from infra.stopping import PipelineStopped, ended_status, raise_if_stopped
from infra.tracking import MlflowTracker
from infra.version import code_version
from training.families import DataSpec, get_family

log = logging.getLogger(__name__)

STAGE_TAG = "mopflow.stage"


class PipelineFailed(RuntimeError):
    """A pipeline run ended without its summary (an upstream stage failed)."""


def permanent_errors() -> tuple[type[BaseException], ...]:
    """Errors that a retry cannot fix (bad config, bad data): the task fails at once."""
    from compression.config import ConfigError
    from compression.distill import StudentBudgetError
    from infra.optuna_storage import StorageConfigError
    from training.data import DataValidationError, ShardIntegrityError
    from training.space import SpaceError

    return (
        PipelineStopped,
        PipelineFailed,
        ConfigError,
        SpaceError,
        ShardIntegrityError,
        DataValidationError,
        StudentBudgetError,
        StorageConfigError,
    )


@dataclass(frozen=True)
class RunContext:
    """Identity of one pipeline run (passed between tasks through XCom as a dict)."""

    dag_id: str
    airflow_run_id: str
    run_key: str
    parent_run_id: str

    def tags(self) -> dict[str, str]:
        return {
            "mopflow.dag_id": self.dag_id,
            "mopflow.airflow_run_id": self.airflow_run_id,
            "mopflow.run_key": self.run_key,
            "mopflow.code_version": code_version(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunContext:
        return cls(**{k: str(data[k]) for k in ("dag_id", "airflow_run_id", "run_key", "parent_run_id")})


def make_run_key(dag_id: str, airflow_run_id: str) -> str:
    """Stable key of a pipeline run (logical_date may be null in Airflow 3: never key on it)."""
    return hashlib.sha256(f"{dag_id}/{airflow_run_id}".encode()).hexdigest()[:12]


def _tracker(settings: Settings) -> MlflowTracker:
    return MlflowTracker(settings.tracking_uri, settings.experiment_name, settings.mlflow_artifact_location)


def _stage_run(
    tracker: MlflowTracker, ctx: RunContext, stage: str, extra: Mapping[str, str] | None = None
) -> str:
    raise_if_stopped()  # a stage does not start in a run asked to stop (its retry neither)
    progress.publish("stage", stage=stage)
    tags = {**ctx.tags(), STAGE_TAG: stage, **(extra or {})}
    return tracker.get_or_start_run(stage, tags, parent_run_id=ctx.parent_run_id)


FAILURE_FILE = "failure.json"


def _stage_failed(
    tracker: MlflowTracker, settings: Settings, ctx: RunContext, run_id: str, stage: str, exc: Exception
) -> None:
    """End a failed stage's MLflow run (KILLED when the run was stopped) and record the error as
    the run's root cause (``failure.json`` in the run's folder; a stage's last attempt writes
    it, and no stage runs after a failed one), so the end of the run can name it."""
    tracker.end_run(run_id, ended_status())
    failure = {
        "stage": stage,
        "error": type(exc).__name__,
        "message": str(exc)[:4000],
        "permanent": isinstance(exc, permanent_errors()),
    }
    storage.write_json_atomic(
        storage.join(_run_dir(settings, ctx), FAILURE_FILE), failure, settings.storage_options
    )


def read_failure(settings: Settings, run_key: str) -> dict[str, Any] | None:
    """The root cause recorded for a failed pipeline run (None if none was recorded)."""
    uri = storage.join(settings.artifact_root, "runs", run_key, FAILURE_FILE)
    if not storage.exists(uri, settings.storage_options):
        return None
    failure: dict[str, Any] = storage.read_json(uri, settings.storage_options)
    return failure


def _run_dir(settings: Settings, ctx: RunContext) -> str:
    return storage.join(settings.artifact_root, "runs", ctx.run_key)


def study_name_for(cfg: PipelineConfig, ctx: RunContext) -> str:
    """One study per pipeline run: rerunning the run resumes it instead of starting another."""
    return f"{cfg.registry.model_name}-{ctx.run_key}"


# ---------------------------------------------------------------------------------------------


def start_pipeline(
    conf: Mapping[str, Any] | None, dag_id: str, airflow_run_id: str, settings: Settings | None = None
) -> dict[str, Any]:
    """Validate the conf and open (or reopen) the pipeline's parent MLflow run."""
    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    key = make_run_key(dag_id, airflow_run_id)
    tracker = _tracker(settings)
    base_tags = {
        "mopflow.dag_id": dag_id,
        "mopflow.airflow_run_id": airflow_run_id,
        "mopflow.run_key": key,
        "mopflow.code_version": code_version(),
        STAGE_TAG: "pipeline",
    }
    parent = tracker.get_or_start_run(f"pipeline-{key}", base_tags)
    tracker.log_params(parent, {k: v for k, v in cfg.to_conf().items() if k != "search_space"})
    tracker.log_dict(parent, cfg.to_conf(), "config.json")
    log.info("pipeline %s: run key %s, MLflow parent run %s", dag_id, key, parent)
    return asdict(RunContext(dag_id, airflow_run_id, key, parent))


@measured_stage("shard")
def shard_stage(
    conf: Mapping[str, Any] | None, ctx_dict: Mapping[str, Any], settings: Settings | None = None
) -> dict[str, Any]:
    """Stage 1: generate and shard the dataset on Dask; returns the manifest URI and hash."""
    from training.cluster import dask_client
    from training.data import shard_dataset

    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    ctx = RunContext.from_dict(ctx_dict)
    tracker = _tracker(settings)
    run_id = _stage_run(tracker, ctx, "shard")
    try:
        storage.check_output_location(settings.data_root, settings.storage_options, "MOPFLOW_DATA_ROOT")
        storage.check_output_location(
            settings.artifact_root, settings.storage_options, "MOPFLOW_ARTIFACT_ROOT"
        )
        with dask_client(settings.dask_address, settings.dask_workers) as client:
            result = shard_dataset(cfg.data, settings.data_root, client, settings.storage_options)
        manifest = storage.read_json(result.manifest_uri, settings.storage_options)
        lineage = {"mopflow.manifest_hash": result.manifest_hash}
        tracker.set_tags(run_id, lineage)
        tracker.set_tags(ctx.parent_run_id, lineage)
        tracker.log_params(run_id, cfg.data.model_dump())
        tracker.log_metrics(
            run_id, {f"rows_{s}": sum(e["rows"] for e in manifest["splits"][s]) for s in manifest["splits"]}
        )
        tracker.log_dict(run_id, manifest, "manifest.json")
        tracker.end_run(run_id)
    except Exception as exc:
        _stage_failed(tracker, settings, ctx, run_id, "shard", exc)
        raise
    return {
        "manifest_uri": result.manifest_uri,
        "manifest_hash": result.manifest_hash,
        "reused": result.reused,
    }


BEST_PARAMS_TAG = "mopflow.best_trial_params"


def champion_warm_start(client: Any, cfg: PipelineConfig) -> Any:
    """The current champion student's best-trial configuration as a warm start, or None when
    there is no champion yet or its version does not record the configuration."""
    from compression.registry import CHAMPION, alias_version
    from training.search import WarmStart

    name = f"{cfg.registry.model_name}-student"
    champion = alias_version(client, name, CHAMPION)
    if champion is None:
        log.info("search: warm start requested but %s has no champion yet; starting cold", name)
        return None
    raw = champion.tags.get(BEST_PARAMS_TAG)
    if not raw:
        log.warning("search: %s v%s records no %s; starting cold", name, champion.version, BEST_PARAMS_TAG)
        return None
    return WarmStart(params=json.loads(raw), source=f"{name} v{champion.version} ({CHAMPION})")


@measured_stage("search")
def search_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Stage 2: the Optuna study, trials trained in parallel on Dask; one nested MLflow run per trial."""
    from training.cluster import dask_client
    from training.data import load_manifest
    from training.devices import device_for_cluster
    from training.executor_search import run_strategy_search
    from training.trial import TrialResult
    from training.volatile.scaling import log_volatile

    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    ctx = RunContext.from_dict(ctx_dict)
    tracker = _tracker(settings)
    study = study_name_for(cfg, ctx)
    lineage = {"mopflow.manifest_hash": str(shard["manifest_hash"]), "mopflow.study": study}
    run_id = _stage_run(tracker, ctx, "search", lineage)
    params = {k: v for k, v in cfg.search.model_dump().items() if k != "space"}
    params["worker_schedule"] = cfg.to_conf()["worker_schedule"]  # its spec, as the conf gives it
    tracker.log_params(run_id, params)
    modality = DataSpec.from_manifest(
        load_manifest(str(shard["manifest_uri"]), settings.storage_options)
    ).modality
    tracker.log_dict(run_id, cfg.search.search_space(modality).model_dump(), "search_space.json")

    def log_trial(result: TrialResult) -> None:
        tags = {**ctx.tags(), **lineage, STAGE_TAG: "trial", "mopflow.trial": str(result.number)}
        if tracker.find_run(
            {"mopflow.run_key": ctx.run_key, "mopflow.study": study, "mopflow.trial": str(result.number)}
        ):
            return
        trial_run = tracker.start_run(f"trial-{result.number}", tags, parent_run_id=run_id)
        tracker.log_params(trial_run, result.params)
        tracker.log_metric_history(
            trial_run, "val_acc", [(int(h["epoch"]), h["val_acc"]) for h in result.history]
        )
        tracker.log_metric_history(
            trial_run, "train_loss", [(int(h["epoch"]), h["train_loss"]) for h in result.history]
        )
        tracker.set_tags(trial_run, {"mopflow.trial_state": result.state, "mopflow.worker": result.worker})
        if result.pruned_epoch is not None:
            tracker.log_metrics(trial_run, {"pruned_epoch": result.pruned_epoch})
        if result.error:
            tracker.set_tags(trial_run, {"mopflow.fail_reason": result.error[:4000]})
        if result.bundle_uri:
            tracker.log_remote_dir(trial_run, result.bundle_uri, "checkpoint", settings.storage_options)
        tracker.log_metrics(trial_run, {"duration_s": result.duration_s, "num_params": result.num_params})
        tracker.end_run(trial_run, "FAILED" if result.state == "FAIL" else "FINISHED")

    warm = champion_warm_start(tracker.client, cfg) if cfg.search.warm_start else None
    try:
        with dask_client(
            settings.dask_address, settings.dask_workers, settings.accelerator, settings.trials_per_gpu
        ) as client:
            device = device_for_cluster(client, settings.accelerator, settings.precision)
            log.info("search: training on %s (precision %s)", device.accelerator, device.precision)
            tracker.log_params(run_id, {"accelerator": device.accelerator, "precision": device.precision})
            outcome = run_strategy_search(
                cfg.search,
                str(shard["manifest_uri"]),
                study,
                settings.optuna_storage,
                settings.artifact_root,
                client,
                settings.storage_options,
                on_trial_done=log_trial,
                warm_start=warm,
                min_complete=cfg.ensemble.top_k,
                device=device,
            )
        for result in outcome.results:  # trials finished by an earlier attempt but never logged
            log_trial(result)
        _log_mop_epochs(tracker, run_id, outcome.epoch_records)
        log_volatile(tracker, run_id, outcome)  # worker_schedule n_j per round; spot_trace account
        leaderboard = [
            {
                "trial": r.number,
                "state": r.state,
                "val_acc": r.value,
                "pruned_epoch": r.pruned_epoch,
                "params": r.params,
                "duration_s": round(r.duration_s, 2),
            }
            for r in sorted(outcome.results, key=lambda r: (-(r.value or -1.0), r.number))
        ]
        tracker.log_dict(run_id, leaderboard, "leaderboard.json")
        counts = {s: sum(1 for r in outcome.results if r.state == s) for s in ("COMPLETE", "PRUNED", "FAIL")}
        tracker.log_metrics(run_id, {f"trials_{k.lower()}": v for k, v in counts.items()})
        # work lost with preempted or killed workers and done again (0 on a calm cluster)
        tracker.log_metrics(run_id, {"redone_unit_seconds": outcome.redone_unit_seconds})
        best = outcome.complete()
        if not best:
            raise RuntimeError(f"study {study} finished with no COMPLETE trial ({counts})")
        tracker.log_metrics(run_id, {"best_val_acc": best[0].value or 0.0})
        tracker.end_run(run_id)
    except Exception as exc:
        _stage_failed(tracker, settings, ctx, run_id, "search", exc)
        raise
    log.info(
        "search: study %s done: %s; best trial %d val_acc=%.4f", study, counts, best[0].number, best[0].value
    )
    return {
        "study_name": study,
        "storage_url": redact_url(settings.optuna_storage),  # shown in XCom: no password
        "counts": counts,
        "best_trial": best[0].number,
        "best_val_acc": best[0].value,
    }


def _log_mop_epochs(
    tracker: MlflowTracker, run_id: str, epoch_records: Mapping[int, list[dict[str, Any]]]
) -> None:
    """Per MOP epoch: a Gantt chart (worker x time, a colour per model), unit timings, idle fraction."""
    import tempfile
    from pathlib import Path

    from training.executors.gantt import gantt_png, idle_fraction

    for epoch, records in sorted(epoch_records.items()):
        if not records:
            continue
        idle = idle_fraction(records)
        durations = [r["end"] - r["start"] for r in records]
        tracker.log_metrics(
            run_id,
            {"mop_idle_fraction": idle, "mop_unit_seconds_mean": sum(durations) / len(durations)},
            step=epoch,
        )
        with tempfile.TemporaryDirectory() as tmp:
            gantt_png(records, str(Path(tmp) / f"gantt-epoch-{epoch + 1:03d}.png"))
            Path(tmp, f"units-epoch-{epoch + 1:03d}.json").write_text(
                json.dumps(records, indent=1, default=str)
            )
            tracker.log_artifacts(run_id, tmp, "mop")


def _load_candidates(search: Mapping[str, Any], storage_url: str) -> list[Any]:
    import optuna

    from compression.ensemble import Candidate
    from infra.optuna_storage import make_storage, quiet_optuna
    from training.search import STALE_ATTR
    from training.space import params_from_optuna

    quiet_optuna()
    study = optuna.load_study(study_name=str(search["study_name"]), storage=make_storage(storage_url))
    return [
        Candidate(
            t.number, t.state.name, t.value, t.user_attrs.get("bundle_uri"), params_from_optuna(t.params)
        )
        for t in study.get_trials(deepcopy=False)
        if not t.user_attrs.get(STALE_ATTR)
    ]


def _example_frame(manifest_uri: str, storage_options: Mapping[str, Any]) -> Any:
    """A few validation examples as the model's input example: a frame of a table's columns, or
    an array of tensors ``(n, *shape)`` for images and sequences."""
    import pandas as pd

    from training.data import load_manifest, load_split

    manifest = load_manifest(manifest_uri, storage_options)
    x, _ = load_split(manifest_uri, "validation", storage_options)
    data = DataSpec.from_manifest(manifest)
    if data.modality != "table":  # a tensor of examples: the signature is a TensorSpec
        return x[:5].reshape(-1, *data.input_shape)
    return pd.DataFrame(x[:5], columns=manifest["feature_columns"])


@measured_stage("ensemble")
def ensemble_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    search: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Stage 3: the top-k COMPLETE trials as one probability-averaging module, logged as a pyfunc."""
    from compression.ensemble import build_ensemble, choose_members, save_ensemble
    from compression.registry import log_bundle_model
    from training.bundle import accuracy, load_bundle
    from training.data import load_split

    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    ctx = RunContext.from_dict(ctx_dict)
    so = settings.storage_options
    tracker = _tracker(settings)
    lineage = {
        "mopflow.manifest_hash": str(shard["manifest_hash"]),
        "mopflow.study": str(search["study_name"]),
    }
    run_id = _stage_run(tracker, ctx, "ensemble", lineage)
    try:
        manifest_uri = str(shard["manifest_uri"])
        x_val, y_val = load_split(manifest_uri, "validation", so)
        x_test, y_test = load_split(manifest_uri, "test", so)
        candidates = _load_candidates(search, settings.optuna_storage)
        members, weights = choose_members(
            candidates, cfg.ensemble.selection, cfg.ensemble.top_k, x_val, y_val, so
        )
        ensemble, archs, columns = build_ensemble(members, so, weights)
        best = sorted(members, key=lambda m: (-(m.value or 0.0), m.number))[0]
        best_test = accuracy(load_bundle(str(best.bundle_uri), so).module, x_test, y_test)
        metrics = {
            "val_acc": accuracy(ensemble, x_val, y_val),
            "test_acc": accuracy(ensemble, x_test, y_test),
            "num_params": float(sum(p.numel() for p in ensemble.parameters())),
            "best_trial_val_acc": float(best.value or 0.0),
            "best_trial_test_acc": best_test,
        }
        bundle_uri = storage.join(_run_dir(settings, ctx), "ensemble")
        save_ensemble(
            bundle_uri,
            ensemble,
            archs,
            columns,
            {
                "members": [m.number for m in members],
                "study": search["study_name"],
                "manifest_hash": shard["manifest_hash"],
            },
            so,
        )
        tracker.log_params(
            run_id,
            {
                "top_k": cfg.ensemble.top_k,
                "selection": cfg.ensemble.selection,
                "members": [m.number for m in members],
                "member_weights": [round(w, 4) for w in ensemble.weights.tolist()],
            },
        )
        tracker.log_metrics(run_id, metrics)
        model_uri = log_bundle_model(run_id, "ensemble", bundle_uri, _example_frame(manifest_uri, so), so)
        tracker.end_run(run_id)
    except Exception as exc:
        _stage_failed(tracker, settings, ctx, run_id, "ensemble", exc)
        raise
    log.info(
        "ensemble: members %s val_acc=%.4f test_acc=%.4f (%d params)",
        [m.number for m in members],
        metrics["val_acc"],
        metrics["test_acc"],
        int(metrics["num_params"]),
    )
    return {
        "bundle_uri": bundle_uri,
        "model_uri": model_uri,
        "run_id": run_id,
        "members": [m.number for m in members],
        "member_weights": ensemble.weights.tolist(),
        "best_trial_bundle": best.bundle_uri,
        "best_trial": {
            "number": best.number,
            "params": dict(best.params),
            "val_acc": best.value,
            "test_acc": best_test,
        },
        # XCom travels as JSON through the API server: NaN/inf are not JSON, so they become null.
        **{k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()},
    }


@measured_stage("distill")
def distill_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    ensemble: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Stage 4: a student (<= ratio x the ensemble's params) trained on soft targets + hard labels,
    beside the same student on hard labels alone; INT8 quantization; the evaluation report."""
    import numpy as np
    import torch

    from compression.distill import (
        matching_epochs,
        plan_student,
        student_accuracy,
        train_student,
        transfer_set,
    )
    from compression.ensemble import faster_form
    from compression.evaluate import (
        evaluate,
        format_table,
        quantize_int8,
        quantize_static_int8,
        serialized_bytes,
    )
    from compression.registry import log_bundle_model
    from training.bundle import ProbabilityEnsemble, load_bundle, save_bundle
    from training.data import load_manifest, load_split
    from training.devices import local_device

    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    dcfg = cfg.distill
    ctx = RunContext.from_dict(ctx_dict)
    so = settings.storage_options
    tracker = _tracker(settings)
    run_id = _stage_run(tracker, ctx, "distill", {"mopflow.manifest_hash": str(shard["manifest_hash"])})
    try:
        torch.set_num_threads(1)  # small models: one thread is fastest, more only contend with each other
        manifest_uri = str(shard["manifest_uri"])
        manifest = load_manifest(manifest_uri, so)
        teacher_bundle = load_bundle(str(ensemble["bundle_uri"]), so)
        # The loop or the stacked (vmap) form of the ensemble, whichever is faster on this machine.
        teacher, form_ms = faster_form(teacher_bundle.module, len(manifest["feature_columns"]))
        x_train, y_train = load_split(manifest_uri, "train", so)
        x_val, y_val = load_split(manifest_uri, "validation", so)
        x_test, y_test = load_split(manifest_uri, "test", so)
        data = DataSpec.from_manifest(manifest)
        dcfg = dcfg.resolved(data.modality)
        plan = plan_student(dcfg, teacher_bundle.num_params(), data)
        log.info(
            "distill: student %s %s, %d params (budget %d, ensemble %d)",
            plan.arch.family,
            plan.arch.params,
            plan.num_params,
            plan.budget,
            teacher_bundle.num_params(),
        )
        # Transfer set: the training data, plus synthetic points near it labelled by the ensemble.
        x_transfer, y_transfer = transfer_set(x_train, y_train, teacher, dcfg, cfg.search.seed, data)
        log.info(
            "distill: transfer set has %d real + %d %s points",
            len(x_train),
            len(x_transfer) - len(x_train),
            dcfg.transfer,
        )
        norm = manifest["normalization"]
        device = local_device(settings.accelerator, settings.precision)
        log.info("distill: training the student on %s (precision %s)", device.accelerator, device.precision)
        student, history = train_student(
            plan,
            dcfg,
            x_transfer,
            y_transfer,
            x_val,
            y_val,
            norm["mean"],
            norm["std"],
            teacher,
            cfg.search.seed,
            device=device,
        )
        # The baseline: same student, real data only, as many steps (same LR schedule).
        baseline_epochs = matching_epochs(dcfg.epochs, len(x_transfer), len(x_train))
        log.info(
            "distill: training the hard-label baseline (same student, no soft targets, %d epochs)",
            baseline_epochs,
        )
        baseline, _ = train_student(
            plan,
            dcfg,
            x_train,
            y_train,
            x_val,
            y_val,
            norm["mean"],
            norm["std"],
            None,
            cfg.search.seed,
            epochs=baseline_epochs,
            device=device,
        )
        quantized = quantize_int8(student)
        # static INT8 needs the quantizable families' layout (conv-ReLU pairs); others skip it
        quantized_static = (
            quantize_static_int8(student, x_train[:2048])
            if get_family(plan.arch.family).quantizable
            else None
        )
        metrics = {
            "val_acc": student_accuracy(student, x_val, y_val),
            "test_acc": student_accuracy(student, x_test, y_test),
            "num_params": float(plan.num_params),
            "param_ratio": plan.num_params / teacher_bundle.num_params(),
            "hard_label_test_acc": student_accuracy(baseline, x_test, y_test),
            "int8_test_acc": student_accuracy(quantized, x_test, y_test),
        }
        if quantized_static is not None:
            metrics["int8_static_test_acc"] = student_accuracy(quantized_static, x_test, y_test)
        bundle_uri = storage.join(_run_dir(settings, ctx), "student")
        save_bundle(
            bundle_uri,
            [student],
            [plan.arch],
            manifest["feature_columns"],
            {"teacher": ensemble["bundle_uri"], "temperature": dcfg.temperature, "alpha": dcfg.alpha},
            so,
        )
        # The evaluation report: every model the pipeline produced, on the same test set.
        best = load_bundle(str(ensemble["best_trial_bundle"]), so)
        student_probs = ProbabilityEnsemble([student]).eval()
        baseline_probs = ProbabilityEnsemble([baseline]).eval()
        models = {
            f"best trial #{ensemble['best_trial']['number']}": (
                best.module,
                best.num_params(),
                serialized_bytes(best.module),
            ),
            "ensemble": (teacher, teacher_bundle.num_params(), serialized_bytes(teacher_bundle.module)),
            "student": (student_probs, plan.num_params, serialized_bytes(student)),
            "student int8 (dynamic)": (quantized, plan.num_params, serialized_bytes(quantized)),
        }
        if quantized_static is not None:
            models["student int8 (static)"] = (
                quantized_static,
                plan.num_params,
                serialized_bytes(quantized_static),
            )
        models["hard-label student"] = (baseline_probs, plan.num_params, serialized_bytes(baseline))
        report = evaluate(models, x_test, y_test)
        table = format_table(report)
        log.info("distill: evaluation report (test set, CPU, 1 thread)\n%s", table)
        gain = metrics["test_acc"] - metrics["hard_label_test_acc"]
        headroom = float(ensemble["test_acc"]) - metrics["hard_label_test_acc"]
        metrics["recovered_gain"] = gain / headroom if headroom > 0 else float("nan")
        tracker.log_dict(run_id, report, "evaluation.json")
        tracker.log_text(run_id, table + "\n", "evaluation.md")
        tracker.log_dict(ctx.parent_run_id, report, "evaluation.json")
        tracker.log_params(
            run_id,
            dcfg.model_dump()
            | {
                "student_width_used": plan.arch.params.get("width"),
                "hard_label_epochs": baseline_epochs,
                "teacher_form": type(teacher).__name__,
                "teacher_form_ms": {k: round(v, 3) for k, v in form_ms.items()},
            },
        )
        tracker.log_metric_history(
            run_id, "epoch_val_acc", [(int(h["epoch"]), h["val_acc"]) for h in history]
        )
        tracker.log_metrics(run_id, {k: v for k, v in metrics.items() if np.isfinite(v)})
        model_uri = log_bundle_model(run_id, "student", bundle_uri, _example_frame(manifest_uri, so), so)
        tracker.end_run(run_id)
    except Exception as exc:
        _stage_failed(tracker, settings, ctx, run_id, "distill", exc)
        raise
    log.info(
        "distill: student test_acc=%.4f (hard-label %.4f, int8 %.4f) with %d params (%.1f%% of the ensemble)",
        metrics["test_acc"],
        metrics["hard_label_test_acc"],
        metrics["int8_test_acc"],
        plan.num_params,
        100 * metrics["param_ratio"],
    )
    return {
        "bundle_uri": bundle_uri,
        "model_uri": model_uri,
        "run_id": run_id,
        "arch": plan.arch.to_dict(),
        "evaluation": report,
        # XCom travels as JSON through the API server: NaN/inf are not JSON, so they become null.
        **{k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()},
    }


@measured_stage("register")
def register_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    search: Mapping[str, Any],
    ensemble: Mapping[str, Any],
    distill: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Stage 5: register ensemble and student; alias the student challenger, and champion if it passes the gate."""
    import mlflow

    from compression.registry import (
        CHALLENGER,
        CHAMPION,
        PromotionDecision,
        alias_version,
        decide_promotion,
        register_version,
        set_alias,
    )
    from training.data import load_manifest, load_split

    settings = settings or Settings.from_env()
    cfg = PipelineConfig.from_conf(conf)
    ctx = RunContext.from_dict(ctx_dict)
    so = settings.storage_options
    tracker = _tracker(settings)
    client = tracker.client
    run_id = _stage_run(tracker, ctx, "register", {"mopflow.manifest_hash": str(shard["manifest_hash"])})
    try:
        student_name = f"{cfg.registry.model_name}-student"
        ensemble_name = f"{cfg.registry.model_name}-ensemble"
        version_tags = {
            "mopflow.manifest_hash": str(shard["manifest_hash"]),
            "mopflow.study": str(search["study_name"]),
        }
        ens_version = register_version(
            client, ensemble_name, str(ensemble["model_uri"]), ctx.run_key, version_tags
        )
        student_version = register_version(
            client,
            student_name,
            str(distill["model_uri"]),
            ctx.run_key,
            version_tags
            | {
                "mopflow.test_acc": f"{distill['test_acc']:.6f}",
                # what a warm-started retraining sweep tries first
                BEST_PARAMS_TAG: json.dumps(ensemble["best_trial"]["params"], sort_keys=True),
            },
        )
        # The gate compares against the current champion evaluated on *this* run's test set.
        champion = alias_version(client, student_name, CHAMPION)
        champion_acc: float | None = None
        if champion is not None and str(champion.version) != str(student_version.version):
            manifest_uri = str(shard["manifest_uri"])
            manifest = load_manifest(manifest_uri, so)
            x_test, y_test = load_split(manifest_uri, "test", so)
            import pandas as pd

            champ_model = mlflow.pyfunc.load_model(f"models:/{student_name}@{CHAMPION}")
            probs = champ_model.predict(pd.DataFrame(x_test, columns=manifest["feature_columns"]))
            champion_acc = float((probs.to_numpy().argmax(axis=1) == y_test).mean())
        decision = decide_promotion(
            cfg.registry.promotion,
            float(distill["test_acc"]),
            champion_acc,
            float(ensemble["test_acc"]),
            cfg.registry.max_gap_to_ensemble,
        )
        if champion is not None and str(champion.version) == str(student_version.version):
            decision = PromotionDecision(True, "this version is already the champion")
        set_alias(client, student_name, CHALLENGER, str(student_version.version))
        set_alias(client, ensemble_name, CHALLENGER, str(ens_version.version))
        if decision.promote:
            set_alias(client, student_name, CHAMPION, str(student_version.version))
            set_alias(client, ensemble_name, CHAMPION, str(ens_version.version))
        aliases = [CHALLENGER] + ([CHAMPION] if decision.promote else [])
        tracker.set_tags(
            run_id,
            {"mopflow.promoted": str(decision.promote).lower(), "mopflow.promotion_reason": decision.reason},
        )
        tracker.log_params(
            run_id, {"student_model": student_name, "student_version": student_version.version}
        )
        log.info(
            "register: %s v%s aliases %s (%s)",
            student_name,
            student_version.version,
            aliases,
            decision.reason,
        )
        summary = {
            "run_key": ctx.run_key,
            "dag_id": ctx.dag_id,
            "airflow_run_id": ctx.airflow_run_id,
            "manifest_hash": shard["manifest_hash"],
            "trials": search["counts"],
            "best_trial": ensemble["best_trial"],
            "ensemble": {
                "members": ensemble["members"],
                "member_weights": ensemble.get("member_weights"),
                "val_acc": ensemble["val_acc"],
                "test_acc": ensemble["test_acc"],
                "num_params": int(ensemble["num_params"]),
                "registered": {"name": ensemble_name, "version": str(ens_version.version)},
            },
            "evaluation": distill.get("evaluation", []),
            "student": {
                "hard_label_test_acc": distill.get("hard_label_test_acc"),
                "int8_test_acc": distill.get("int8_test_acc"),
                "recovered_gain": distill.get("recovered_gain"),
                "arch": distill["arch"],
                "val_acc": distill["val_acc"],
                "test_acc": distill["test_acc"],
                "num_params": int(distill["num_params"]),
                "param_ratio": distill["param_ratio"],
            },
            "registered": {
                "name": student_name,
                "version": str(student_version.version),
                "aliases": aliases,
                "promoted": decision.promote,
                "reason": decision.reason,
                "previous_champion_test_acc": champion_acc,
                "model_uri": f"models:/{student_name}@{CHAMPION if decision.promote else CHALLENGER}",
            },
            "mlflow": {
                "tracking_uri": settings.tracking_uri,
                "experiment": settings.experiment_name,
                "parent_run_id": ctx.parent_run_id,
            },
            "optuna": {"storage": str(search["storage_url"]), "study_name": str(search["study_name"])},
        }
        tracker.log_dict(ctx.parent_run_id, summary, "summary.json")
        storage.write_json_atomic(storage.join(_run_dir(settings, ctx), "summary.json"), summary, so)
        tracker.end_run(run_id)
    except Exception as exc:
        _stage_failed(tracker, settings, ctx, run_id, "register", exc)
        raise
    return summary


def finalize_pipeline(ctx_dict: Mapping[str, Any], settings: Settings | None = None) -> dict[str, Any]:
    """Last task (runs whatever happened upstream): close the parent run and any run left RUNNING.

    Raises when the pipeline did not produce its summary, so the Airflow run is marked failed.
    """
    settings = settings or Settings.from_env()
    ctx = RunContext.from_dict(ctx_dict)
    tracker = _tracker(settings)
    summary_uri = storage.join(_run_dir(settings, ctx), "summary.json")
    succeeded = storage.exists(summary_uri, settings.storage_options)
    leftovers = [
        r
        for r in tracker.find_runs({"mopflow.run_key": ctx.run_key})
        if r.info.status == "RUNNING" and r.info.run_id != ctx.parent_run_id
    ]
    status = ended_status()  # KILLED when the run was asked to stop
    for run in leftovers:
        log.warning(
            "finalize: run %s (%s) was left RUNNING; marking it %s",
            run.info.run_id,
            run.info.run_name,
            status,
        )
        tracker.end_run(run.info.run_id, status)
    tracker.end_run(ctx.parent_run_id, "FINISHED" if succeeded else status)
    if not succeeded:
        raise_if_stopped()  # stopped: a permanent error, the task is not retried
        # the verdict on the run, not a fault: retrying finalize cannot change it
        raise PipelineFailed(f"pipeline run {ctx.run_key} did not complete (no summary at {summary_uri})")
    summary: dict[str, Any] = storage.read_json(summary_uri, settings.storage_options)
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"summary_uri": summary_uri, "run_key": ctx.run_key}
