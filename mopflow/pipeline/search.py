"""Stage 2: the Optuna study, its trials trained on Dask; one nested MLflow run per trial."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mopflow.base.optuna_storage import redact_url
from mopflow.base.settings import Settings
from mopflow.base.tag_names import (
    AIRFLOW_RUN_ID,
    BEST_PARAMS,
    DAG_ID,
    MANIFEST_HASH,
    RUN_KEY,
    STAGE,
    STUDY,
    TRIAL,
    TRIAL_STATE,
    WORKER,
)
from mopflow.base.tracking import Tracker
from mopflow.pipeline.config import ConfigError, PipelineConfig
from mopflow.pipeline.context import Stage, lineage_tags, stage, study_name_for
from mopflow.pipeline.hosts import check_cluster_hosts
from mopflow.pipeline.paths import FIGURES_FOLDER, LEADERBOARD_ARTIFACT, MOP_FOLDER, SEARCH_SPACE_ARTIFACT
from mopflow.pipeline.records import RunContext, SearchRecord, ShardRecord
from mopflow.training.models.families import DataSpec

log = logging.getLogger(__name__)

TRIAL_STATES = ("COMPLETE", "PRUNED", "FAIL")


def champion_warm_start(client: Any, cfg: PipelineConfig) -> Any:
    """The current champion student's best-trial configuration as a warm start, or None when
    there is no champion yet or its version does not record the configuration."""
    from mopflow.registry.model_registry import CHAMPION, alias_version
    from mopflow.training.search.study import WarmStart

    name = f"{cfg.registry.model_name}-student"
    champion = alias_version(client, name, CHAMPION)
    if champion is None:
        log.info("search: warm start requested but %s has no champion yet; starting cold", name)
        return None
    raw = champion.tags.get(BEST_PARAMS)
    if not raw:
        log.warning("search: %s v%s records no %s; starting cold", name, champion.version, BEST_PARAMS)
        return None
    return WarmStart(params=json.loads(raw), source=f"{name} v{champion.version} ({CHAMPION})")


def search_stage(
    conf: Mapping[str, Any] | None,
    run: RunContext,
    shard: ShardRecord,
    settings: Settings | None = None,
) -> SearchRecord:
    """Run (or resume) the pipeline run's study; returns its name, trial counts and best trial."""
    from mopflow.registry.model_registry import registry_client
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.compute.devices import device_for_cluster
    from mopflow.training.data import load_manifest
    from mopflow.training.search.scaling import log_volatile
    from mopflow.training.search.sweep import run_strategy_search

    def lineage(cfg: PipelineConfig, run: RunContext) -> dict[str, str]:
        return {
            MANIFEST_HASH: shard.manifest_hash,
            STUDY: study_name_for(cfg, run),
        }

    with stage("search", conf, run, settings, lineage) as st:
        settings, cfg = st.settings, st.cfg
        study = study_name_for(cfg, st.run)
        params = {k: v for k, v in cfg.search.model_dump().items() if k != "space"}
        params["worker_schedule"] = cfg.to_conf()["worker_schedule"]  # its spec, as the conf gives it
        st.tracker.log_params(st.run_id, params)
        manifest = load_manifest(shard.manifest_uri, st.storage_options)
        data = DataSpec.from_manifest(manifest)
        try:  # every family the config names takes this data, or nothing trains (a permanent error)
            cfg.check_fits_data(data)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        space = cfg.search.search_space(data.modality)
        st.tracker.log_dict(st.run_id, space.model_dump(), SEARCH_SPACE_ARTIFACT)
        log_trial = trial_logger(st, lineage(cfg, st.run))
        warm = champion_warm_start(registry_client(settings), cfg) if cfg.search.warm_start else None
        with dask_client(
            settings.dask_address, settings.dask_workers, settings.accelerator, settings.trials_per_gpu
        ) as client:
            check_cluster_hosts(client, settings)  # before any training: a cluster across hosts
            device = device_for_cluster(client, settings.accelerator, settings.precision)
            log.info("search: training on %s (precision %s)", device.accelerator, device.precision)
            st.tracker.log_params(
                st.run_id, {"accelerator": device.accelerator, "precision": device.precision}
            )
            outcome = run_strategy_search(
                cfg.search,
                shard.manifest_uri,
                study,
                settings.optuna_storage,
                settings.artifact_root,
                client,
                st.storage_options,
                on_trial_done=log_trial,
                warm_start=warm,
                min_complete=cfg.ensemble.top_k,
                device=device,
                study_attrs=study_attrs(st),
            )
        for result in outcome.results:  # trials finished by an earlier attempt but never logged
            log_trial(result)
        _log_mop_epochs(st.tracker, st.run_id, outcome.epoch_records)
        _log_search_figures(st.tracker, st.run_id, outcome.study_name, outcome.storage_url)
        log_volatile(st.tracker, st.run_id, outcome)  # worker_schedule n_j per round; spot_trace account
        counts = _log_leaderboard(st, outcome)
        best = outcome.complete()
        if not best:
            raise RuntimeError(f"study {study} finished with no COMPLETE trial ({counts})")
        st.tracker.log_metrics(st.run_id, {"best_val_acc": best[0].value or 0.0})
        if outcome.utilisation is not None:  # the rest of the workers' time went to fixed costs
            st.tracker.log_metrics(st.run_id, {"worker_utilisation": round(outcome.utilisation, 3)})
    log.info(
        "search: study %s done: %s; best trial %d val_acc=%.4f", study, counts, best[0].number, best[0].value
    )
    return SearchRecord(
        study_name=study,
        storage_url=redact_url(settings.optuna_storage),  # shown in XCom: no password
        counts=counts,
        best_trial=best[0].number,
        best_val_acc=best[0].value,
    )


