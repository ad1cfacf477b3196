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
    monkeypatch.setattr(warm_executor, "settle_heap_before_forks", lambda: order.append("heap frozen"))
    monkeypatch.setattr(LocalExecutor, "start", lambda self: order.append("workers forked"))
    WarmLocalExecutor.start(object.__new__(WarmLocalExecutor))
    assert order == ["imported", "heap frozen", "workers forked"]
    assert import_task_stack(("json", "no_such_module_here")) == ["no_such_module_here"]


def test_celery_workers_of_the_stack_import_the_stack_before_their_pool_forks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expected: every Celery service of the stack reads the warm configuration (unless the user
    named one), which is Airflow's own; a worker's start (``worker_init``) imports the stack."""
    from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
    from celery.signals import worker_init

    from mopflow.infra.stack.airflow_services import WARM_CELERY_CONFIG
    from mopflow.plugins import warm_celery

    env = {"AIRFLOW__CELERY__BROKER_URL": "redis://127.0.0.1:6379/0"}
    specs = airflow_specs("CeleryExecutor", env, PORTS, "/bin")
    assert {s.env["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"] for s in specs} == {WARM_CELERY_CONFIG}
    mine = env | {"AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "my_company.celery.CONFIG"}
    assert {
        s.env["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"]
        for s in airflow_specs("CeleryExecutor", mine, PORTS, "/bin")
    } == {"my_company.celery.CONFIG"}
    assert f"{warm_celery.__name__}.CELERY_CONFIG" == WARM_CELERY_CONFIG
    assert dict(DEFAULT_CELERY_CONFIG) == warm_celery.CELERY_CONFIG
    imported: list[str] = []
    monkeypatch.setattr(warm_celery, "import_task_stack", lambda: imported.append("stack") or [])
    monkeypatch.setattr(warm_celery, "settle_heap_before_forks", lambda: imported.append("heap frozen"))
    worker_init.send(sender=None)
    assert imported == ["stack", "heap frozen"]
