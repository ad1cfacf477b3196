"""mopflow_sweep: a model-selection sweep triggered by hand from the Airflow UI or the REST API.

The trigger form exposes every pipeline config key, each with its description and JSON-schema
validation (bad values are refused in the form and by ``POST /api/v2/dags/mopflow_sweep/dagRuns``);
the keys a sweep is usually tuned by come first (dataset, search space, strategy, workers,
epochs, trials, time budget, sampler, pruner, seed, top_k, student size budget, promotion
policy), the rest under "Advanced". Same tasks as ``mopflow_retrain``; when the shard task
writes new shards it publishes the ``mopflow_sharded_dataset`` Asset, which triggers a retrain.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag

from mopflow.operators import conf_params, pipeline, retry_args


@dag(
    dag_id="mopflow_sweep",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=4,
    tags=["mopflow"],
    params=conf_params(),
    default_args={**retry_args()},
    doc_md=__doc__,
)
def mopflow_sweep() -> None:
    pipeline(publish_new_shards=True)


sweep_dag = mopflow_sweep()
