"""The Airflow connection types mopflow declares (``provider_info``'s ``connection-types``).

Airflow lists a provider's connection types in its connection form only through a hook class per
type. These hooks are thin: their connection gives settings (``mopflow.base.connections``), which
the tasks read themselves (``mopflow.operators.connections``); ``get_conn`` shows what a connection
gives, e.g. from a notebook. Any other type (``http``, ``aws``, ``postgres``) serves as well.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from airflow.sdk import BaseHook

from mopflow.base.connections import CONN_ID_ENV, ConnectionFields, ConnectionKind, settings_env


class MopflowConnectionHook(BaseHook):
    """A connection giving one kind of mopflow settings."""

    kind: ClassVar[ConnectionKind]
    conn_name_attr = "conn_id"

    def __init__(self, conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conn_id = conn_id or CONN_ID_ENV[self.kind][1]

    def get_conn(self) -> dict[str, str]:
        """The environment values (``MOPFLOW_*``) the connection gives, secrets included."""
        conn = self.get_connection(self.conn_id)
        return settings_env({self.kind: ConnectionFields.of(self.conn_id, conn)}, os.environ)


class MlflowConnectionHook(MopflowConnectionHook):
    """The MLflow tracking URI and its basic-auth user."""

    kind = "mlflow"
    conn_type = "mopflow_mlflow"
    default_conn_name = "mopflow_mlflow"
    hook_name = "mopflow: MLflow tracking"


class StorageConnectionHook(MopflowConnectionHook):
    """The fsspec storage options: S3 keys, endpoint, region."""

    kind = "storage"
    conn_type = "mopflow_storage"
    default_conn_name = "mopflow_storage"
    hook_name = "mopflow: storage (S3)"


class OptunaConnectionHook(MopflowConnectionHook):
    """The Optuna storage's database."""

    kind = "optuna"
    conn_type = "mopflow_optuna"
    default_conn_name = "mopflow_optuna"
    hook_name = "mopflow: Optuna storage"


class DaskConnectionHook(MopflowConnectionHook):
    """The Dask scheduler's address."""

    kind = "dask"
    conn_type = "mopflow_dask"
    default_conn_name = "mopflow_dask"
    hook_name = "mopflow: Dask scheduler"


HOOKS: tuple[type[MopflowConnectionHook], ...] = (
    MlflowConnectionHook,
    StorageConnectionHook,
    OptunaConnectionHook,
    DaskConnectionHook,
)
