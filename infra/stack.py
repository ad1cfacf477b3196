"""The local stack behind ``mopflow up`` / ``down`` / ``status``.

Five services on 127.0.0.1, wired to one another and to the same MOPFLOW_HOME:

- ``mlflow``: an MLflow tracking server on the settings' backend store, serving artifacts;
- ``dask-scheduler`` (with its HTTP dashboard) and ``dask-workers`` (one nanny process);
- ``optuna-dashboard`` on the study storage;
- ``airflow``: ``airflow standalone`` (scheduler, dag-processor, api-server, triggerer) on this
  project's ``dags/`` and ``plugins/``, whose task processes get the stack's MLflow and Dask
  addresses through ``MOPFLOW_TRACKING_URI`` and ``MOPFLOW_DASK_ADDRESS``. With the
  CeleryExecutor (``AIRFLOW__CORE__EXECUTOR``; standalone would force the LocalExecutor) the
  components run as services of their own instead: ``airflow`` is then the api-server, beside
  ``airflow-scheduler``, ``airflow-dag-processor``, ``airflow-triggerer`` and
  ``airflow-celery-worker`` (the broker, e.g. Redis, is not started by the stack).

The backends follow the settings (e.g. ``MOPFLOW_PROFILE=scale-out``): Airflow's metadata on
``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``, MLflow's on ``MOPFLOW_MLFLOW_BACKEND_STORE`` with its
artifacts at ``MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION``, Optuna's on ``MOPFLOW_OPTUNA_STORAGE``. A
tracking URI or Dask address on 127.0.0.1 names the server the stack itself serves; one on
another host is refused (the stack would not be the one the tasks use).

Every service runs in its own process group with its log under ``<home>/stack/logs``; pids,
ports, URLs and health checks are recorded in ``<home>/stack/state.json`` so that ``status``
and ``down`` work from any shell. The pure parts (port choice, the services' command lines and
environments, the state file, the printed summary) are separate from the edges (spawning,
probing, signalling) so that they can be tested without starting anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from infra import airflow_home
from infra.airflow_home import TRAINING_POOL, embedded_airflow_env
from infra.optuna_storage import journal_path, storage_kind
from infra.settings import Settings

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # every server binds loopback (but Airflow's log servers: hard-coded to all)
STATE_VERSION = 1

# port name -> (environment variable, default). Defaults keep optuna-dashboard off Airflow's 8080.
PORT_ENV: dict[str, tuple[str, int]] = {
    "airflow": ("MOPFLOW_AIRFLOW_PORT", 8080),
    "mlflow": ("MOPFLOW_MLFLOW_PORT", 5000),
    "optuna": ("MOPFLOW_OPTUNA_PORT", 8081),
    "serve": ("MOPFLOW_SERVE_PORT", 5001),
    "dask_scheduler": ("MOPFLOW_DASK_PORT", 8786),
    "dask_dashboard": ("MOPFLOW_DASK_DASHBOARD_PORT", 8787),
    # Airflow's scheduler and triggerer each serve their task logs on a port of their own.
    "airflow_worker_logs": ("MOPFLOW_AIRFLOW_WORKER_LOG_PORT", 8793),
    "airflow_trigger_logs": ("MOPFLOW_AIRFLOW_TRIGGER_LOG_PORT", 8794),
}
# Other knobs of the stack, documented in docs/operations/local-stack.md.
STACK_ENV: dict[str, tuple[str, str]] = {
    "free_ports": (
        "MOPFLOW_STACK_FREE_PORTS",
        "1 = pick free ports instead of the defaults (tests, shared hosts)",
    ),
    "pool_slots": ("MOPFLOW_TRAINING_POOL_SLOTS", "slots of the Airflow pool mopflow_training (default 1)"),
    "timeout_s": (
        "MOPFLOW_STACK_TIMEOUT_S",
        "seconds `mopflow up` waits for every health check (default 300)",
    ),
    "grace_s": (
        "MOPFLOW_STACK_GRACE_S",
        "seconds `mopflow down` waits after SIGTERM before SIGKILL (default 20)",
    ),
    "serve_model": (
        "MOPFLOW_SERVE_MODEL",
        "registered model whose champion `mopflow up` serves (default mopflow-student)",
    ),
    "mlflow_auth": (
        "MOPFLOW_STACK_AUTH",
        "1 = MLflow's basic-auth app (admin password generated under <home>/stack)",
    ),
}
SERVICE_ORDER = ("mlflow", "dask-scheduler", "dask-workers", "optuna-dashboard", "serve", "airflow")
# With the CeleryExecutor the Airflow components run as services of their own ("airflow" is then
# the api-server); they start after it and stop before it.
CELERY_SERVICES = ("airflow-scheduler", "airflow-dag-processor", "airflow-triggerer", "airflow-celery-worker")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class StackError(RuntimeError):
    """The stack cannot be started, stopped or inspected as asked; the message says why."""


class StackPorts(BaseModel):
    """The TCP ports of the stack (distinct, unprivileged)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    airflow: int = Field(ge=1024, le=65535)
    mlflow: int = Field(ge=1024, le=65535)
    optuna: int = Field(ge=1024, le=65535)
    serve: int = Field(5001, ge=1024, le=65535)
    dask_scheduler: int = Field(ge=1024, le=65535)
    dask_dashboard: int = Field(ge=1024, le=65535)
    airflow_worker_logs: int = Field(ge=1024, le=65535)
    airflow_trigger_logs: int = Field(ge=1024, le=65535)

    @model_validator(mode="after")
    def _distinct(self) -> StackPorts:
        seen: dict[int, str] = {}
        for name, port in self.model_dump().items():
            if port in seen:
                raise ValueError(
                    f"ports: {name}={port} is also the port of {seen[port]}; every service needs its own"
                )
            seen[port] = name
        return self


