"""mopflow_retrain: shard → search → ensemble → distill → register, then finalize.

Wiring only: each task makes one call into ``compression.pipeline`` and passes small
references (URIs, ids) through XCom. Params are validated by JSON schema in the trigger
form and the REST API, and again by the first task.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Asset, Param, dag, task

from compression.config import conf_json_schema

# Published by the shard task: other DAGs can be scheduled on new sharded data.
SHARDED_DATASET = Asset("mopflow_sharded_dataset")
SCHEDULE = os.environ.get("MOPFLOW_RETRAIN_SCHEDULE", "@weekly")
RETRY_DELAY = timedelta(seconds=float(os.environ.get("MOPFLOW_RETRY_DELAY_S", "30")))
RETRIES = {"retries": int(os.environ.get("MOPFLOW_TASK_RETRIES", "2")), "retry_delay": RETRY_DELAY}


def _call(stage: str, *args: Any) -> Any:
    """Run one pipeline stage; errors a retry cannot fix fail the task at once."""
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    from compression import pipeline

    params = dict(get_current_context()["params"])
    try:
        return getattr(pipeline, stage)(params, *args)
    except pipeline.permanent_errors() as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


@dag(
    dag_id="mopflow_retrain",
    schedule=SCHEDULE,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["mopflow"],
    params={key: Param(**schema) for key, schema in conf_json_schema().items()},
    default_args={"execution_timeout": timedelta(hours=2), **RETRIES},
    doc_md=__doc__,
)
def mopflow_retrain() -> None:
    @task(execution_timeout=timedelta(minutes=5), **RETRIES)
    def start() -> dict[str, Any]:
        from airflow.sdk import get_current_context
        from airflow.sdk.exceptions import AirflowFailException

        from compression.pipeline import permanent_errors, start_pipeline

        context = get_current_context()
        try:
            return start_pipeline(dict(context["params"]), context["dag"].dag_id, context["run_id"])
        except permanent_errors() as exc:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc

    @task(execution_timeout=timedelta(minutes=30), outlets=[SHARDED_DATASET], **RETRIES)
    def shard(ctx: dict[str, Any]) -> dict[str, Any]:
        from airflow.sdk import get_current_context

        result: dict[str, Any] = _call("shard_stage", ctx)
        get_current_context()["outlet_events"][SHARDED_DATASET].extra = {
            k: result[k] for k in ("manifest_uri", "manifest_hash")
        }
        return result

    @task(execution_timeout=timedelta(hours=6), **RETRIES)
    def search(ctx: dict[str, Any], shards: dict[str, Any]) -> dict[str, Any]:
        return _call("search_stage", ctx, shards)

    @task(execution_timeout=timedelta(minutes=30), **RETRIES)
    def ensemble(ctx: dict[str, Any], shards: dict[str, Any], study: dict[str, Any]) -> dict[str, Any]:
        return _call("ensemble_stage", ctx, shards, study)

    @task(execution_timeout=timedelta(hours=2), **RETRIES)
    def distill(ctx: dict[str, Any], shards: dict[str, Any], ens: dict[str, Any]) -> dict[str, Any]:
        return _call("distill_stage", ctx, shards, ens)

    @task(execution_timeout=timedelta(minutes=30), **RETRIES)
    def register(
        ctx: dict[str, Any],
        shards: dict[str, Any],
        study: dict[str, Any],
        ens: dict[str, Any],
        student: dict[str, Any],
    ) -> dict[str, Any]:
        return _call("register_stage", ctx, shards, study, ens, student)

    @task(trigger_rule="all_done", retries=1, execution_timeout=timedelta(minutes=10))
    def finalize(ctx: dict[str, Any]) -> dict[str, Any]:
        from compression.pipeline import finalize_pipeline

        return finalize_pipeline(ctx)

    ctx = start()
    shards = shard(ctx)
    study = search(ctx, shards)
    ens = ensemble(ctx, shards, study)
    student = distill(ctx, shards, ens)
    registered = register(ctx, shards, study, ens, student)
    registered >> finalize(ctx)


retrain_dag = mopflow_retrain()
