"""Settings from connections: plain connection fields mapped to the settings' environment values.

An Airflow user keeps addresses and secrets in Airflow Connections (and a secrets backend), not in
``MOPFLOW_*`` variables. The Airflow task looks the connections up (``mopflow.operators.connections``)
and hands their fields here as :class:`ConnectionFields`; this module, free of Airflow, says which
environment values they stand for. A value given by a connection wins over the variable's own.

Four connections, each named by a variable (default id in brackets):

* ``MOPFLOW_MLFLOW_CONN_ID`` [``mopflow_mlflow``]: the MLflow tracking URI and its basic-auth user;
* ``MOPFLOW_STORAGE_CONN_ID`` [``mopflow_storage``]: the fsspec storage options (S3 keys, endpoint);
* ``MOPFLOW_OPTUNA_CONN_ID`` [``mopflow_optuna``]: the Optuna storage URL (an RDB URL);
* ``MOPFLOW_DASK_CONN_ID`` [``mopflow_dask``]: the Dask scheduler's address.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from mopflow.base.settings import SettingsError

ConnectionKind = Literal["mlflow", "storage", "optuna", "dask"]

# kind -> (variable naming the connection id, default id). An empty variable turns the kind off.
CONN_ID_ENV: dict[ConnectionKind, tuple[str, str]] = {
    "mlflow": ("MOPFLOW_MLFLOW_CONN_ID", "mopflow_mlflow"),
    "storage": ("MOPFLOW_STORAGE_CONN_ID", "mopflow_storage"),
    "optuna": ("MOPFLOW_OPTUNA_CONN_ID", "mopflow_optuna"),
    "dask": ("MOPFLOW_DASK_CONN_ID", "mopflow_dask"),
}

# MLflow reads its basic-auth credentials from these (mlflow.environment_variables).
MLFLOW_USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
MLFLOW_PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"

# Connection types naming a database, and the SQLAlchemy dialect+driver each maps to (psycopg2
# is what the ``postgres`` extra installs).
DB_SCHEMES: dict[str, str] = {
    "postgres": "postgresql+psycopg2",
    "postgresql": "postgresql+psycopg2",
    "mysql": "mysql",
    "sqlite": "sqlite",
}
DASK_PROTOCOLS = frozenset({"tcp", "tls", "ws", "wss", "ucx", "inproc"})
DASK_PORT = 8786
_SECRET_WORDS = ("secret", "key", "token", "password")


class ConnectionSettingsError(SettingsError):
    """A connection exists but does not give the setting it stands for."""


@dataclass(frozen=True)
class ConnectionFields:
    """The fields of one connection (Airflow's, or any other source's), as plain values."""

    conn_id: str
    conn_type: str = ""
    host: str = ""
    port: int | None = None
    schema: str = ""
    login: str = ""
    password: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, conn_id: str, conn: Any) -> ConnectionFields:
        """The plain fields of a connection object (Airflow's ``Connection``, read by attribute)."""
        return cls(
            conn_id=conn_id,
            conn_type=conn.conn_type or "",
            host=conn.host or "",
            port=conn.port,
            schema=conn.schema or "",
            login=conn.login or "",
            password=conn.password or "",
            extra=conn.extra_dejson,
        )


def conn_ids(environ: Mapping[str, str]) -> dict[ConnectionKind, str]:
    """The connection id of each kind: its variable, else the default; kinds turned off (the
    variable set empty) are left out."""
    ids: dict[ConnectionKind, str] = {}
    for kind, (var, default) in CONN_ID_ENV.items():
        conn_id = environ.get(var, default).strip()
        if conn_id:
            ids[kind] = conn_id
    return ids


def _with_port(url: str, port: int | None) -> str:
    """``url`` with ``port`` added when it names none itself."""
    parts = urlsplit(url)
    if port is None or parts.port is not None or not parts.hostname:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.netloc}:{port}"))


