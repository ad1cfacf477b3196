"""The stack's commands: ``up`` (start every service, wait for its health checks, set the
training pool), ``down`` (stop what was recorded) and ``status`` (what runs and answers)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mopflow.base.airflow_home import migrate_airflow_db
from mopflow.base.optuna_storage import journal_path, storage_kind
from mopflow.base.ports import port_was_taken
from mopflow.base.settings import TRAINING_POOL, Settings
from mopflow.infra.stack.airflow_services import set_training_pool
from mopflow.infra.stack.auth import (
    MlflowAuth,
    airflow_password_file,
    owner_only,
    prepare_airflow_secrets,
    prepare_mlflow_auth,
)
from mopflow.infra.stack.config import StackConfig, StackError
from mopflow.infra.stack.probes import port_answers, port_bindable, probe_all
from mopflow.infra.stack.processes import is_running, spawn, stop_services, wait_healthy
from mopflow.infra.stack.services import CELERY_SERVICES, SERVICE_ORDER, ServiceRecord, ServiceSpec
from mopflow.infra.stack.specs import build_specs, mlflow_server_stores
from mopflow.infra.stack.state import (
    StackState,
    dask_dashboard_url,
    format_status,
    format_up_summary,
    read_state,
    stack_dir,
    stack_lock,
    state_path,
    write_state,
)
from mopflow.infra.stack.worker_env import worker_env_path, write_worker_env


def _has_module(name: str, bin_dir: str) -> bool:
    """Whether the services' Python (the venv of ``bin_dir``) can import ``name``."""
    python = Path(bin_dir) / "python"
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _require_stack_extra(bin_dir: str, has_module: Callable[[str, str], bool]) -> None:
    """Refuse a stack whose services' Python lacks the stack extra (optuna-dashboard)."""
    from mopflow.base.extras import MissingExtraError, require_extra

    try:
        require_extra(
            "stack", f"mopflow up (optuna-dashboard, in {bin_dir})", lambda m: has_module(m, bin_dir)
        )
    except MissingExtraError as exc:
        raise StackError(str(exc)) from exc