class StackConfig(BaseModel):
    """How the stack is started: ports, Dask workers, the training pool, timeouts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ports: StackPorts
    dask_workers: int = Field(ge=1, le=256)  # MOPFLOW_DASK_WORKERS, or `mopflow up --dask-workers`
    pool_slots: int = Field(1, ge=1, le=1024)
    timeout_s: float = Field(300.0, gt=0, le=3600)
    grace_s: float = Field(20.0, ge=0, le=600)
    mlflow_auth: bool = False
    serve_model: str = Field("mopflow-student", min_length=1, max_length=256, pattern=r"^[\w.-]+$")


class MlflowAuth(BaseModel):
    """MLflow's basic-auth app: its config file and the admin's credentials (the password is kept in
    a 0600 file under the stack folder and handed to the tasks and workers as MLflow's client variables)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config_file: str
    password_file: str
    username: str = "admin"
    password: SecretStr
    secret_key: SecretStr  # the server's Flask key for CSRF tokens


class HealthCheck(BaseModel):
    """One probe: an HTTP GET answering 200 (``http``), a TCP connect (``tcp``), Airflow's
    health JSON with a healthy metadata DB and scheduler (``airflow``), a Dask scheduler
    with at least ``min_workers`` workers (``dask_workers``), or ``mopflow serve``'s health JSON
    (``serve``: up, with or without a champion yet; the detail says which version it serves)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["http", "tcp", "airflow", "dask_workers", "serve"]
    url: str
    min_workers: int = 0


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


class StackState(BaseModel):
    """The state file: what ``up`` started, read by ``status`` and ``down``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = STATE_VERSION
    home: str
    started_at: str
    ports: StackPorts
    services: tuple[ServiceRecord, ...] = ()
    airflow_password_file: str = ""
    logs: str = ""
    dask_dashboard: str = ""
    mlflow_password_file: str = ""  # set when MLflow's basic-auth app is on


# ---------------------------------------------------------------------------- pure parts


def stack_dir(home: str | Path) -> Path:
    """Folder of the stack's state file and logs under MOPFLOW_HOME."""
    return Path(home) / "stack"


def state_path(home: str | Path) -> Path:
    """Where the state file lives."""
    return stack_dir(home) / "state.json"


def _env_number(environ: Mapping[str, str], var: str, cast: Callable[[str], float], default: float) -> float:
    raw = environ.get(var, "")
    if not raw.strip():
        return default
    try:
        return cast(raw)
    except ValueError as exc:
        raise StackError(f"{var}={raw!r} is not a number") from exc


def choose_ports(
    requested: Mapping[str, int | None],
    environ: Mapping[str, str],
    free: bool,
    pick_free: Callable[[], int],
) -> StackPorts:
    """Ports by precedence: explicit flag, then environment variable, then a free port (``free``) or the default.

    ``pick_free`` is injected (tests pass a counter); picked ports are distinct.
    """
    chosen: dict[str, int] = {}
    for name, (var, default) in PORT_ENV.items():
        value = requested.get(name)
        if value is None and environ.get(var, "").strip():
            raw = environ[var]
            try:
                value = int(raw)
            except ValueError as exc:
                raise StackError(f"{var}={raw!r} is not a port number") from exc
        if value is None and free:
            value = pick_free()
            tries = 0
            while value in chosen.values():
                tries += 1
                if tries > 100:
                    raise StackError("could not pick distinct free ports")
                value = pick_free()
        chosen[name] = default if value is None else value
    try:
        return StackPorts(**chosen)
    except ValidationError as exc:
        raise StackError(_validation_message(exc)) from exc


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}={err.get('input')!r}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


def config_from_env(
    environ: Mapping[str, str],
    requested_ports: Mapping[str, int | None],
    free_ports: bool | None,
    dask_workers: int,
    pick_free: Callable[[], int],
    mlflow_auth: bool | None = None,
) -> StackConfig:
    """The stack config from flags (ports, ``--free-ports``, ``--auth``) and the ``MOPFLOW_*`` environment."""
    auth = mlflow_auth if mlflow_auth is not None else environ.get("MOPFLOW_STACK_AUTH", "") in {"1", "true"}
    free = (
        free_ports if free_ports is not None else environ.get("MOPFLOW_STACK_FREE_PORTS", "") in {"1", "true"}
    )
    ports = choose_ports(requested_ports, environ, free, pick_free)
    try:
        return StackConfig(
            ports=ports,
            dask_workers=dask_workers,
            pool_slots=int(_env_number(environ, "MOPFLOW_TRAINING_POOL_SLOTS", int, 1)),
            timeout_s=_env_number(environ, "MOPFLOW_STACK_TIMEOUT_S", float, 300.0),
            grace_s=_env_number(environ, "MOPFLOW_STACK_GRACE_S", float, 20.0),
            mlflow_auth=auth,
            serve_model=environ.get("MOPFLOW_SERVE_MODEL", "").strip() or "mopflow-student",
        )
    except ValidationError as exc:
        raise StackError(_validation_message(exc)) from exc


