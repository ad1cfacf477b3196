"""What an Airflow worker on another host needs to join the stack: ``<home>/stack/worker.env``,
written by ``mopflow up`` when the stack is on an address other hosts reach, printed by
``mopflow worker-env``.

A Celery worker host runs ``airflow celery worker`` with these settings: the metadata database and
the broker, the Execution API its tasks call, the secrets every Airflow host shares, and the
``MOPFLOW_*`` settings the tasks use, all as the stack's own Airflow has them (pure but for the
file's edges: :func:`write_worker_env`, :func:`read_worker_env`)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

from mopflow.base.hosts import endpoints, is_host_local, is_loopback
from mopflow.base.settings import RUNTIME_ENV, SETTING_ENV, SettingsError, parse_storage_options
from mopflow.infra.stack.auth import AIRFLOW_SECRETS, private_file
from mopflow.infra.stack.config import StackError
from mopflow.infra.stack.state import stack_dir

WORKER_ENV_NAME = "worker.env"

# Variables a worker takes as the stack has them: these sections whole (how to reach the metadata
# database and the broker, Celery's knobs, and Dask's: the profile's timeouts that let a silent
# host go, which every Dask client and worker must read too) ...
_SECTIONS = (
    "AIRFLOW__DATABASE__",
    "AIRFLOW__CELERY__",
    "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__",
    "DASK_DISTRIBUTED__",
)
# ... and these: the executor, where the tasks reach the Execution API, the port the api-server
# fetches a running task's log from (its own setting, so the worker must serve there), the queue
# the worker listens on, and the DAG files (a worker parses them itself).
_AIRFLOW_VARS = (
    "AIRFLOW__CORE__EXECUTOR",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__API__BASE_URL",
    "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT",
    "AIRFLOW__OPERATORS__DEFAULT_QUEUE",
    "AIRFLOW__CORE__DAGS_FOLDER",
    "AIRFLOW__CORE__LOAD_EXAMPLES",
)
# MLflow client variables the stack's tasks get (its basic-auth credentials, the S3 endpoint).
_MLFLOW_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_S3_ENDPOINT_URL")
# Settings that belong to the host that reads them: each worker host keeps its own.
_HOST_OWN = frozenset({"MOPFLOW_HOME", "MOPFLOW_AIRFLOW_HOME", "MOPFLOW_SHARD_CACHE"})
# Addresses a worker connects to: on the stack host's loopback, a worker would connect to itself.
_SERVER_URLS = (
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__CELERY__BROKER_URL",
    "AIRFLOW__CELERY__RESULT_BACKEND",
    "MOPFLOW_OPTUNA_STORAGE",
    "MLFLOW_S3_ENDPOINT_URL",
)


def _secret_vars() -> list[str]:
    """The shared secrets as the stack may have them: the value, or a command or secrets backend key."""
    return [var + suffix for var in AIRFLOW_SECRETS for suffix in ("", "_CMD", "_SECRET")]


def worker_env(airflow: Mapping[str, str]) -> dict[str, str]:
    """The settings of a Celery worker host, taken from ``airflow``, the environment of the stack's
    Airflow components: the variables above, the shared secrets, and every ``MOPFLOW_*`` setting
    and DAG-level variable but those each host keeps for itself (its home, its shard cache)."""
    mopflow = [var for var, _ in SETTING_ENV.values()] + list(RUNTIME_ENV)
    wanted = [
        *_AIRFLOW_VARS,
        *_secret_vars(),
        *sorted(k for k in airflow if k.startswith(_SECTIONS)),
        *(var for var in mopflow if var not in _HOST_OWN),
        *_MLFLOW_VARS,
    ]
    # Airflow's default executor, said: under it no Celery worker takes tasks.
    env = {"AIRFLOW__CORE__EXECUTOR": airflow.get("AIRFLOW__CORE__EXECUTOR") or "LocalExecutor"}
    env |= {var: airflow[var] for var in dict.fromkeys(wanted) if airflow.get(var, "") != ""}
    return env


def across_hosts_warnings(env: Mapping[str, str]) -> list[str]:
    """What in a worker host's settings cannot work from another host: a server on the stack
    host's loopback, a SQLite database or a data root on its disk."""
    warnings = [
        f"{var}={env[var]!r} is on the stack host's loopback: another host reaches no server there"
        for var in _SERVER_URLS
        if "://" in env.get(var, "") and is_loopback(env[var])
    ]
    warnings += [
        f"{var}={env[var]!r} is a SQLite file on the stack's host: another host cannot share it"
        for var in _SERVER_URLS
        if env.get(var, "").startswith(("sqlite", "db+sqlite"))
    ]
    warnings += [
        f"{var}={env[var]!r} is on the stack's host only; use a shared URL (s3://...)"
        for var in ("MOPFLOW_DATA_ROOT", "MOPFLOW_ARTIFACT_ROOT")
        if env.get(var) and is_host_local(env[var])
    ]
    journal = env.get("MOPFLOW_OPTUNA_STORAGE", "")
    if journal and "://" not in journal:  # a journal file: each host would keep studies of its own
        warnings.append(
            f"MOPFLOW_OPTUNA_STORAGE={journal!r} is a journal file on the stack's host; use a database "
            "server every host reaches"
        )
    try:
        options = parse_storage_options(env.get("MOPFLOW_STORAGE_OPTIONS", ""))
    except SettingsError:  # already refused by the settings; nothing more to say here
        options = {}
    warnings += [
        f"MOPFLOW_STORAGE_OPTIONS has the endpoint {endpoint!r}, on loopback: set the worker host's own"
        for endpoint in endpoints(options)
        if is_loopback(endpoint)
    ]
    return warnings


