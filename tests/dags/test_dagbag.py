"""DAG integrity: every DAG imports, every task has retries and a timeout, every Param a schema."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory: pytest.TempPathFactory) -> object:
    home = tmp_path_factory.mktemp("airflow_home")
    os.environ.setdefault("AIRFLOW_HOME", str(home))
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_every_dag_imports(dagbag: object) -> None:
    assert dagbag.import_errors == {}  # type: ignore[attr-defined]
    assert "mopflow_retrain" in dagbag.dags  # type: ignore[attr-defined]


def test_retrain_dag_shape_and_task_settings(dagbag: object) -> None:
    dag = dagbag.dags["mopflow_retrain"]  # type: ignore[attr-defined]
    assert set(dag.task_ids) == {"start", "shard", "search", "ensemble", "distill", "register", "finalize"}
    assert dag.schedule == os.environ.get("MOPFLOW_RETRAIN_SCHEDULE", "@weekly")
    order = ["start", "shard", "search", "ensemble", "distill", "register", "finalize"]
    for upstream, downstream in zip(order, order[1:], strict=False):
        assert downstream in dag.get_task(upstream).downstream_task_ids
    for task in dag.tasks:
        assert task.retries is not None and task.retries >= 1, task.task_id
        assert task.execution_timeout is not None, task.task_id
    assert dag.get_task("finalize").trigger_rule == "all_done"
    assert [o.name for o in dag.get_task("shard").outlets] == ["mopflow_sharded_dataset"]


def test_every_param_has_a_schema_and_a_description(dagbag: object) -> None:
    from compression.config import CONF_FIELDS

    dag = dagbag.dags["mopflow_retrain"]  # type: ignore[attr-defined]
    assert set(dag.params.keys()) == set(CONF_FIELDS)
    for key in dag.params:
        param = dag.params.get_param(key)
        assert param.schema.get("type") or param.schema.get("anyOf"), key
        assert param.description, key


def test_params_refuse_bad_values_like_the_trigger_form(dagbag: object) -> None:
    from airflow.sdk.definitions.param import ParamsDict

    dag = dagbag.dags["mopflow_retrain"]  # type: ignore[attr-defined]
    good = ParamsDict(dict(dag.params.items()))
    good.validate()
    for key, value in [("n_trials", 0), ("sampler", "nope"), ("temperature", -1), ("top_k", "three")]:
        params = ParamsDict(dict(dag.params.items()))
        with pytest.raises(Exception) as info:  # noqa: B017 - Airflow raises its own ParamValidationError
            params[key] = value
            params.validate()
        assert key in str(info.value) or "valid" in str(info.value).lower()


def test_dag_file_only_wires(dagbag: object) -> None:
    text = (REPO / "dags" / "retrain.py").read_text()
    for heavy in (
        "import torch",
        "import optuna",
        "import mlflow",
        "import dask",
        "from training",
        "from infra",
    ):
        assert heavy not in text.split('"""', 2)[-1].split("def mopflow_retrain")[0], heavy