# MLflow client variables that say where runs go (``set_tracking_uri`` exports some of them): a stale
# one would send a server's or a task's writes elsewhere. Others (``MLFLOW_S3_ENDPOINT_URL``) are kept.
_MLFLOW_WHERE = ("MLFLOW_TRACKING_", "MLFLOW_REGISTRY_", "MLFLOW_EXPERIMENT_", "MLFLOW_RUN_")


def base_env(environ: Mapping[str, str], bin_dir: str) -> dict[str, str]:
    """The inherited environment minus MLflow's "where do runs go" variables (see ``_MLFLOW_WHERE``),
    with the venv's ``bin`` first on PATH (airflow standalone starts its parts as a bare ``airflow``)."""
    env = {k: v for k, v in environ.items() if not k.startswith(_MLFLOW_WHERE)}
    path = env.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        env["PATH"] = bin_dir + (os.pathsep + path if path else "")
    return env


def mopflow_env(settings: Settings, ports: StackPorts) -> dict[str, str]:
    """The ``MOPFLOW_*`` settings every task and worker sees: the same home, data, artifacts and
    study storage as the CLI, with tracking and compute pointed at the stack's servers."""
    return {
        "MOPFLOW_HOME": settings.home,
        "MOPFLOW_DATA_ROOT": settings.data_root,
        "MOPFLOW_ARTIFACT_ROOT": settings.artifact_root,
        "MOPFLOW_MLFLOW_ARTIFACTS": settings.mlflow_artifact_location,
        "MOPFLOW_EXPERIMENT": settings.experiment_name,
        "MOPFLOW_OPTUNA_STORAGE": settings.optuna_storage,
        "MOPFLOW_STORAGE_OPTIONS": json.dumps(dict(settings.storage_options)),
        "MOPFLOW_AIRFLOW_HOME": settings.airflow_home,
        "MOPFLOW_TRACKING_URI": f"http://{HOST}:{ports.mlflow}",
        "MOPFLOW_DASK_ADDRESS": f"tcp://{HOST}:{ports.dask_scheduler}",
        "MOPFLOW_DASK_WORKERS": str(settings.dask_workers),
    }


def is_loopback(url: str) -> bool:
    """Whether a URL (``http://...``, ``tcp://...``) names a host on this machine's loopback."""
    from urllib.parse import urlsplit

    return (urlsplit(url).hostname or "") in LOOPBACK


def airflow_executor(environ: Mapping[str, str]) -> str:
    """The default executor's class name (the first of ``AIRFLOW__CORE__EXECUTOR``; default
    LocalExecutor); only the LocalExecutor and the CeleryExecutor are run by the stack."""
    raw = environ.get("AIRFLOW__CORE__EXECUTOR", "").strip()
    first = raw.split(",")[0].strip()
    name = first.rpartition(":")[2].rpartition(".")[2] or "LocalExecutor"
    if name not in ("LocalExecutor", "CeleryExecutor"):
        raise StackError(
            f"AIRFLOW__CORE__EXECUTOR={raw!r}: `mopflow up` runs the LocalExecutor or the CeleryExecutor"
        )
    if name == "CeleryExecutor":
        conn = environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
        if not conn or conn.startswith("sqlite"):
            raise StackError(
                "the CeleryExecutor needs Airflow's metadata on a database server, e.g. "
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=postgresql+psycopg2://postgres@127.0.0.1:5432/mopflow_airflow "
                f"(got {conn or 'the SQLite default'!r})"
            )
        if not environ.get("AIRFLOW__CELERY__BROKER_URL", "").strip():
            raise StackError(
                "the CeleryExecutor needs a broker: set AIRFLOW__CELERY__BROKER_URL "
                "(e.g. redis://127.0.0.1:6379/0; the scale-out profile does)"
            )
    return name


def mlflow_server_stores(settings: Settings, environ: Mapping[str, str]) -> tuple[str, str]:
    """The stack's MLflow server: (backend store URI, artifacts destination).

    The backend store is ``MOPFLOW_MLFLOW_BACKEND_STORE``, else the tracking URI when it is a
    database. A tracking URI that is a server (``http://...``, as in the scale-out profile) is
    accepted when it is on 127.0.0.1 and a backend store is given: the stack serves it."""
    store = environ.get("MOPFLOW_MLFLOW_BACKEND_STORE", "").strip()
    uri = settings.tracking_uri
    if uri.startswith(("http://", "https://")):
        if not store:
            raise StackError(
                f"MOPFLOW_TRACKING_URI={uri!r} already points at a tracking server; `mopflow up` starts "
                "its own: give it a database in MOPFLOW_MLFLOW_BACKEND_STORE (as the scale-out profile does) "
                "or set MOPFLOW_TRACKING_URI to a database URI (e.g. sqlite:///...)"
            )
        if not is_loopback(uri):
            raise StackError(
                f"MOPFLOW_TRACKING_URI={uri!r} points at a tracking server on another host; `mopflow up` "
                "serves MLflow on 127.0.0.1: unset it or point it at 127.0.0.1"
            )
    backend = store or uri
    if backend.startswith(("http://", "https://")):
        raise StackError(f"MOPFLOW_MLFLOW_BACKEND_STORE={backend!r} must be a database URI, not a server")
    destination = (
        environ.get("MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION", "").strip()
        or settings.mlflow_artifact_location
        or str(Path(settings.home) / "mlflow" / "artifacts")
    )
    return backend, destination


