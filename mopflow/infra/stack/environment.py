"""The environments of the processes mopflow starts: what every service inherits, the ``MOPFLOW_*``
settings that point tasks and workers at the stack, and Airflow's own settings (shared with
``mopflow run``'s embedded Airflow, so that the two cannot drift apart)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from mopflow.base.airflow_home import embedded_airflow_env
from mopflow.base.settings import Settings
from mopflow.infra.stack.config import DEFAULT_HOST, StackPorts, url_host

# MLflow client variables that say where runs go (``set_tracking_uri`` exports some of them): a stale
# one would send a server's or a task's writes elsewhere. Others (``MLFLOW_S3_ENDPOINT_URL``) are kept.
_MLFLOW_WHERE = ("MLFLOW_TRACKING_", "MLFLOW_REGISTRY_", "MLFLOW_EXPERIMENT_", "MLFLOW_RUN_")


def bin_first_on_path(path: str, bin_dir: str) -> str:
    """``PATH`` with the venv's ``bin`` in it, first unless it was there already (Airflow starts
    its parts as a bare ``airflow``)."""
    if bin_dir in path.split(os.pathsep):
        return path
    return bin_dir + (os.pathsep + path if path else "")


def base_env(environ: Mapping[str, str], bin_dir: str) -> dict[str, str]:
    """The inherited environment minus MLflow's "where do runs go" variables (see ``_MLFLOW_WHERE``),
    with the venv's ``bin`` first on PATH."""
    env = {k: v for k, v in environ.items() if not k.startswith(_MLFLOW_WHERE)}
    env["PATH"] = bin_first_on_path(env.get("PATH", ""), bin_dir)
    return env


def mopflow_env(settings: Settings, ports: StackPorts, host: str = DEFAULT_HOST) -> dict[str, str]:
    """The ``MOPFLOW_*`` settings every task and worker sees: the same home, data, artifacts and
    study storage as the CLI, with tracking and compute pointed at the stack's servers on ``host``."""
    where = url_host(host)
    return {
        "MOPFLOW_HOME": settings.home,
        "MOPFLOW_DATA_ROOT": settings.data_root,
        "MOPFLOW_ARTIFACT_ROOT": settings.artifact_root,
        "MOPFLOW_MLFLOW_ARTIFACTS": settings.mlflow_artifact_location,
        "MOPFLOW_EXPERIMENT": settings.experiment_name,
        "MOPFLOW_OPTUNA_STORAGE": settings.optuna_storage,
        "MOPFLOW_STORAGE_OPTIONS": json.dumps(dict(settings.storage_options)),
        "MOPFLOW_AIRFLOW_HOME": settings.airflow_home,
        "MOPFLOW_TRACKING_URI": f"http://{where}:{ports.mlflow}",
        "MOPFLOW_DASK_ADDRESS": f"tcp://{where}:{ports.dask_scheduler}",
        "MOPFLOW_DASK_WORKERS": str(settings.dask_workers),
    }


def airflow_env(
    airflow_home: str,
    environ: Mapping[str, str],
    bin_dir: str,
    ports: StackPorts | None = None,
    host: str = DEFAULT_HOST,
) -> dict[str, str]:
    """Airflow's settings for an Airflow mopflow runs: its home (SQLite metadata there unless the
    environment names a database), its DAGs and plugins folders, the venv's ``bin`` on PATH.

    ``mopflow run``'s embedded Airflow needs no more. The stack's (``ports`` given) also serves
    the api-server, and the Execution API the tasks call, on ``host`` and the stack's port, its log
    servers on the stack's ports, and tunables the environment may override."""
    env = {
        **embedded_airflow_env(airflow_home, environ),
        "PATH": bin_first_on_path(environ.get("PATH", ""), bin_dir),
    }
    if ports is None:
        return env
    api = f"http://{url_host(host)}:{ports.airflow}"
    env |= {
        "AIRFLOW__API__HOST": host,
        "AIRFLOW__API__PORT": str(ports.airflow),
        # Without these, every task tries the Execution API on localhost:8080 and fails.
        "AIRFLOW__API__BASE_URL": api,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api}/execution/",
        # Fixed defaults (8793/8794) would collide between two stacks on one host.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(ports.airflow_worker_logs),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(ports.airflow_trigger_logs),
    }
    # Tunables the user may override from the environment: one api-server worker on a small host,
    # new DAG files seen within 30 s instead of 5 min.
    defaults = {
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "AIRFLOW__CORE__PARALLELISM": "4",  # task instances running at once (LocalExecutor processes)
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",  # a Celery worker's task processes (Airflow's default: 16)
    }
    env.update({k: v for k, v in defaults.items() if k not in environ})
    return env
