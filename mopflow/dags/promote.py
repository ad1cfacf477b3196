"""mopflow_promote: make a registered model version the champion, or roll the champion back, by hand.

Trigger with ``{"action": "promote", "name": "mopflow-student", "version": 3}`` or
``{"action": "rollback", "name": "mopflow-student"}``. The Params are validated in the trigger
form and the REST API (action enum, model-name pattern, version >= 1); the task refuses a
promotion without a version, an unknown model or version, and a rollback with no previous
champion, without retrying. Each task body is one call into ``mopflow.registry.model_registry``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Param, dag, task

from mopflow.operators import retry_args

# Same rule as compression's registered-model names (mopflow.training.config.check_name).
MODEL_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


def _fail(exc: Exception) -> Exception:
    from airflow.sdk.exceptions import AirflowFailException

    return AirflowFailException(f"{type(exc).__name__}: {exc}")


@dag(
    dag_id="mopflow_promote",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,  # alias changes of one registry happen one at a time
    tags=["mopflow"],
    params={
        "action": Param(
            "promote",
            enum=["promote", "rollback"],
            description="promote: make VERSION the champion; rollback: bring the previous champion back",
        ),
        "name": Param(
            "mopflow-student",
            type="string",
            pattern=MODEL_NAME_PATTERN,
            description="Registered model name, e.g. mopflow-student or mopflow-ensemble",
        ),
        "version": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            description="Model version to promote (>= 1); required for promote, ignored for rollback",
        ),
    },
    default_args={"execution_timeout": timedelta(minutes=5), **retry_args()},
    doc_md=__doc__,
)
def mopflow_promote() -> None:
    @task.branch(execution_timeout=timedelta(minutes=1), **retry_args())
    def choose(params: dict[str, Any] | None = None) -> str:
        return "rollback" if (params or {})["action"] == "rollback" else "promote"

    @task(execution_timeout=timedelta(minutes=5), **retry_args())
    def promote(params: dict[str, Any] | None = None) -> str:
        from mopflow.operators.connections import connection_settings
        from mopflow.registry.model_registry import RegistryError, promote, registry_client

        if (params or {}).get("version") is None:
            raise _fail(ValueError("action=promote needs a version (an integer >= 1)"))
        try:
            with connection_settings():  # the MLflow connection, when there is one
                return promote(registry_client(), str(params["name"]), str(params["version"]))  # type: ignore[index]
        except RegistryError as exc:
            raise _fail(exc) from exc

    @task(execution_timeout=timedelta(minutes=5), **retry_args())
    def rollback(params: dict[str, Any] | None = None) -> str:
        from mopflow.operators.connections import connection_settings
        from mopflow.registry.model_registry import RegistryError, registry_client, rollback

        try:
            with connection_settings():
                return rollback(registry_client(), str((params or {})["name"]))
        except RegistryError as exc:
            raise _fail(exc) from exc

    choose() >> [promote(), rollback()]


promote_dag = mopflow_promote()