def airflow_password_file(airflow_home: str, environ: Mapping[str, str]) -> str:
    """Where the simple auth manager keeps the generated admin password (as Airflow computes it:
    ``[core] simple_auth_manager_passwords_file``, else ``AIRFLOW_HOME/simple_auth_manager_passwords.json.generated``)."""
    configured = environ.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", "")
    return configured or os.path.join(airflow_home, "simple_auth_manager_passwords.json.generated")


def airflow_env(
    settings: Settings, ports: StackPorts, repo: Path, environ: Mapping[str, str]
) -> dict[str, str]:
    """Airflow's settings for the stack: SQLite under MOPFLOW_HOME, this repo's dags/ and plugins/,
    the api-server (and the Execution API the tasks call) on the stack's port."""
    api = f"http://{HOST}:{ports.airflow}"
    env = {
        **embedded_airflow_env(settings.airflow_home, environ, repo),
        "AIRFLOW__API__HOST": HOST,
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


def build_specs(
    settings: Settings,
    config: StackConfig,
    bin_dir: str,
    environ: Mapping[str, str],
    repo: Path = REPO,
    auth: MlflowAuth | None = None,
) -> list[ServiceSpec]:
    """The services' command lines, environments and health checks (nothing is started).

    With ``auth`` the MLflow server runs its basic-auth app and every client (tasks, workers, the
    Airflow plugin) gets the admin's credentials through ``MLFLOW_TRACKING_USERNAME/PASSWORD``."""
    if config.mlflow_auth and auth is None:
        raise StackError("the stack config asks for MLflow auth but no credentials were prepared")
    backend_store, artifacts_destination = mlflow_server_stores(settings, environ)
    if settings.dask_address and not is_loopback(settings.dask_address):
        raise StackError(
            f"MOPFLOW_DASK_ADDRESS={settings.dask_address!r} points at an existing Dask scheduler; "
            "`mopflow up` starts its own on 127.0.0.1: unset it or point it at 127.0.0.1"
        )
    executor = airflow_executor(environ)
    p = config.ports
    # Where the Airflow "Sweeps" page (plugins/sweeps_page.py) links to; a user's value (a proxy) wins.
    ui_urls = {
        "MOPFLOW_MLFLOW_UI_URL": f"http://{HOST}:{p.mlflow}",
        "MOPFLOW_OPTUNA_DASHBOARD_URL": f"http://{HOST}:{p.optuna}",
    }
    common = {
        **base_env(environ, bin_dir),
        **mopflow_env(settings, p),
        **{k: v for k, v in ui_urls.items() if not environ.get(k)},
    }
    mlflow_app: tuple[str, ...] = ()
    mlflow_server_env: dict[str, str] = {}
    if auth is not None:
        common["MLFLOW_TRACKING_USERNAME"] = auth.username
        common["MLFLOW_TRACKING_PASSWORD"] = auth.password.get_secret_value()
        mlflow_app = ("--app-name", "basic-auth")
        mlflow_server_env["MLFLOW_AUTH_CONFIG_PATH"] = auth.config_file
        mlflow_server_env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = auth.secret_key.get_secret_value()
    home = Path(settings.home)
    exe = lambda name: str(Path(bin_dir) / name)  # noqa: E731 - the venv's console scripts
    mlflow_url = f"http://{HOST}:{p.mlflow}"
    dask_http = f"http://{HOST}:{p.dask_dashboard}"
    optuna_target = settings.optuna_storage
    optuna_args: tuple[str, ...] = (optuna_target,)
    if storage_kind(optuna_target) == "journal":
        # The journal file may not exist yet: name the storage class so the dashboard creates it.
        optuna_args = (journal_path(optuna_target), "--storage-class", "JournalFileStorage")
    return [
        ServiceSpec(
            name="mlflow",
            argv=(
                exe("mlflow"),
                "server",
                "--backend-store-uri",
                backend_store,
                "--artifacts-destination",
                artifacts_destination,
                "--serve-artifacts",
                "--host",
                HOST,
                "--port",
                str(p.mlflow),
                "--workers",
                "1",
                *mlflow_app,
            ),
            # The server's job runner (GenAI scorers) starts seven huey processes (~1.4 GB): off by default.
            env={
                **common,
                **mlflow_server_env,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": environ.get(
                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"
                ),
            },
            url=mlflow_url,
            checks=(HealthCheck(kind="http", url=f"{mlflow_url}/health"),),
            ports=(p.mlflow,),
        ),
        ServiceSpec(
            name="dask-scheduler",
            argv=(
                exe("dask"),
                "scheduler",
                "--host",
                HOST,
                "--port",
                str(p.dask_scheduler),
                "--dashboard-address",
                f"{HOST}:{p.dask_dashboard}",
            ),
            env=common,
            url=f"tcp://{HOST}:{p.dask_scheduler}",
            checks=(
                HealthCheck(kind="tcp", url=f"tcp://{HOST}:{p.dask_scheduler}"),
                HealthCheck(kind="http", url=f"{dask_http}/health"),
            ),
            ports=(p.dask_scheduler, p.dask_dashboard),
        ),
        ServiceSpec(
            name="dask-workers",
            argv=(
                exe("dask"),
                "worker",
                f"tcp://{HOST}:{p.dask_scheduler}",
                "--nworkers",
                str(config.dask_workers),
                "--nthreads",
                "1",
                "--host",
                HOST,
                "--no-dashboard",
                "--local-directory",
                str(stack_dir(home) / "dask-worker-space"),
            ),
            env=common,
            url=f"{dask_http}/json/counts.json",
            checks=(
                HealthCheck(
                    kind="dask_workers", url=f"{dask_http}/json/counts.json", min_workers=config.dask_workers
                ),
            ),
        ),
        ServiceSpec(
            name="optuna-dashboard",
            argv=(exe("optuna-dashboard"), *optuna_args, "--host", HOST, "--port", str(p.optuna)),
            env=common,
            url=f"http://{HOST}:{p.optuna}",
            checks=(HealthCheck(kind="http", url=f"http://{HOST}:{p.optuna}/"),),
            ports=(p.optuna,),
        ),
        ServiceSpec(
            name="serve",
            # Starts before any model exists: it answers /health at once and /ping (200) once the
            # champion alias points at a version, which it then follows.
            argv=(
                exe("mopflow"),
                "serve",
                "--model",
                config.serve_model,
                "--host",
                HOST,
                "--port",
                str(p.serve),
                "--wait",
            ),
            env=common,
            url=f"http://{HOST}:{p.serve}",
            checks=(HealthCheck(kind="serve", url=f"http://{HOST}:{p.serve}/health"),),
            ports=(p.serve,),
        ),
        *airflow_specs(executor, {**common, **airflow_env(settings, p, repo, environ)}, p, bin_dir),
    ]


