"""The stack's configuration: its ports and knobs, from ``mopflow up``'s flags and the ``MOPFLOW_*``
environment, validated before anything starts."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The address every server binds and advertises unless MOPFLOW_STACK_HOST (`up --host`) names
# another: loopback, so that nothing is reachable from other hosts by default (but Airflow's log
# servers, which Airflow binds to all interfaces).
DEFAULT_HOST = "127.0.0.1"
HOST_ENV = "MOPFLOW_STACK_HOST"
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)

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
    "host": (
        HOST_ENV,
        "address every server binds and advertises (default 127.0.0.1); another host's workers reach the "
        "stack there (not 0.0.0.0: this host's own address)",
    ),
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


class StackError(RuntimeError):
    """The stack cannot be started, stopped or inspected as asked; the message says why."""


def check_host(host: str) -> str:
    """``host`` if it is an address the stack can bind and advertise: an IP address or a host
    name, not an unspecified address (``0.0.0.0``, ``::``), which binds every interface but names
    no host a client could connect to. Raises ``ValueError`` naming :data:`HOST_ENV`."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(
                f"{HOST_ENV} (--host) {host!r} is neither an IP address nor a host name"
            ) from None
        return host.lower()  # names compare without case (as urlsplit reports them)
    if address.is_unspecified:
        raise ValueError(
            f"{HOST_ENV} (--host) {host!r} binds every interface but cannot be advertised: tasks and "
            "workers would connect to it; give this host's own address (e.g. 10.0.0.5) or name"
        )
    return str(address)


def host_is_loopback(host: str) -> bool:
    """Whether the stack's address is this host's loopback (``localhost``, 127.0.0.0/8, ``::1``):
    then no other host can reach it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


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
    host: str = DEFAULT_HOST  # MOPFLOW_STACK_HOST, or `mopflow up --host`: bound and advertised
    dask_workers: int = Field(ge=1, le=256)  # MOPFLOW_DASK_WORKERS, or `mopflow up --dask-workers`
    pool_slots: int = Field(1, ge=1, le=1024)
    timeout_s: float = Field(300.0, gt=0, le=3600)
    grace_s: float = Field(20.0, ge=0, le=600)
    mlflow_auth: bool = False
    free_ports: bool = False  # the ports were chosen free (--free-ports), not given by the user
    serve_model: str = Field("mopflow-student", min_length=1, max_length=256, pattern=r"^[\w.-]+$")

    @field_validator("host")
    @classmethod
    def _bindable_and_advertised(cls, host: str) -> str:
        return check_host(host)

    @property
    def loopback(self) -> bool:
        """Whether the stack is on loopback only (:func:`host_is_loopback`): no other host reaches it."""
        return host_is_loopback(self.host)


def validation_message(exc: ValidationError) -> str:
    """A pydantic error as ``field=value: why`` parts, one per failed field."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}={err.get('input')!r}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


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
        raise StackError(validation_message(exc)) from exc


def config_from_env(
    environ: Mapping[str, str],
    requested_ports: Mapping[str, int | None],
    free_ports: bool | None,
    dask_workers: int,
    pick_free: Callable[[], int],
    mlflow_auth: bool | None = None,
    host: str | None = None,
) -> StackConfig:
    """The stack config from flags (ports, ``--free-ports``, ``--auth``, ``--host``) and the
    ``MOPFLOW_*`` environment."""
    auth = mlflow_auth if mlflow_auth is not None else environ.get("MOPFLOW_STACK_AUTH", "") in {"1", "true"}
    free = (
        free_ports if free_ports is not None else environ.get("MOPFLOW_STACK_FREE_PORTS", "") in {"1", "true"}
    )
    try:  # before any port is picked on it
        address = check_host(stack_host(environ, host))
    except ValueError as exc:
        raise StackError(str(exc)) from exc
    ports = choose_ports(requested_ports, environ, free, pick_free)
    try:
        return StackConfig(
            ports=ports,
            host=address,
            dask_workers=dask_workers,
            pool_slots=int(_env_number(environ, "MOPFLOW_TRAINING_POOL_SLOTS", int, 1)),
            timeout_s=_env_number(environ, "MOPFLOW_STACK_TIMEOUT_S", float, 300.0),
            grace_s=_env_number(environ, "MOPFLOW_STACK_GRACE_S", float, 20.0),
            mlflow_auth=auth,
            free_ports=free,
            serve_model=environ.get("MOPFLOW_SERVE_MODEL", "").strip() or "mopflow-student",
        )
    except ValidationError as exc:
        raise StackError(validation_message(exc)) from exc


def stack_host(environ: Mapping[str, str], flag: str | None = None) -> str:
    """The stack's address as given: the ``--host`` flag, else :data:`HOST_ENV`, else
    :data:`DEFAULT_HOST` (validated by :class:`StackConfig`)."""
    return (flag or "").strip() or environ.get(HOST_ENV, "").strip() or DEFAULT_HOST