def format_worker_env(env: Mapping[str, str], warnings: list[str]) -> str:
    """The file's text: a header, the warnings as comments, one ``KEY=VALUE`` line per setting,
    each value quoted for a POSIX shell where it must be (``set -a; . ./worker.env; set +a``)."""
    header = [
        "# Settings of an Airflow worker host of this mopflow stack (written by `mopflow up`).",
        "# On that host, with mopflow and its DAGs installed: set -a; . ./worker.env; set +a",
        "# then: airflow celery worker. Keep it private: it holds the stack's shared secrets.",
        "# AIRFLOW__CORE__DAGS_FOLDER is this host's: where mopflow lives elsewhere, `mopflow dags path` there.",
    ]
    notes = [f"# warning: {w}" for w in warnings]
    lines = [f"{key}={shlex.quote(value)}" for key, value in env.items()]
    return "\n".join([*header, *notes, *lines]) + "\n"


def worker_env_path(home: str | Path) -> Path:
    """Where ``mopflow up`` writes the worker hosts' settings."""
    return stack_dir(home) / WORKER_ENV_NAME


def write_worker_env(home: str | Path, airflow: Mapping[str, str]) -> tuple[Path, list[str]]:
    """Write :func:`worker_env` of ``airflow`` to :func:`worker_env_path` (0600: it holds the
    shared secrets); returns the file and :func:`across_hosts_warnings`."""
    env = worker_env(airflow)
    warnings = across_hosts_warnings(env)
    path = worker_env_path(home)
    private_file(path, format_worker_env(env, warnings))
    return path, warnings


def read_worker_env(home: str | Path) -> tuple[str, dict[str, str]]:
    """The worker hosts' settings ``mopflow up`` wrote: (the file's text, its variables). Raises
    :class:`StackError` when there is none: the stack is on loopback, or was never started."""
    path = worker_env_path(home)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise StackError(
            f"no worker settings in {path}: `mopflow up` writes them when the stack binds an address "
            "other hosts reach (MOPFLOW_STACK_HOST or `mopflow up --host ADDR`)"
        ) from exc
    env = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = shlex.split(line)[0].partition("=")
            env[key] = value
    return text, env