def airflow_specs(executor: str, env: dict[str, str], p: StackPorts, bin_dir: str) -> list[ServiceSpec]:
    """Airflow: ``airflow standalone`` for the LocalExecutor; for the CeleryExecutor (which
    standalone replaces by the LocalExecutor) the api-server as ``airflow`` and each other
    component, the Celery worker included, as a service of its own."""
    airflow = str(Path(bin_dir) / "airflow")
    url = f"http://{HOST}:{p.airflow}"
    health = HealthCheck(kind="airflow", url=f"{url}/api/v2/monitor/health")  # metadata DB + scheduler
    if executor != "CeleryExecutor":
        return [
            ServiceSpec(
                name="airflow",
                argv=(airflow, "standalone"),
                env=env,
                url=url,
                checks=(health,),
                ports=(p.airflow, p.airflow_worker_logs, p.airflow_trigger_logs),
            )
        ]
    worker_logs = f"tcp://{HOST}:{p.airflow_worker_logs}"
    trigger_logs = f"tcp://{HOST}:{p.airflow_trigger_logs}"
    return [
        ServiceSpec(
            name="airflow",
            argv=(airflow, "api-server"),
            env=env,
            url=url,
            checks=(health,),
            ports=(p.airflow,),
        ),
        ServiceSpec(name="airflow-scheduler", argv=(airflow, "scheduler"), env=env, url=url, checks=()),
        ServiceSpec(
            name="airflow-dag-processor", argv=(airflow, "dag-processor"), env=env, url=url, checks=()
        ),
        ServiceSpec(
            name="airflow-triggerer",
            argv=(airflow, "triggerer"),
            env=env,
            url=trigger_logs,
            checks=(HealthCheck(kind="tcp", url=trigger_logs),),  # its log server is up
            ports=(p.airflow_trigger_logs,),
        ),
        ServiceSpec(
            name="airflow-celery-worker",
            # A node name of this stack's own: two stacks on one broker and host never clash.
            argv=(airflow, "celery", "worker", "--celery-hostname", f"mopflow-{p.airflow}@%h"),
            env=env,
            url=env.get("AIRFLOW__CELERY__BROKER_URL", ""),
            checks=(HealthCheck(kind="tcp", url=worker_logs),),  # its log server is up
            ports=(p.airflow_worker_logs,),
        ),
    ]


def create_optuna_tables(url: str) -> None:
    """Create (or upgrade) Optuna's tables in an RDB storage, as any Optuna client would."""
    from optuna.storages import RDBStorage

    from infra.optuna_storage import redact_url

    try:
        RDBStorage(url).engine.dispose()
    except Exception as exc:
        raise StackError(
            f"MOPFLOW_OPTUNA_STORAGE={redact_url(url)!r}: cannot open or create Optuna's tables: {exc}"
        ) from exc


def migrate_airflow_db(env: Mapping[str, str], bin_dir: str) -> None:
    """Create or upgrade Airflow's metadata tables (standalone does it itself; separate components don't)."""
    try:
        airflow_home.migrate_airflow_db(env, bin_dir, inherit=False)
    except airflow_home.AirflowSetupError as exc:
        raise StackError(str(exc)) from exc


def dask_dashboard_url(port: int, has_bokeh: bool) -> str:
    """The Dask page to open: the Bokeh dashboard, or, without bokeh (it is optional), the scheduler's
    plain HTML pages on workers and tasks."""
    base = f"http://{HOST}:{port}"
    if has_bokeh:
        return f"{base}/status"
    return f"{base}/info/main/workers.html (install bokeh>=3.1 for the graphical dashboard at /status)"


