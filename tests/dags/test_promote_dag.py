"""mopflow_promote's tasks against a real MLflow registry: promote, idempotent repeat, rollback, refusals."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def promote_dag(tmp_path_factory: pytest.TempPathFactory) -> Any:
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow_home")))
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "promote.py"))
    assert bag.import_errors == {}
    return bag.dags["mopflow_promote"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A fresh MLflow registry (SQLite under a temp MOPFLOW_HOME) and a factory of models with versions."""
    home = tmp_path_factory.mktemp("promote") / "home"
    with pytest.MonkeyPatch.context() as mp:
        for var in list(os.environ):
            if var.startswith(("MOPFLOW_", "MLFLOW_")):
                mp.delenv(var, raising=False)
        mp.setenv("MOPFLOW_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", "")  # restored after MLflow exports its own
        from mopflow.registry.model_registry import registry_client

        client = registry_client()
        source = home / "model"
        source.mkdir(parents=True)
        (source / "MLmodel").write_text("flavors: {}\n")

        def make(name: str, versions: int = 3) -> str:
            client.create_registered_model(name)
            for _ in range(versions):
                client.create_model_version(name, source=str(source))
            return name

        yield client, make


def _run(dag: Any, task_id: str, **params: Any) -> Any:
    """Call the task's body as the worker would, with these Params."""
    return dag.get_task(task_id).python_callable(params={"action": task_id, **params})


def test_branch_follows_the_action(promote_dag: Any) -> None:
    choose = promote_dag.get_task("choose").python_callable
    assert choose(params={"action": "promote"}) == "promote"
    assert choose(params={"action": "rollback"}) == "rollback"


def test_promote_then_rollback(promote_dag: Any, registry: Any) -> None:
    from mopflow.registry.model_registry import CHAMPION

    client, make = registry
    make("t-student")

    assert "champion none -> 1" in _run(promote_dag, "promote", name="t-student", version=1)
    assert "champion 1 -> 3" in _run(promote_dag, "promote", name="t-student", version=3)
    # Rerunning the same task changes nothing (idempotent) and keeps the rollback history intact.
    _run(promote_dag, "promote", name="t-student", version=3)
    assert str(client.get_model_version_by_alias("t-student", CHAMPION).version) == "3"
    assert "3 -> 1 (rolled back)" in _run(promote_dag, "rollback", name="t-student")
    assert str(client.get_model_version_by_alias("t-student", CHAMPION).version) == "1"


def test_bad_requests_fail_without_retry(promote_dag: Any, registry: Any) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    registry[1]("u-student")
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("promote", {"name": "u-student", "version": None}, "needs a version"),
        ("promote", {"name": "u-student", "version": 9}, "no version '9'"),
        ("promote", {"name": "nobody", "version": 1}, "nobody"),
        ("rollback", {"name": "u-student"}, "no previous champion"),
        ("rollback", {"name": "nobody"}, "nobody"),
    ]
    for task_id, params, needle in cases:
        with pytest.raises(AirflowFailException, match=needle):
            _run(promote_dag, task_id, **params)
