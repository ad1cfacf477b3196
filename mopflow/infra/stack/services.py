"""What a service of the stack is: the services by name, what is started for one (its spec), how
its health is checked, and how a started one is recorded."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

SERVICE_ORDER = ("mlflow", "dask-scheduler", "dask-workers", "optuna-dashboard", "serve", "airflow")
# With the CeleryExecutor the Airflow components run as services of their own ("airflow" is then
# the api-server); they start after it and stop before it.
CELERY_SERVICES = ("airflow-scheduler", "airflow-dag-processor", "airflow-triggerer", "airflow-celery-worker")


class HealthCheck(BaseModel):
    """One probe: an HTTP GET answering 200 (``http``; with ``expect``, a body holding that text,
    so that another program's server on the port is not taken for ours), a TCP connect (``tcp``), Airflow's
    health JSON with a healthy metadata DB and scheduler (``airflow``), a Dask scheduler
    with at least ``min_workers`` workers (``dask_workers``), or ``mopflow serve``'s health JSON
    (``serve``: up, with or without a champion yet; the detail says which version it serves)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["http", "tcp", "airflow", "dask_workers", "serve"]
    url: str
    min_workers: int = 0
    expect: str = ""


class ServiceSpec(BaseModel):
    """What to start for one service: command line, environment, health checks, URL to show."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    url: str
    checks: tuple[HealthCheck, ...]
    ports: tuple[int, ...] = ()


class ServiceRecord(BaseModel):
    """A started service as recorded in the state file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    pid: int
    create_time: float  # the process's start time: a reused pid is never mistaken for ours
    argv: tuple[str, ...]
    log: str
    url: str
    checks: tuple[HealthCheck, ...]
    ports: tuple[int, ...] = ()
