"""mopflow's stages as Airflow TaskFlow tasks, for your own DAGs (and the shipped ones).

Each task makes one call into the stage layer, :mod:`mopflow.pipeline`, through :func:`call_stage`:
upstream records arrive as XCom and become typed records again, the stage's record leaves as
XCom (small references only: URIs, ids, a few figures), and an error a retry cannot fix fails
the task at once. The run's config is the DAG run's Params (:func:`conf_params` makes them from
mopflow's config model), with the keys an upstream task of yours hands :data:`start` on top::

    from airflow.sdk import dag, task
    from mopflow.operators import conf_params, pipeline

    @dag(params=conf_params({"n_trials": 8}))
    def my_pipeline():
        @task
        def prepare() -> dict:
            ...  # write a parquet table under a data root
            return {"dataset": "/data/prepared/table.parquet", "label_column": "label"}

        pipeline(overrides=prepare())

The tasks are ``start``, ``shard``, ``search``, ``ensemble``, ``distill``, ``register`` and
``finalize`` (each one can be used alone and changed with ``.override(...)``); :func:`pipeline` wires
them as ``mopflow_retrain`` and ``mopflow_sweep`` do. The DAG needs the ``mopflow_training`` pool
(``mopflow up`` creates it; ``dag.test()`` runs without it) and mopflow's settings in the task's environment.
"""

from mopflow.operators.tasks import (
    NEW_SHARDS,
    SHARDED_DATASET,
    call_stage,
    conf_params,
    distill,
    ensemble,
    finalize,
    pipeline,
    register,
    retry_args,
    run_conf,
    search,
    shard,
    start,
)

__all__ = [
    "NEW_SHARDS",
    "SHARDED_DATASET",
    "call_stage",
    "conf_params",
    "distill",
    "ensemble",
    "finalize",
    "pipeline",
    "register",
    "retry_args",
    "run_conf",
    "search",
    "shard",
    "start",
]
