"""The first and last task of a pipeline run: open its parent MLflow run, and close everything."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mopflow.base import storage
from mopflow.base.settings import Settings
from mopflow.base.stopping import ended_status, raise_if_stopped
from mopflow.base.tag_names import RUN_KEY, STAGE
from mopflow.pipeline.config import PipelineConfig
from mopflow.pipeline.context import PipelineFailed, make_run_key, run_tags, tracker_for
from mopflow.pipeline.paths import CONFIG_ARTIFACT, run_paths
from mopflow.pipeline.records import RunContext, RunResult

log = logging.getLogger(__name__)


def start_pipeline(
    conf: Mapping[str, Any] | None,
    dag_id: str,
    airflow_run_id: str,
    settings: Settings | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RunContext:
    """Validate the conf (with ``overrides``, config keys an upstream task gave, on top) and open
    (or reopen) the pipeline's parent MLflow run. The run's context carries the overrides to every
    later stage."""
    settings = settings or Settings.from_env()
    overrides = dict(overrides or {})
    cfg = PipelineConfig.from_conf({**(conf or {}), **overrides})
    key = make_run_key(dag_id, airflow_run_id)
    tracker = tracker_for(settings)
    parent = tracker.get_or_start_run(
        f"pipeline-{key}", {**run_tags(dag_id, airflow_run_id, key), STAGE: "pipeline"}
    )
    tracker.log_params(parent, {k: v for k, v in cfg.to_conf().items() if k != "search_space"})
    tracker.log_dict(parent, cfg.to_conf(), CONFIG_ARTIFACT)
    log.info("pipeline %s: run key %s, MLflow parent run %s", dag_id, key, parent)
    return RunContext(
        dag_id=dag_id,
        airflow_run_id=airflow_run_id,
        run_key=key,
        parent_run_id=parent,
        conf_overrides=overrides,
    )


def finalize_pipeline(run: RunContext, settings: Settings | None = None) -> RunResult:
    """Last task (runs whatever happened upstream): close the parent run and any run left RUNNING.

    Raises when the pipeline did not produce its summary, so the Airflow run is marked failed.
    """
    settings = settings or Settings.from_env()
    tracker = tracker_for(settings)
    summary = run_paths(settings, run.run_key).summary
    succeeded = storage.exists(summary, settings.storage_options)
    leftovers = [
        r
        for r in tracker.find_runs({RUN_KEY: run.run_key})
        if r.info.status == "RUNNING" and r.info.run_id != run.parent_run_id
    ]
    status = ended_status()  # KILLED when the run was asked to stop
    for leftover in leftovers:
        log.warning(
            "finalize: run %s (%s) was left RUNNING; marking it %s",
            leftover.info.run_id,
            leftover.info.run_name,
            status,
        )
        tracker.end_run(leftover.info.run_id, status)
    tracker.end_run(run.parent_run_id, "FINISHED" if succeeded else status)
    if not succeeded:
        raise_if_stopped()  # stopped: a permanent error, the task is not retried
        # the verdict on the run, not a fault: retrying finalize cannot change it
        raise PipelineFailed(f"pipeline run {run.run_key} did not complete (no summary at {summary})")
    return RunResult(run_key=run.run_key, summary_uri=summary)