def study_attrs(st: Stage) -> dict[str, str]:
    """What the study records of its run: the run key, the DAG run, the MLflow runs (the
    pipeline's and the search stage's), so that a study in optuna-dashboard leads to them."""
    run = st.run
    return {
        RUN_KEY: run.run_key,
        DAG_ID: run.dag_id,
        AIRFLOW_RUN_ID: run.airflow_run_id,
        "mopflow.mlflow_parent_run_id": run.parent_run_id,
        "mopflow.mlflow_search_run_id": st.run_id,
    }


def trial_logger(st: Stage, lineage: Mapping[str, str]) -> Callable[[Any], None]:
    """A callback that logs one finished trial as a nested MLflow run of the search stage's run
    (once: a trial already logged by an earlier attempt is not logged again)."""
    study = lineage[STUDY]

    def log_trial(result: Any) -> None:
        tracker, number = st.tracker, str(result.number)
        if tracker.find_run({RUN_KEY: st.run.run_key, STUDY: study, TRIAL: number}):
            return
        tags = {**lineage_tags(st.run), **lineage, STAGE: "trial", TRIAL: number}
        trial_run = tracker.start_run(f"trial-{result.number}", tags, parent_run_id=st.run_id)
        tracker.log_params(trial_run, result.params)
        for key in ("val_acc", "train_loss"):
            tracker.log_metric_history(trial_run, key, [(int(h["epoch"]), h[key]) for h in result.history])
        tracker.set_tags(trial_run, {TRIAL_STATE: result.state, WORKER: result.worker})
        if result.pruned_epoch is not None:
            tracker.log_metrics(trial_run, {"pruned_epoch": result.pruned_epoch})
        if result.error:
            tracker.set_tags(trial_run, {"mopflow.fail_reason": result.error[:4000]})
        if result.bundle_uri:
            tracker.log_remote_dir(trial_run, result.bundle_uri, "checkpoint", st.storage_options)
        tracker.log_metrics(trial_run, {"duration_s": result.duration_s, "num_params": result.num_params})
        tracker.end_run(trial_run, "FAILED" if result.state == "FAIL" else "FINISHED")

    return log_trial


def _log_leaderboard(st: Stage, outcome: Any) -> dict[str, int]:
    """The leaderboard artifact and the trial counts; returns the counts per state."""
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
    st.tracker.log_dict(st.run_id, leaderboard, LEADERBOARD_ARTIFACT)
    counts = {s: sum(1 for r in outcome.results if r.state == s) for s in TRIAL_STATES}
    st.tracker.log_metrics(st.run_id, {f"trials_{k.lower()}": v for k, v in counts.items()})
    # work lost with preempted or killed workers and done again (0 on a calm cluster)
    st.tracker.log_metrics(st.run_id, {"redone_unit_seconds": outcome.redone_unit_seconds})
    return counts


def _log_search_figures(tracker: Tracker, run_id: str, study_name: str, storage_url: str) -> None:
    """The study's optimisation history, learning curves and parameter importances as figures of
    the search run (``figures/<kind>.png``). A figure the study cannot give (too few trials) is
    skipped with its reason, logged and kept in ``figures/skipped.json``; a picture never fails
    the search."""
    import optuna

    from mopflow.base.optuna_storage import make_storage
    from mopflow.training.search.figures import FIGURE_KINDS, FigureUnavailable, draw

    try:
        study = optuna.load_study(study_name=study_name, storage=make_storage(storage_url))
    except Exception as exc:
        log.warning("search: no figures: study %s not readable: %s: %s", study_name, type(exc).__name__, exc)
        return
    skipped: dict[str, str] = {}
    for kind in FIGURE_KINDS:
        try:
            tracker.log_figure(run_id, draw(study, kind), f"{FIGURES_FOLDER}/{kind}.png")
        except FigureUnavailable as exc:
            skipped[kind] = exc.reason
            log.info("search: figure %s skipped: %s", kind, exc.reason)
        except Exception as exc:  # drawing or logging failed: the search's results still count
            skipped[kind] = f"{type(exc).__name__}: {exc}"
            log.warning("search: figure %s skipped: %s", kind, skipped[kind])
    if skipped:
        tracker.log_dict(run_id, skipped, f"{FIGURES_FOLDER}/skipped.json")


def _log_mop_epochs(tracker: Tracker, run_id: str, epoch_records: Mapping[int, list[dict[str, Any]]]) -> None:
    """Per MOP epoch: a Gantt chart (worker x time, a colour per model), unit timings, idle fraction."""
    import tempfile
    from pathlib import Path

    from mopflow.training.executors.gantt import gantt_png, idle_fraction

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
            tracker.log_artifacts(run_id, tmp, MOP_FOLDER)