def format_up_summary(state: StackState) -> str:
    """What ``mopflow up`` prints once everything answers: URLs, the admin password's file, logs."""
    urls = {s.name: s.url for s in state.services}
    p = state.ports
    lines = [
        "",
        "mopflow stack is up (127.0.0.1 only)",
        "====================================",
        f"Airflow UI / REST API : {urls.get('airflow', '')}   (user admin)",
        f"  admin password in   : {state.airflow_password_file}",
        f"  REST token          : POST {urls.get('airflow', '')}/auth/token "
        '{"username": "admin", "password": "<from the file>"} -> access_token (Bearer)',
        f"MLflow UI / tracking  : {urls.get('mlflow', '')}",
        *(
            [f"  MLflow login        : user admin, password in {state.mlflow_password_file} (basic auth)"]
            if state.mlflow_password_file
            else []
        ),
        f"Optuna dashboard      : {urls.get('optuna-dashboard', '')}",
        f"champion server       : {urls.get('serve', '')}/invocations   (MLflow scoring protocol)",
        f"Dask scheduler        : tcp://{HOST}:{p.dask_scheduler}   dashboard {state.dask_dashboard}",
        f"logs                  : {state.logs}",
        "stop with             : mopflow down    (status: mopflow status)",
    ]
    return "\n".join(lines)


