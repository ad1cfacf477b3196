"""Wiring shared by the pipeline DAGs (``mopflow_retrain``, ``mopflow_sweep``): Params and tasks.

Not a DAG file itself. Every task body makes one call into the stage layer, ``mopflow.pipeline``
(imported inside the task), through :func:`_call`, the one place where XCom meets the stages' typed
records (``mopflow.pipeline.records``): XCom carries each record as a small JSON-able dict of
references (URIs, ids, a few figures); the Params are generated
from ``mopflow.pipeline.config.conf_json_schema``, so the trigger form, the REST API and the tasks
validate the same way.

Asset design (no trigger loop): ``mopflow_retrain`` is scheduled on the ``mopflow_sharded_dataset``
Asset (besides its timetable) and its own shard task publishes nothing. Only ``mopflow_sweep``'s
shard task publishes, through an AssetAlias, and only when it wrote new shards (a rerun or a
second sweep on the same data reuses the content-addressed shards and publishes no event).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, AssetAlias, Param, task

from mopflow.base.settings import TRAINING_POOL  # created by `mopflow up` / `mopflow run`
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


def _call(stage: Callable[..., Any], *args: Any, with_params: bool = True) -> dict[str, Any]:
    """Run one pipeline stage, with the run's Params first unless ``with_params`` is False: the
    upstream records arrive as XCom dicts and are made records again, and the stage's record
    leaves as an XCom dict. Errors a retry cannot fix (a bad record among them) fail the task
    at once."""
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    from mopflow.dags.connections import connection_settings
    from mopflow.pipeline.context import permanent_errors
    from mopflow.pipeline.records import from_xcom

    try:
        records = [from_xcom(arg) if isinstance(arg, Mapping) else arg for arg in args]
        with connection_settings():  # mopflow's Airflow Connections, as the settings' variables
            result = stage(_run_conf(get_current_context()), *records) if with_params else stage(*records)
        xcom: dict[str, Any] = result.to_xcom()
        return xcom
    except permanent_errors() as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


def _run_conf(context: Any) -> dict[str, Any]:
    """The run's Params; in a run triggered by new shards, with the data and model the event carries."""
    from mopflow.pipeline.data_events import conf_with_data_events

    events = (context.get("triggering_asset_events") or {}).get(SHARDED_DATASET, [])
    extras = [dict(event.extra or {}) for event in sorted(events, key=lambda event: event.timestamp)]
    return conf_with_data_events(dict(context["params"]), extras)


def _publish_new_shards(shard_xcom: Mapping[str, Any]) -> None:
    """Emit a ``mopflow_sharded_dataset`` event (extra: manifest URI and hash, dataset, and the conf
    the retrain it triggers trains on) when the shard task wrote new shards; none when it reused
    them."""
    from airflow.sdk import get_current_context

    from mopflow.pipeline.data_events import EVENT_CONF_KEY, event_conf
    from mopflow.pipeline.records import ShardRecord

    shard = ShardRecord.from_xcom(shard_xcom)
    if shard.reused:
        return
    context = get_current_context()
    extra: dict[str, Any] = {
        "manifest_uri": shard.manifest_uri,
        "manifest_hash": shard.manifest_hash,
        "dataset": str(context["params"].get("dataset")),
        EVENT_CONF_KEY: event_conf(_run_conf(context)),
    }
    context["outlet_events"][NEW_SHARDS].add(SHARDED_DATASET, extra=extra)


def retrain_defaults() -> dict[str, Any]:
    """mopflow_retrain's Param defaults: ``warm_start``, ``warm_start_studies`` and the keys of
    ``MOPFLOW_RETRAIN_CONFIG`` (a YAML file of config keys, validated when the DAG file is parsed)."""
    from mopflow.pipeline.conf_input import retrain_defaults as defaults

    return defaults(os.environ)


def pipeline_tasks(publish_new_shards: bool = False) -> None:
    """Define ``start → shard → search → ensemble → distill → register → finalize`` in the current DAG.

    With ``publish_new_shards`` the shard task emits a ``mopflow_sharded_dataset`` event (extra:
    manifest URI and hash, dataset) when it wrote new shards, and none when it reused them.
    """
    retry = retry_args()

    @task(execution_timeout=timedelta(minutes=5), **retry)
    def start() -> dict[str, Any]:
        from airflow.sdk import get_current_context

        from mopflow.pipeline.run import start_pipeline

        context = get_current_context()
        return _call(start_pipeline, context["dag"].dag_id, context["run_id"])

    @task(
        execution_timeout=timedelta(minutes=30),
        outlets=[NEW_SHARDS] if publish_new_shards else [],
        **retry,
    )
    def shard(ctx: Ref) -> dict[str, Any]:
        from mopflow.pipeline.shard import shard_stage

        result = _call(shard_stage, ctx)
        if publish_new_shards:
            _publish_new_shards(result)
        return result

    # Training tasks share the pool: at most its slots train at once across all DAG runs.
    @task(execution_timeout=timedelta(hours=6), pool=TRAINING_POOL, **retry)
    def search(ctx: Ref, shards: Ref) -> dict[str, Any]:
        from mopflow.pipeline.search import search_stage

        return _call(search_stage, ctx, shards)

    @task(execution_timeout=timedelta(minutes=30), **retry)
    def ensemble(ctx: Ref, shards: Ref, study: Ref) -> dict[str, Any]:
        from mopflow.pipeline.ensemble import ensemble_stage

        return _call(ensemble_stage, ctx, shards, study)

    @task(execution_timeout=timedelta(hours=2), pool=TRAINING_POOL, **retry)
    def distill(ctx: Ref, shards: Ref, ens: Ref) -> dict[str, Any]:
        from mopflow.pipeline.distill import distill_stage

        return _call(distill_stage, ctx, shards, ens)

    @task(execution_timeout=timedelta(minutes=30), **retry)
    def register(
        ctx: Ref,
        shards: Ref,
        study: Ref,
        ens: Ref,
        student: Ref,
    ) -> dict[str, Any]:
        from mopflow.pipeline.register import register_stage

        return _call(register_stage, ctx, shards, study, ens, student)

    # Runs whatever happened upstream: closes MLflow runs, fails the DAG run without a summary.
    @task(trigger_rule="all_done", retries=1, execution_timeout=timedelta(minutes=10))
    def finalize(ctx: Ref) -> dict[str, Any]:
        from mopflow.pipeline.run import finalize_pipeline

        return _call(finalize_pipeline, ctx, with_params=False)  # needs no conf

    ctx = start()
    shards = shard(ctx)
    study = search(ctx, shards)
    ens = ensemble(ctx, shards, study)
    student = distill(ctx, shards, ens)
    registered = register(ctx, shards, study, ens, student)
    registered >> finalize(ctx)