def database_url(conn: ConnectionFields, default_type: str = "postgres") -> str:
    """A SQLAlchemy URL from the connection's fields: ``dialect+driver://login:password@host:port/
    schema?query``. The dialect is the connection type's (``postgres`` → ``postgresql+psycopg2``)
    or, for another type, extra ``dialect`` (default ``default_type``'s); extra ``driver`` picks
    another driver, extra ``query`` (an object) adds URL parameters (``sslmode``)."""
    kind = conn.conn_type if conn.conn_type in DB_SCHEMES else str(conn.extra.get("dialect") or default_type)
    scheme = DB_SCHEMES.get(kind, kind)
    if conn.extra.get("driver"):
        scheme = f"{scheme.split('+', 1)[0]}+{conn.extra['driver']}"
    if scheme == "sqlite":  # a file: the host (Airflow's sqlite connections) or the schema
        return f"sqlite:///{conn.host or conn.schema}"
    if not conn.host:
        raise ConnectionSettingsError(f"connection {conn.conn_id!r} names no host and no extra 'url'")
    auth = quote(conn.login, safe="")
    if conn.password:
        auth += ":" + quote(conn.password, safe="")
    netloc = (f"{auth}@" if auth else "") + conn.host + (f":{conn.port}" if conn.port else "")
    query = conn.extra.get("query") or {}
    if not isinstance(query, Mapping):
        raise ConnectionSettingsError(f"connection {conn.conn_id!r}: extra 'query' must be an object")
    return urlunsplit((scheme, netloc, f"/{conn.schema}" if conn.schema else "", urlencode(query), ""))


def mlflow_env(conn: ConnectionFields) -> dict[str, str]:
    """``MOPFLOW_TRACKING_URI`` and MLflow's basic-auth user.

    The URI is extra ``tracking_uri`` when given; else a database URL for a database type
    (``postgres``, ``mysql``, ``sqlite``: MLflow's own backend store); else ``http://host:port``
    (``https`` when the schema or type says so, the host as it is when it has a scheme).
    Login and password are MLflow's ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``.
    """
    env: dict[str, str] = {}
    if conn.extra.get("tracking_uri"):
        env["MOPFLOW_TRACKING_URI"] = str(conn.extra["tracking_uri"])
    elif conn.conn_type in DB_SCHEMES:
        env["MOPFLOW_TRACKING_URI"] = database_url(conn)
    elif conn.host:
        if "://" in conn.host:
            uri = _with_port(conn.host.rstrip("/"), conn.port)
        else:
            scheme = "https" if "https" in (conn.schema, conn.conn_type) else "http"
            uri = f"{scheme}://{conn.host}" + (f":{conn.port}" if conn.port else "")
        env["MOPFLOW_TRACKING_URI"] = uri
    if conn.login:
        env[MLFLOW_USERNAME_ENV] = conn.login
    if conn.password:
        env[MLFLOW_PASSWORD_ENV] = conn.password
    if not env:
        raise ConnectionSettingsError(
            f"connection {conn.conn_id!r} names no host, no extra 'tracking_uri' and no login"
        )
    return env


def storage_env(conn: ConnectionFields, current: str = "") -> dict[str, str]:
    """``MOPFLOW_STORAGE_OPTIONS``: ``current`` (the variable's JSON) with the connection's keys
    on top. Extra ``storage_options`` (an object) is taken as it is; then, as in Airflow's
    ``aws`` connections: login → ``key``, password → ``secret`` (else extra
    ``aws_access_key_id`` / ``aws_secret_access_key``), extra ``aws_session_token`` → ``token``,
    extra ``endpoint_url`` → ``endpoint_url``, extra ``region_name`` → ``client_kwargs.region_name``."""
    try:
        options: dict[str, Any] = dict(json.loads(current or "{}"))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise SettingsError(f"MOPFLOW_STORAGE_OPTIONS is not a JSON object: {exc}") from exc
    extra = conn.extra
    given = extra.get("storage_options") or {}
    if not isinstance(given, Mapping):
        raise ConnectionSettingsError(
            f"connection {conn.conn_id!r}: extra 'storage_options' must be an object"
        )
    options.update(given)
    for option, value in (
        ("key", conn.login or extra.get("aws_access_key_id")),
        ("secret", conn.password or extra.get("aws_secret_access_key")),
        ("token", extra.get("aws_session_token")),
        ("endpoint_url", extra.get("endpoint_url")),
    ):
        if value:
            options[option] = str(value)
    if extra.get("region_name"):
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "region_name": extra["region_name"]}
    return {"MOPFLOW_STORAGE_OPTIONS": json.dumps(options, sort_keys=True)}


