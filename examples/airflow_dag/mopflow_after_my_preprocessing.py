"""Your own preprocessing, then mopflow: an example DAG built from ``mopflow.operators``.

``prepare`` stands for your own task: it writes a table (here, generated measurements of three
kinds of parts) as parquet under mopflow's data root and returns the config keys that point
mopflow at it. ``pipeline(overrides=...)`` then runs mopflow's tasks on it, ``start → shard →
search → ensemble → distill → register → finalize``, each tracked in MLflow, the student
registered behind the promotion gate. The Params (the trigger form) are mopflow's config keys.

Copy this file into your DAGs folder (mopflow installed in the Airflow environment, its settings
in the workers' environment), or try it on this machine::

    airflow dags test example_mopflow_after_my_preprocessing
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

from mopflow.operators import conf_params, pipeline


@dag(
    dag_id="example_mopflow_after_my_preprocessing",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["mopflow", "example"],
    # mopflow's config keys as Params; the table's label column is set here, its path by `prepare`
    params=conf_params({"n_trials": 8, "epochs": 6, "min_resource": 2, "student_family": "mlp"}),
    doc_md=__doc__,
)
def example_mopflow_after_my_preprocessing() -> None:
    @task
    def prepare(rows: int = 1200) -> dict[str, str]:
        """Your preprocessing: clean, join and feature-engineer, then write a table mopflow can read
        (parquet or CSV, numeric features, an integer label). Returns the config keys naming it."""
        from pathlib import Path

        import numpy as np
        import pandas as pd

        from mopflow.base.settings import Settings

        rng = np.random.default_rng(7)
        kind = rng.integers(0, 3, size=rows)
        centres = np.array([[0.0, 1.0, 2.0, 0.5], [1.5, 0.0, 0.5, 2.0], [0.5, 2.0, 0.0, 1.0]])
        features = centres[kind] + rng.normal(scale=0.6, size=(rows, 4))
        table = pd.DataFrame(features, columns=["length", "width", "weight", "hardness"])
        table["noise"] = rng.normal(size=rows)
        table["label"] = kind
        # under the data root, which the shard task reads from (MOPFLOW_DATA_ROOTS names others)
        out = Path(Settings.from_env().data_root) / "prepared" / "parts.parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        table.to_parquet(out, index=False)
        return {"dataset": str(out), "label_column": "label"}

    pipeline(overrides=prepare())


example_dag = example_mopflow_after_my_preprocessing()
