"""mopflow_retrain: scheduled retraining, warm-started from the champion, ending with the promotion gate.

Runs ``start → shard → search → ensemble → distill → register → finalize`` (the tasks of
``mopflow.operators``; each makes one call into ``mopflow.pipeline``). It runs on its
timetable (``MOPFLOW_RETRAIN_SCHEDULE``, default ``@weekly``; ``none`` = only on data events)
*and* whenever the ``mopflow_sharded_dataset`` Asset gets an event, i.e. when a sweep sharded
new data; such a run trains on the data (and registers the model) the event names, with its
own Params for the rest. ``MOPFLOW_RETRAIN_CONFIG`` (a YAML file of config keys) sets those Params'
defaults. Its own shard task publishes no event, so a retrain never triggers another one.
The search enqueues the current champion's params as its first trial (``warm_start``) and learns
from the newest earlier study of the same dataset (``warm_start_studies=1``); the register task is
the promotion gate (challenger, and champion when it passes).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable, dag

from mopflow.operators import SHARDED_DATASET, conf_params, pipeline, retry_args

SCHEDULE_ENV = os.environ.get("MOPFLOW_RETRAIN_SCHEDULE", "@weekly").strip()


# Unpausing never starts a retrain at once: the first timed run is the next cron time. Airflow's
# default (run_immediately=False) still runs the latest cron time when it lies within a tenth of
# the period (16.8 h for @weekly), so a DAG unpaused on a Sunday would retrain at once.
RUN_IMMEDIATELY = timedelta(0)


def retrain_defaults() -> dict[str, Any]:
    """mopflow_retrain's Param defaults: ``warm_start``, ``warm_start_studies`` and the keys of
    ``MOPFLOW_RETRAIN_CONFIG`` (a YAML file of config keys, validated when the DAG file is parsed)."""
    from mopflow.pipeline.conf_input import retrain_defaults as defaults

    return defaults(os.environ)


def _schedule(cron: str) -> Any:
    """Cron (or preset) OR a new sharded dataset; only the Asset when the cron is ``none``/empty."""
    if cron.lower() in {"", "none"}:
        return SHARDED_DATASET
    timetable = CronTriggerTimetable(cron, timezone="UTC", run_immediately=RUN_IMMEDIATELY)
    return AssetOrTimeSchedule(timetable=timetable, assets=SHARDED_DATASET)


@dag(
    dag_id="mopflow_retrain",
    schedule=_schedule(SCHEDULE_ENV),
    # No start_date: the first timed run is the next cron time. With a start_date in the past,
    # unpausing the DAG would start a full retrain at once for the latest missed week.
    catchup=False,
    max_active_runs=1,
    tags=["mopflow"],
    params=conf_params(retrain_defaults()),
    default_args={**retry_args()},
    doc_md=__doc__,
)
def mopflow_retrain() -> None:
    pipeline(publish_new_shards=False)


retrain_dag = mopflow_retrain()
