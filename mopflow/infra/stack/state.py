"""The state file ``<home>/stack/state.json`` (what ``up`` started, read by ``status`` and
``down`` from any shell), the lock that lets one ``up``/``down`` run at a time, and how a
state is printed."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from mopflow.infra.stack.config import (
    DEFAULT_HOST,
    StackError,
    StackPorts,
    host_is_loopback,
    url_host,
    validation_message,
)
from mopflow.infra.stack.services import ServiceRecord

STATE_VERSION = 1


class StackState(BaseModel):
    """The state file: what ``up`` started, read by ``status`` and ``down``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = STATE_VERSION
    home: str
    started_at: str
    ports: StackPorts
    host: str = DEFAULT_HOST  # what every server binds and advertises
    services: tuple[ServiceRecord, ...] = ()
    airflow_password_file: str = ""
    logs: str = ""
    dask_dashboard: str = ""
    mlflow_password_file: str = ""  # set when MLflow's basic-auth app is on
    worker_env_file: str = ""  # set when the stack is on an address other hosts reach


def stack_dir(home: str | Path) -> Path:
    """Folder of the stack's state file and logs under MOPFLOW_HOME."""
    return Path(home) / "stack"


def state_path(home: str | Path) -> Path:
    """Where the state file lives."""
    return stack_dir(home) / "state.json"


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
            f"state file {path} is not a mopflow stack state ({validation_message(exc)}); "
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


def dask_dashboard_url(port: int, has_bokeh: bool, host: str = DEFAULT_HOST) -> str:
    """The Dask page to open on ``host``: the Bokeh dashboard, or, without bokeh (it is optional),
    the scheduler's plain HTML pages on workers and tasks."""
    base = f"http://{url_host(host)}:{port}"
    if has_bokeh:
        return f"{base}/status"
    return f"{base}/info/main/workers.html (install bokeh>=3.1 for the graphical dashboard at /status)"


def format_up_summary(state: StackState) -> str:
    """What ``mopflow up`` prints once everything answers: URLs, the admin password's file, logs."""
    urls = {s.name: s.url for s in state.services}
    p = state.ports
    title = (
        f"mopflow stack is up ({state.host} only)"
        if host_is_loopback(state.host)
        else f"mopflow stack is up on {state.host}"
    )
    lines = [
        "",
        title,
        "=" * len(title),
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
        f"Dask scheduler        : tcp://{url_host(state.host)}:{p.dask_scheduler}   dashboard {state.dask_dashboard}",
        *(
            [f"Celery worker hosts   : the settings in {state.worker_env_file} (mopflow worker-env)"]
            if state.worker_env_file
            else []
        ),
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