def optuna_env(conn: ConnectionFields) -> dict[str, str]:
    """``MOPFLOW_OPTUNA_STORAGE``: extra ``url`` when given (a journal path too), else the
    database URL of the connection's fields (:func:`database_url`)."""
    if conn.extra.get("url"):
        return {"MOPFLOW_OPTUNA_STORAGE": str(conn.extra["url"])}
    return {"MOPFLOW_OPTUNA_STORAGE": database_url(conn)}


def dask_env(conn: ConnectionFields) -> dict[str, str]:
    """``MOPFLOW_DASK_ADDRESS``: extra ``address`` when given; else ``tcp://host:port`` (port
    8786 unless given; the protocol is the schema's or the type's when one of Dask's, and the host
    is taken as it is when it has one)."""
    if conn.extra.get("address"):
        return {"MOPFLOW_DASK_ADDRESS": str(conn.extra["address"])}
    if not conn.host:
        raise ConnectionSettingsError(f"connection {conn.conn_id!r} names no host and no extra 'address'")
    if "://" in conn.host:
        return {"MOPFLOW_DASK_ADDRESS": _with_port(conn.host, conn.port or DASK_PORT)}
    protocol = next((p for p in (conn.schema, conn.conn_type) if p in DASK_PROTOCOLS), "tcp")
    return {"MOPFLOW_DASK_ADDRESS": f"{protocol}://{conn.host}:{conn.port or DASK_PORT}"}


def settings_env(
    connections: Mapping[ConnectionKind, ConnectionFields], environ: Mapping[str, str]
) -> dict[str, str]:
    """The environment values the found ``connections`` give (a kind without one gives none):
    what to set over ``environ`` for :meth:`Settings.from_env` to see them."""
    env: dict[str, str] = {}
    for kind, conn in connections.items():
        if kind == "mlflow":
            env.update(mlflow_env(conn))
        elif kind == "storage":
            env.update(storage_env(conn, environ.get("MOPFLOW_STORAGE_OPTIONS", "")))
        elif kind == "optuna":
            env.update(optuna_env(conn))
        else:
            env.update(dask_env(conn))
    return env


def _mask(value: Any) -> Any:
    """Storage options with every secret-looking value (keys, secrets, tokens) masked, nested too."""
    if isinstance(value, Mapping):
        return {
            k: "***" if any(word in str(k).lower() for word in _SECRET_WORDS) else _mask(v)
            for k, v in value.items()
        }
    return value


def redact_userinfo(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part replaced by ``***``."""
    from mopflow.base.optuna_storage import redact_url  # imports Optuna: only when logging

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return redact_url(url)
    except ValueError:  # not a URL: nothing to redact in a path
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def redacted(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as it may be logged: passwords in URLs, MLflow's password and the storage
    options' keys, secrets and tokens masked."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if name == MLFLOW_PASSWORD_ENV:
            out[name] = "***"
        elif name == "MOPFLOW_STORAGE_OPTIONS":
            out[name] = json.dumps(_mask(json.loads(value)), sort_keys=True)
        else:
            out[name] = redact_userinfo(value)
    return out
