"""The LocalExecutor whose task processes fork with the training stack imported."""

from __future__ import annotations

import pytest

from mopflow.infra.stack.airflow_services import WARM_LOCAL_EXECUTOR, airflow_executor, airflow_specs
from mopflow.infra.stack.config import StackPorts
from mopflow.plugins.warm_executor import WarmLocalExecutor, import_task_stack

PORTS = StackPorts(
    airflow=20000,
    mlflow=20001,
    optuna=20002,
    serve=20003,
    dask_scheduler=20004,
    dask_dashboard=20005,
    airflow_worker_logs=20006,
    airflow_trigger_logs=20007,
)


def test_airflow_loads_the_warm_executor_by_its_path_as_a_local_executor() -> None:
    """Expected: the path the stack sets is what Airflow's executor loader imports, a local
    executor (``airflow standalone`` keeps it) that is the LocalExecutor otherwise."""
    from airflow.executors.executor_loader import ExecutorLoader
    from airflow.executors.executor_utils import ExecutorName
    from airflow.executors.local_executor import LocalExecutor

    loaded, _ = ExecutorLoader.import_executor_cls(ExecutorName(module_path=WARM_LOCAL_EXECUTOR))
    assert loaded is WarmLocalExecutor and issubclass(loaded, LocalExecutor) and loaded.is_local
    assert airflow_executor({"AIRFLOW__CORE__EXECUTOR": WARM_LOCAL_EXECUTOR}) == "LocalExecutor"


@pytest.mark.parametrize(
    ("asked", "runs"),
    [
        ("", WARM_LOCAL_EXECUTOR),
        ("LocalExecutor", WARM_LOCAL_EXECUTOR),
        ("my_company.executors.AuditedLocalExecutor", "my_company.executors.AuditedLocalExecutor"),
    ],
)
def test_the_stack_runs_the_warm_executor_where_the_local_executor_is_asked_for(
    asked: str, runs: str
) -> None:
    """Expected: unset or by name, the LocalExecutor becomes the warm one; a class of the user's stays."""
    env = {"AIRFLOW__CORE__EXECUTOR": asked} if asked else {}
    (airflow,) = airflow_specs("LocalExecutor", env, PORTS, "/bin")
    assert airflow.argv[1:] == ("standalone",) and airflow.env["AIRFLOW__CORE__EXECUTOR"] == runs


def test_the_stack_is_imported_before_the_workers_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expected: the executor imports the task stack before the LocalExecutor's start forks its
    workers; a module that cannot be imported is reported, not raised (the task that needs it
    fails on its own, naming it)."""
    from airflow.executors.local_executor import LocalExecutor

    from mopflow.plugins import warm_executor

    order: list[str] = []
    monkeypatch.setattr(warm_executor, "import_task_stack", lambda: order.append("imported") or [])
    monkeypatch.setattr(LocalExecutor, "start", lambda self: order.append("workers forked"))
    WarmLocalExecutor.start(object.__new__(WarmLocalExecutor))
    assert order == ["imported", "workers forked"]
    assert import_task_stack(("json", "no_such_module_here")) == ["no_such_module_here"]