def format_status(state: StackState, health: Mapping[str, tuple[bool, bool, str]]) -> str:
    """The table ``mopflow status`` prints; ``health`` maps a service to (running, healthy, detail)."""
    lines = [f"mopflow stack of {state.home} (started {state.started_at})"]
    lines.append(f"{'service':18} {'pid':>8}  {'state':9} url")
    for rec in state.services:
        running, healthy, detail = health.get(rec.name, (False, False, "unknown"))
        word = "healthy" if healthy else ("unhealthy" if running else "stopped")
        extra = f"  ({detail})" if detail else ""
        lines.append(f"{rec.name:18} {rec.pid:>8}  {word:9} {rec.url}{extra}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- state file


def write_state(path: Path, state: StackState) -> None:
    """Write the state file atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    os.replace(tmp, path)


def read_state(path: Path) -> StackState | None:
    """The recorded stack, or None when there is no state file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return StackState.model_validate_json(text)
    except ValidationError as exc:
        raise StackError(
            f"state file {path} is not a mopflow stack state ({_validation_message(exc)}); "
            "stop what runs by hand and remove it"
        ) from exc


@contextlib.contextmanager
def stack_lock(home: str | Path) -> Iterator[None]:
    """One ``up``/``down`` at a time per MOPFLOW_HOME."""
    folder = stack_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise StackError(
                f"another `mopflow up/down` is running on {home} (lock {folder / 'lock'})"
            ) from exc
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- edges: ports, probes


def _private_file(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def owner_only(path: Path) -> None:
    """Make a secret file readable by its owner only (Airflow writes its password file 0644)."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, 0o600)


def prepare_mlflow_auth(home: str | Path) -> MlflowAuth:
    """The basic-auth app's config and admin password under ``<home>/stack`` (0600 files). The password
    is generated once and reused: MLflow only sets it when it creates the admin in an empty user store."""
    import secrets

    folder = stack_dir(home)

    def secret(name: str) -> str:
        file = folder / name
        if file.exists():
            return file.read_text().strip()
        value = secrets.token_urlsafe(24)
        _private_file(file, value + "\n")
        return value

    password_file = folder / "mlflow_admin_password"
    password = secret(password_file.name)
    secret_key = secret("mlflow_flask_secret_key")
    config_file = folder / "mlflow_basic_auth.ini"
    database = Path(home) / "mlflow" / "basic_auth.db"
    database.parent.mkdir(parents=True, exist_ok=True)
    _private_file(
        config_file,
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{database}\n"
        "admin_username = admin\n"
        f"admin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
    )
    return MlflowAuth(
        config_file=str(config_file),
        password_file=str(password_file),
        password=SecretStr(password),
        secret_key=SecretStr(secret_key),
    )


def _has_module(name: str, bin_dir: str) -> bool:
    """Whether the services' Python (the venv of ``bin_dir``) can import ``name``."""
    python = Path(bin_dir) / "python"
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def port_answers(port: int, host: str = HOST, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_bindable(port: int, host: str = HOST) -> bool:
    """Whether this process could listen on host:port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _http_get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - our own loopback URLs
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def probe(check: HealthCheck, timeout: float = 3.0) -> tuple[bool, str]:
    """Run one health check: (healthy, what was seen)."""
    try:
        if check.kind == "tcp":
            host, _, port = check.url.removeprefix("tcp://").rpartition(":")
            ok = port_answers(int(port), host, timeout)
            return ok, "" if ok else f"nothing listens on {check.url}"
        status, body = _http_get(check.url, timeout)
        if status != 200:
            return False, f"{check.url} answered HTTP {status}"
        if check.kind == "airflow":
            info = json.loads(body)
            parts = {k: (info.get(k) or {}).get("status") for k in ("metadatabase", "scheduler")}
            bad = {k: v for k, v in parts.items() if v != "healthy"}
            return not bad, ", ".join(f"{k} {v}" for k, v in bad.items())
        if check.kind == "dask_workers":
            workers = int(json.loads(body).get("workers", 0))
            ok = workers >= check.min_workers
            return ok, "" if ok else f"{workers}/{check.min_workers} workers connected"
        if check.kind == "serve":
            info = json.loads(body)
            version = info.get("version")
            return (
                True,
                f"{info.get('model')} v{version}" if version else f"no {info.get('model')}@champion yet",
            )
        return True, ""
    except (OSError, ValueError) as exc:
        return False, f"{check.url}: {type(exc).__name__}: {exc}"


def probe_all(checks: Sequence[HealthCheck], timeout: float = 3.0) -> tuple[bool, str]:
    """All checks of one service: healthy when every one is; the first failure's detail, else
    what the healthy checks said (``mopflow serve``'s version)."""
    said = []
    for check in checks:
        ok, detail = probe(check, timeout)
        if not ok:
            return False, detail
        said.append(detail)
    return True, "; ".join(d for d in said if d)


# ---------------------------------------------------------------------------- edges: processes


def _process(rec: ServiceRecord) -> object | None:
    """The live psutil process of a record, or None (gone, or the pid now belongs to another process)."""
    import psutil

    try:
        proc = psutil.Process(rec.pid)
        if abs(proc.create_time() - rec.create_time) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def is_running(rec: ServiceRecord) -> bool:
    """Whether the recorded process still runs (same pid and start time)."""
    return _process(rec) is not None


def spawn(spec: ServiceSpec, log_dir: Path, cwd: Path = REPO) -> ServiceRecord:
    """Start one service in its own session (process group), output appended to its log file."""
    import psutil

    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"{spec.name}.log"
    with open(log_file, "ab") as log:
        log.write(f"\n=== mopflow up {datetime.now(UTC).isoformat()}: {' '.join(spec.argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(spec.argv),
            env=spec.env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: `down` signals the whole group
        )
    return ServiceRecord(
        name=spec.name,
        pid=proc.pid,
        create_time=psutil.Process(proc.pid).create_time(),
        argv=spec.argv,
        log=str(log_file),
        url=spec.url,
        checks=spec.checks,
        ports=spec.ports,
    )


def stop_services(
    records: Sequence[ServiceRecord], grace_s: float, say: Callable[[str], None] = lambda _: None
) -> list[str]:
    """SIGTERM every recorded process group and each process's descendants, wait up to ``grace_s``,
    then SIGKILL what is left. Returns the names of the services that were running."""
    import psutil

    victims: list[tuple[str, psutil.Process]] = []
    running: list[ServiceRecord] = []
    for rec in records:
        root = _process(rec)
        if root is None:  # gone, or its pid now belongs to someone else: never signal it
            continue
        assert isinstance(root, psutil.Process)
        running.append(rec)
        # Collect descendants first: once the parent dies they are re-parented and hard to find.
        with contextlib.suppress(psutil.Error):
            victims.extend((rec.name, child) for child in root.children(recursive=True))
        victims.append((rec.name, root))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGTERM)  # pgid == pid: spawned with start_new_session
    for _, proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs([proc for _, proc in victims], timeout=grace_s)
    if alive:
        late = sorted({f"{name} (pid {proc.pid})" for name, proc in victims if proc in alive})
        say(f"still running {grace_s:.0f} s after SIGTERM, sent SIGKILL: {', '.join(late)}")
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for rec in running:  # whatever joined a group during the shutdown
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=10)
    return [rec.name for rec in running]


def _log_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chars))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def wait_healthy(
    records: Sequence[ServiceRecord],
    timeout_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll every service's checks until all pass; fail early, with its log tail, if one dies."""
    pending = {rec.name: rec for rec in records}
    deadline = clock() + timeout_s
    last: dict[str, str] = {}
    while pending:
        for name, rec in list(pending.items()):
            if not is_running(rec):
                raise StackError(
                    f"{name} exited during start-up; last lines of {rec.log}:\n{_log_tail(rec.log)}"
                )
            ok, detail = probe_all(rec.checks)
            if ok:
                say(f"  {name:17} healthy   {rec.url}")
                del pending[name]
            else:
                last[name] = detail
        if not pending:
            return
        if clock() > deadline:
            waiting = "; ".join(f"{n}: {last.get(n, '?')}" for n in pending)
            raise StackError(
                f"not healthy after {timeout_s:.0f} s: {waiting} (logs in {Path(records[0].log).parent})"
            )
        sleep(1.0)


def set_training_pool(env: Mapping[str, str], bin_dir: str, slots: int) -> None:
    """Create or resize the Airflow pool that caps concurrent training tasks (idempotent)."""
    cmd = [
        str(Path(bin_dir) / "airflow"),
        "pools",
        "set",
        TRAINING_POOL,
        str(slots),
        "mopflow training tasks",
    ]
    proc = subprocess.run(cmd, env=dict(env), cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise StackError(f"`{' '.join(cmd[1:])}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


# ---------------------------------------------------------------------------- commands


def running_services(state: StackState) -> tuple[list[ServiceRecord], list[ServiceRecord]]:
    """The state's services split into (running, gone)."""
    running = [r for r in state.services if is_running(r)]
    gone = [r for r in state.services if r not in running]
    return running, gone


def up(
    settings: Settings,
    config: StackConfig,
    environ: Mapping[str, str],
    say: Callable[[str], None] = print,
    bin_dir: str | None = None,
    has_module: Callable[[str, str], bool] | None = None,
) -> StackState:
    """Start the stack, wait until every service answers its health check, create the training
    pool, and return the recorded state. A stack already running is reported, not duplicated."""
    bin_dir = bin_dir or str(Path(sys.executable).parent)
    has_module = has_module or _has_module
    home = Path(settings.home)
    path = state_path(home)
    with stack_lock(home):
        existing = read_state(path)
        if existing is not None:
            running, gone = running_services(existing)
            if running and not gone:
                say(f"the stack already runs (state {path}); nothing started:")
                say(format_status(existing, {r.name: (True, *probe_all(r.checks)) for r in running}))
                return existing
            if running:
                raise StackError(
                    f"the stack is partly running ({', '.join(r.name for r in running)} up; "
                    f"{', '.join(r.name for r in gone)} gone): run `mopflow down` first"
                )
            path.unlink()  # a stale state file: nothing of it runs any more
        if config.mlflow_auth and not has_module("flask_wtf", bin_dir):
            raise StackError(
                "--auth runs MLflow's basic-auth app, which needs the mlflow[auth] extra (Flask-WTF): "
                f"install it into the environment of {bin_dir} (pip install 'mlflow[auth]')"
            )
        auth = prepare_mlflow_auth(home) if config.mlflow_auth else None
        specs = build_specs(settings, config, bin_dir, environ, auth=auth)
        taken = [
            f"{spec.name} port {port}"
            for spec in specs
            for port in spec.ports
            if port_answers(port) or not port_bindable(port)
        ]
        if taken:
            raise StackError(
                f"port(s) already in use: {', '.join(taken)}; choose others with --*-port / "
                f"MOPFLOW_*_PORT or pass --free-ports"
            )
        for folder in (settings.airflow_home, mlflow_server_stores(settings, environ)[1]):
            if "://" not in folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        if storage_kind(settings.optuna_storage) == "journal":
            Path(journal_path(settings.optuna_storage)).parent.mkdir(parents=True, exist_ok=True)
        else:  # optuna-dashboard opens an RDB without creating its tables
            create_optuna_tables(settings.optuna_storage)
        log_dir = stack_dir(home) / "logs"
        airflow_spec = next(s for s in specs if s.name == "airflow")
        state = StackState(
            home=str(home),
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
            ports=config.ports,
            airflow_password_file=airflow_password_file(settings.airflow_home, airflow_spec.env),
            dask_dashboard=dask_dashboard_url(config.ports.dask_dashboard, has_module("bokeh", bin_dir)),
            mlflow_password_file=auth.password_file if auth else "",
            logs=str(log_dir),
        )
        records: list[ServiceRecord] = []
        try:
            if len([s for s in specs if s.name.startswith("airflow")]) > 1:  # components, not standalone
                say("  migrating Airflow's metadata database (airflow db migrate)...")
                migrate_airflow_db(airflow_spec.env, bin_dir)
            for spec in specs:
                records.append(spawn(spec, log_dir))
                say(f"  {spec.name:17} started   pid {records[-1].pid}, log {records[-1].log}")
                # Recorded at once: a `down` from another shell can stop a half-started stack.
                state = state.model_copy(update={"services": tuple(records)})
                write_state(path, state)
            say(f"waiting for the health checks (up to {config.timeout_s:.0f} s)...")
            wait_healthy(records, config.timeout_s, say)
            owner_only(Path(state.airflow_password_file))
            set_training_pool(airflow_spec.env, bin_dir, config.pool_slots)
            say(f"  airflow pool {TRAINING_POOL!r} set to {config.pool_slots} slot(s)")
        except BaseException:
            say("start-up failed: stopping what was started")
            stop_services(records, config.grace_s, say)
            path.unlink(missing_ok=True)
            raise
        say(format_up_summary(state))
        return state


def down(home: str | Path, grace_s: float, say: Callable[[str], None] = print) -> list[str]:
    """Stop every recorded service (SIGTERM, then SIGKILL after ``grace_s``) and remove the state file."""
    path = state_path(home)
    with stack_lock(home):
        state = read_state(path)
        if state is None:
            say(f"no mopflow stack recorded in {path}: nothing to stop")
            return []
        known = (*SERVICE_ORDER, *CELERY_SERVICES)
        order = sorted(state.services, key=lambda r: -known.index(r.name) if r.name in known else 0)
        stopped = stop_services(order, grace_s, say)
        busy = [f"{r.name}:{p}" for r in state.services for p in r.ports if port_answers(p)]
        path.unlink(missing_ok=True)
        say(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        if busy:
            say(f"warning: port(s) still answer after stopping: {', '.join(busy)}")
        return stopped


def status(home: str | Path, say: Callable[[str], None] = print) -> bool:
    """Print what runs and whether it answers; True when every recorded service is healthy."""
    path = state_path(home)
    state = read_state(path)
    if state is None:
        say(f"no mopflow stack recorded in {path} (start it with `mopflow up`)")
        return False
    health: dict[str, tuple[bool, bool, str]] = {}
    for rec in state.services:
        running = is_running(rec)
        ok, detail = probe_all(rec.checks) if running else (False, "process gone")
        health[rec.name] = (running, ok, detail)
    say(format_status(state, health))
    say(f"airflow admin password in {state.airflow_password_file}; logs in {state.logs}")
    return all(ok for _, ok, _ in health.values()) and bool(health)
