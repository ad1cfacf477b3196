"""The TaskFlow tasks of :mod:`mopflow.operators` and what they share: Params, retries, the stage call."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, AssetAlias, Param, task

from mopflow.base.settings import TRAINING_POOL
from mopflow.pipeline.config import ADVANCED_SECTION, FORM_KEYS, conf_json_schema

# The sharded dataset: an event means "a sweep sharded data nobody had sharded before".
SHARDED_DATASET = Asset("mopflow_sharded_dataset")
# Sweeps publish through this alias so that an event is emitted only when shards are new.
NEW_SHARDS = AssetAlias("mopflow_new_shards")

# A task argument: an XCom reference while wiring, the upstream task's record (as XCom) at run time.
Ref = Any


def retry_args() -> dict[str, Any]:
    """Retries with exponential backoff for failures a retry can fix (a lost worker, a busy DB)."""
    return {
        "retries": int(os.environ.get("MOPFLOW_TASK_RETRIES", "2")),
        "retry_delay": timedelta(seconds=float(os.environ.get("MOPFLOW_RETRY_DELAY_S", "30"))),
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": timedelta(minutes=10),
    }


def conf_params(defaults: Mapping[str, Any] | None = None) -> dict[str, Param]:
    """One Param per config key, from the config's JSON schema; ``defaults`` override some defaults.

    The keys in :data:`FORM_KEYS` come first in the form; the others go to an "Advanced" section.
    """
    schemas = conf_json_schema()
    unknown = sorted(set(defaults or {}) - set(schemas))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown} in DAG defaults; expected some of {sorted(schemas)}"
        )
    order = [k for k in FORM_KEYS if k in schemas] + [k for k in schemas if k not in FORM_KEYS]
    params: dict[str, Param] = {}
    for key in order:
        schema = dict(schemas[key])
        if key in (defaults or {}):
            schema["default"] = (defaults or {})[key]
        if key not in FORM_KEYS:
            schema["section"] = ADVANCED_SECTION
        default = schema.pop("default")
        description = schema.pop("description")
        params[key] = Param(default, description=description, **schema)
    return params


def call_stage(
    stage: Callable[..., Any], *args: Any, with_params: bool = True, **kwargs: Any
) -> dict[str, Any]:
    """Run one pipeline stage, with the run's config first unless ``with_params`` is False: the
    upstream records arrive as XCom dicts and are made records again, and the stage's record
    leaves as an XCom dict. Errors a retry cannot fix (a bad record among them) fail the task
    at once."""
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    from mopflow.operators.connections import connection_settings
    from mopflow.pipeline.context import permanent_errors
    from mopflow.pipeline.records import from_xcom

    try:
        records = [from_xcom(arg) if isinstance(arg, Mapping) else arg for arg in args]
        with connection_settings():  # mopflow's Airflow Connections, as the settings' variables
            if with_params:
                result = stage(run_conf(get_current_context(), records), *records, **kwargs)
            else:
                result = stage(*records, **kwargs)
        xcom: dict[str, Any] = result.to_xcom()
        return xcom
    except permanent_errors() as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


def run_conf(context: Any, records: list[Any] | tuple[Any, ...] = ()) -> dict[str, Any]:
    """The run's Params; in a run triggered by new shards, with the data and model the event
    carries; and, on top, the config keys an upstream task gave the run's start (its context,
    the first of ``records``)."""
    from mopflow.pipeline.data_events import conf_with_data_events
    from mopflow.pipeline.records import RunContext

    events = (context.get("triggering_asset_events") or {}).get(SHARDED_DATASET, [])
    extras = [dict(event.extra or {}) for event in sorted(events, key=lambda event: event.timestamp)]
    conf = conf_with_data_events(dict(context["params"]), extras)
    run = next((record for record in records if isinstance(record, RunContext)), None)
    return {**conf, **run.conf_overrides} if run is not None else conf


def _publish_new_shards(ctx_xcom: Mapping[str, Any], shard_xcom: Mapping[str, Any]) -> None:
    """Emit a ``mopflow_sharded_dataset`` event (extra: manifest URI and hash, dataset, and the conf
    the retrain it triggers trains on) when the shard task wrote new shards; none when it reused
    them."""
    from airflow.sdk import get_current_context

    from mopflow.pipeline.data_events import EVENT_CONF_KEY, event_conf
    from mopflow.pipeline.records import RunContext, ShardRecord

    shard_record = ShardRecord.from_xcom(shard_xcom)
    if shard_record.reused:
        return
    context = get_current_context()
    conf = run_conf(context, [RunContext.from_xcom(ctx_xcom)])
    extra: dict[str, Any] = {
        "manifest_uri": shard_record.manifest_uri,
        "manifest_hash": shard_record.manifest_hash,
        "dataset": str(conf.get("dataset")),
        EVENT_CONF_KEY: event_conf(conf),
    }
    context["outlet_events"][NEW_SHARDS].add(SHARDED_DATASET, extra=extra)


_RETRY = retry_args()


@task(execution_timeout=timedelta(minutes=5), **_RETRY)
def start(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Validate the run's config (``overrides``, config keys from an upstream task, on top of the
    Params) and open the run's MLflow parent run; its context goes to every later task."""
    from airflow.sdk import get_current_context

    from mopflow.pipeline.run import start_pipeline

    context = get_current_context()
    return call_stage(
        start_pipeline, context["dag"].dag_id, context["run_id"], overrides=dict(overrides or {})
    )