def create_optuna_tables(url: str) -> None:
    """Create (or upgrade) Optuna's tables in an RDB storage, as any Optuna client would."""
    from optuna.storages import RDBStorage

    from mopflow.base.optuna_storage import redact_url

    try:
        RDBStorage(url).engine.dispose()
    except Exception as exc:
        raise StackError(
            f"MOPFLOW_OPTUNA_STORAGE={redact_url(url)!r}: cannot open or create Optuna's tables: {exc}"
        ) from exc


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
    pool, and return the recorded state. A stack already running is reported, not duplicated.

    Raises :class:`StackError`, or ``AirflowSetupError`` when Airflow's metadata database cannot
    be migrated (the CeleryExecutor's components; standalone migrates it itself)."""
    bin_dir = bin_dir or str(Path(sys.executable).parent)
    has_module = has_module or _has_module
    home = Path(settings.home)
    path = state_path(home)
    with stack_lock(home):
        existing = _already_running(path, say)
        if existing is not None:
            return existing
        _require_stack_extra(bin_dir, has_module)
        if config.mlflow_auth and not has_module("flask_wtf", bin_dir):
            raise StackError(
                "--auth runs MLflow's basic-auth app, which needs the auth extra (Flask-WTF): "
                f"install it into the environment of {bin_dir} (pip install 'mopflow[auth]')"
            )
        auth = prepare_mlflow_auth(home) if config.mlflow_auth else None
        # On an address other hosts reach, their Airflow components need the stack's secrets. On
        # loopback every component reads the one airflow.cfg, but secrets an earlier stack kept
        # stay in force: connections may be encrypted with their Fernet key.
        shared = prepare_airflow_secrets(home, settings.airflow_home, environ, generate=not config.loopback)
        specs = build_specs(settings, config, bin_dir, environ, auth=auth, airflow_secrets=shared)
        _refuse_taken_ports(specs, config.host)
        _prepare_stores(settings, environ, config.host)
        worker_env_file = _worker_env_file(home, config, _airflow_spec(specs), say)
        state = _new_state(settings, config, _airflow_spec(specs), auth, has_module("bokeh", bin_dir))
        state = state.model_copy(update={"worker_env_file": worker_env_file})
        state = _start(specs, state, path, config, bin_dir, say)
        say(format_up_summary(state))
        return state


PORT_ATTEMPTS = 3


def up_choosing_ports(
    settings: Settings,
    choose_config: Callable[[], StackConfig],
    environ: Mapping[str, str],
    say: Callable[[str], None] = print,
    attempts: int = PORT_ATTEMPTS,
    **up_options: Any,
) -> StackState:
    """:func:`up` with the config ``choose_config`` gives. When it chose the ports free
    (``free_ports``), a start-up that fails because a port was taken meanwhile (bound by another
    process between the choice and the service's bind) chooses the ports again and starts again,
    ``attempts`` times in all; fixed ports are the user's, and a taken one is an error at once."""
    for attempt in range(1, attempts + 1):
        config = choose_config()
        try:
            return up(settings, config, environ, say, **up_options)
        except StackError as exc:
            if not (config.free_ports and attempt < attempts and port_was_taken(exc)):
                raise
            say(
                f"a port was taken before its service bound it: choosing new ports ({attempt + 1}/{attempts})"
            )
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _already_running(path: Path, say: Callable[[str], None]) -> StackState | None:
    """The recorded stack when all of it runs (reported); a stale state file is removed, a partly
    running stack refused."""
    existing = read_state(path)
    if existing is None:
        return None
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
    return None


def _refuse_taken_ports(specs: Sequence[ServiceSpec], host: str) -> None:
    """Fail before anything starts when a port of the stack is in use on its address ``host``."""
    taken = [
        f"{spec.name} port {port}"
        for spec in specs
        for port in spec.ports
        if port_answers(port, host) or not port_bindable(port, host)
    ]
    if taken:
        raise StackError(
            f"port(s) already in use: {', '.join(taken)}; choose others with --*-port / "
            f"MOPFLOW_*_PORT or pass --free-ports"
        )


def _prepare_stores(settings: Settings, environ: Mapping[str, str], host: str) -> None:
    """The local folders the servers write to, and Optuna's tables in an RDB storage."""
    for folder in (settings.airflow_home, mlflow_server_stores(settings, environ, host)[1]):
        if "://" not in folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    if storage_kind(settings.optuna_storage) == "journal":
        Path(journal_path(settings.optuna_storage)).parent.mkdir(parents=True, exist_ok=True)
    else:  # optuna-dashboard opens an RDB without creating its tables
        create_optuna_tables(settings.optuna_storage)


def _airflow_spec(specs: Sequence[ServiceSpec]) -> ServiceSpec:
    return next(s for s in specs if s.name == "airflow")


def _worker_env_file(
    home: Path, config: StackConfig, airflow: ServiceSpec, say: Callable[[str], None]
) -> str:
    """The worker hosts' settings, written when other hosts reach the stack (what cannot work
    from another host said); on loopback, none: an earlier stack's file is removed, as no
    worker elsewhere could use its address now."""
    if config.loopback:
        worker_env_path(home).unlink(missing_ok=True)
        return ""
    path, warnings = write_worker_env(home, airflow.env)
    for warning in warnings:
        say(f"  warning for worker hosts: {warning}")
    return str(path)


def _new_state(
    settings: Settings, config: StackConfig, airflow: ServiceSpec, auth: MlflowAuth | None, has_bokeh: bool
) -> StackState:
    """The state of a stack about to start, with no service recorded yet."""
    return StackState(
        home=str(Path(settings.home)),
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        ports=config.ports,
        host=config.host,
        airflow_password_file=airflow_password_file(settings.airflow_home, airflow.env),
        dask_dashboard=dask_dashboard_url(config.ports.dask_dashboard, has_bokeh, config.host),
        mlflow_password_file=auth.password_file if auth else "",
        logs=str(stack_dir(settings.home) / "logs"),
    )


def _start(
    specs: Sequence[ServiceSpec],
    state: StackState,
    path: Path,
    config: StackConfig,
    bin_dir: str,
    say: Callable[[str], None],
) -> StackState:
    """Start the services in order, each recorded at once, wait for their health checks and set
    the training pool; on any failure stop what was started and remove the state file."""
    airflow_env = _airflow_spec(specs).env
    records: list[ServiceRecord] = []
    try:
        if len([s for s in specs if s.name.startswith("airflow")]) > 1:  # components, not standalone
            say("  migrating Airflow's metadata database (airflow db migrate)...")
            migrate_airflow_db(airflow_env, bin_dir, inherit=False)
        for spec in specs:
            records.append(spawn(spec, Path(state.logs)))
            say(f"  {spec.name:17} started   pid {records[-1].pid}, log {records[-1].log}")
            # Recorded at once: a `down` from another shell can stop a half-started stack.
            state = state.model_copy(update={"services": tuple(records)})
            write_state(path, state)
        say(f"waiting for the health checks (up to {config.timeout_s:.0f} s)...")
        wait_healthy(records, config.timeout_s, say)
        owner_only(Path(state.airflow_password_file))
        set_training_pool(airflow_env, bin_dir, config.pool_slots)
        say(f"  airflow pool {TRAINING_POOL!r} set to {config.pool_slots} slot(s)")
    except BaseException:
        say("start-up failed: stopping what was started")
        stop_services(records, config.grace_s, say)
        path.unlink(missing_ok=True)
        raise
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
        busy = [f"{r.name}:{p}" for r in state.services for p in r.ports if port_answers(p, state.host)]
        path.unlink(missing_ok=True)
        say(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        if busy:
            say(f"warning: port(s) still answer after stopping: {', '.join(busy)}")
        return stopped


def status(home: str | Path, say: Callable[[str], None] = print, as_json: bool = False) -> bool:
    """Print what runs and whether it answers (a table, or with ``as_json`` one JSON object);
    True when every recorded service is healthy."""
    import json

    path = state_path(home)
    state = read_state(path)
    health: dict[str, tuple[bool, bool, str]] = {}
    for rec in state.services if state is not None else ():
        running = is_running(rec)
        ok, detail = probe_all(rec.checks) if running else (False, "process gone")
        health[rec.name] = (running, ok, detail)
    healthy = all(ok for _, ok, _ in health.values()) and bool(health)
    if as_json:
        services = [
            {
                "name": rec.name,
                "pid": rec.pid,
                "url": rec.url,
                "running": health[rec.name][0],
                "healthy": health[rec.name][1],
                "detail": health[rec.name][2],
            }
            for rec in (state.services if state is not None else ())
        ]
        say(
            json.dumps(
                {
                    "state_file": str(path),
                    "recorded": state is not None,
                    "healthy": healthy,
                    "services": services,
                },
                indent=2,
            )
        )
    elif state is None:
        say(f"no mopflow stack recorded in {path} (start it with `mopflow up`)")
    else:
        say(format_status(state, health))
        say(f"airflow admin password in {state.airflow_password_file}; logs in {state.logs}")
    return healthy
