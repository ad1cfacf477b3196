"""Settings from Airflow Connections, resolved in the task and handed down as plain values.

The stages read their settings from ``MOPFLOW_*`` variables (``Settings.from_env``) and never
import Airflow. A task looks up mopflow's four connections here (ids in
``mopflow.base.connections.CONN_ID_ENV``) and, for the duration of its stage call, sets the
variables they stand for over the process's own: a connection wins over a variable, a missing
connection leaves the variable as it is. Which connections were used is logged, with their values
redacted: never a password, key or token.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from mopflow.base.connections import ConnectionFields, ConnectionKind, conn_ids, redacted, settings_env

log = logging.getLogger(__name__)


def lookup(conn_id: str) -> ConnectionFields | None:
    """The connection ``conn_id`` as plain fields, or None when Airflow knows no such connection
    (its secrets backends, ``AIRFLOW_CONN_*`` variables and metadata DB). Other errors (a secrets
    backend down) propagate: the task retries."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = Connection.get(conn_id)
    except AirflowNotFoundException:
        return None
    return ConnectionFields.of(conn_id, conn)


def connection_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``MOPFLOW_*`` (and MLflow credential) values mopflow's Airflow Connections give, over
    ``environ`` (default ``os.environ``); empty when none of them exists."""
    env = os.environ if environ is None else environ
    found: dict[ConnectionKind, ConnectionFields] = {}
    for kind, conn_id in conn_ids(env).items():
        conn = lookup(conn_id)
        if conn is not None:
            found[kind] = conn
    values = settings_env(found, env)
    if found:
        log.info(
            "mopflow: settings from Airflow connection(s) %s: %s",
            ", ".join(conn.conn_id for conn in found.values()),
            ", ".join(f"{name}={value}" for name, value in sorted(redacted(values).items())),
        )
    return values


@contextmanager
def connection_settings() -> Iterator[dict[str, str]]:
    """Within the block, ``os.environ`` holds the values mopflow's Airflow Connections give
    (:func:`connection_env`); afterwards it is as before. Yields those values."""
    values = connection_env()
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