@task(execution_timeout=timedelta(minutes=30), **_RETRY)
def shard(ctx: Ref, publish_new_shards: bool = False) -> dict[str, Any]:
    """Shard the dataset (reused when the same data was sharded before). With ``publish_new_shards``
    (and ``outlets=[NEW_SHARDS]`` in ``.override``), new shards emit a ``mopflow_sharded_dataset``
    event."""
    from mopflow.pipeline.shard import shard_stage

    result = call_stage(shard_stage, ctx)
    if publish_new_shards:
        _publish_new_shards(ctx, result)
    return result


# Training tasks share the pool: at most its slots train at once across all DAG runs.
@task(execution_timeout=timedelta(hours=6), pool=TRAINING_POOL, **_RETRY)
def search(ctx: Ref, shards: Ref) -> dict[str, Any]:
    """Run (or resume) the run's Optuna study on the Dask workers."""
    from mopflow.pipeline.search import search_stage

    return call_stage(search_stage, ctx, shards)


@task(execution_timeout=timedelta(minutes=30), **_RETRY)
def ensemble(ctx: Ref, shards: Ref, study: Ref) -> dict[str, Any]:
    """Ensemble the study's best trials."""
    from mopflow.pipeline.ensemble import ensemble_stage

    return call_stage(ensemble_stage, ctx, shards, study)


@task(execution_timeout=timedelta(hours=2), pool=TRAINING_POOL, **_RETRY)
def distill(ctx: Ref, shards: Ref, ens: Ref) -> dict[str, Any]:
    """Distil the ensemble into a small student (and train its hard-label twin)."""
    from mopflow.pipeline.distill import distill_stage

    return call_stage(distill_stage, ctx, shards, ens)


@task(execution_timeout=timedelta(minutes=30), **_RETRY)
def register(ctx: Ref, shards: Ref, study: Ref, ens: Ref, student: Ref) -> dict[str, Any]:
    """Register the student in the MLflow Model Registry behind the promotion gate."""
    from mopflow.pipeline.register import register_stage

    return call_stage(register_stage, ctx, shards, study, ens, student)


# Runs whatever happened upstream: closes MLflow runs, fails the DAG run without a summary.
@task(trigger_rule="all_done", retries=1, execution_timeout=timedelta(minutes=10))
def finalize(ctx: Ref) -> dict[str, Any]:
    """Close the run's MLflow runs (any left RUNNING too); fail the DAG run without a summary."""
    from mopflow.pipeline.run import finalize_pipeline

    return call_stage(finalize_pipeline, ctx, with_params=False)  # needs no conf


def pipeline(overrides: Ref = None, publish_new_shards: bool = False) -> Any:
    """Wire ``start → shard → search → ensemble → distill → register → finalize`` in the current
    DAG; returns the register task's output. ``overrides``: config keys (a dict, or an upstream
    task's output that is one) on top of the Params. With ``publish_new_shards`` the shard task
    emits a ``mopflow_sharded_dataset`` event when it wrote new shards."""
    ctx = start(overrides)
    shard_task = shard.override(outlets=[NEW_SHARDS]) if publish_new_shards else shard
    shards = shard_task(ctx, publish_new_shards=publish_new_shards)
    study = search(ctx, shards)
    ens = ensemble(ctx, shards, study)
    student = distill(ctx, shards, ens)
    registered = register(ctx, shards, study, ens, student)
    registered >> finalize(ctx)
    return registered
