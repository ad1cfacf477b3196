"""mopflow as an Airflow provider: what ``airflow providers list`` shows for it, its connection
types (``mopflow.plugins.connection_types``) and its ``[mopflow]`` config section.

Registered through the ``apache_airflow_provider`` entry point. The plugin is registered through
the ``airflow.plugins`` entry point alone, not listed here too: Airflow would load it twice.
"""

from __future__ import annotations

from typing import Any

from mopflow import __version__
from mopflow.pipeline.config import MAX_CONF_BYTES


def get_provider_info() -> dict[str, Any]:
    """The provider's description, in the shape of Airflow's ``provider_info.schema.json``."""
    return {
        "package-name": "mopflow",
        "name": "mopflow",
        "description": "Model selection at scale: Optuna searches training Lightning models on Dask, "
        "ensembles, distillation and the MLflow Model Registry, as Airflow DAGs.",
        "versions": [__version__],
        "connection-types": connection_types(),
        "config": {
            "mopflow": {
                "description": "mopflow's Airflow plugin: the trigger-time checks of a run's conf.",
                "options": {
                    "max_conf_bytes": {
                        "description": "Largest conf (JSON bytes) a trigger of a mopflow DAG may carry; "
                        "larger ones are refused with 413. At most the pipeline's own limit.",
                        "version_added": "0.2.0",
                        "type": "integer",
                        "example": "65536",
                        "default": str(MAX_CONF_BYTES),
                    }
                },
            }
        },
    }


# connection type -> (hook class in mopflow.plugins.connection_types, its hook_name): named, not
# imported, as Airflow imports a hook only when it needs its type.
CONNECTION_TYPES: dict[str, tuple[str, str]] = {
    "mopflow_mlflow": ("MlflowConnectionHook", "mopflow: MLflow tracking"),
    "mopflow_storage": ("StorageConnectionHook", "mopflow: storage (S3)"),
    "mopflow_optuna": ("OptunaConnectionHook", "mopflow: Optuna storage"),
    "mopflow_dask": ("DaskConnectionHook", "mopflow: Dask scheduler"),
}

# What the connection form shows for each type: the fields a type does not use hidden, the others
# named for what they give (mopflow.base.connections maps them).
_UI: dict[str, dict[str, Any]] = {
    "mopflow_mlflow": {
        "hidden-fields": [],
        "relabeling": {"host": "Tracking server host (or URL)", "schema": "Scheme", "login": "MLflow user"},
        "placeholders": {
            "host": "mlflow",
            "port": "5000",
            "schema": "http",
            "extra": '{"tracking_uri": "databricks"}',
        },
    },
    "mopflow_storage": {
        "hidden-fields": ["host", "port", "schema"],
        "relabeling": {"login": "Access key id", "password": "Secret access key"},
        "placeholders": {"extra": '{"endpoint_url": "http://minio:9000", "region_name": "us-east-1"}'},
    },
    "mopflow_optuna": {
        "hidden-fields": [],
        "relabeling": {"schema": "Database"},
        "placeholders": {
            "host": "postgres",
            "port": "5432",
            "schema": "optuna",
            "extra": '{"dialect": "postgresql"}',
        },
    },
    "mopflow_dask": {
        "hidden-fields": ["login", "password"],
        "relabeling": {"host": "Scheduler host", "schema": "Protocol (tcp, tls, ...)"},
        "placeholders": {"host": "dask-scheduler", "port": "8786", "schema": "tcp"},
    },
}


def connection_types() -> list[dict[str, Any]]:
    """The connection types of ``mopflow.plugins.connection_types``, with their form's fields."""
    return [
        {
            "connection-type": conn_type,
            "hook-class-name": f"mopflow.plugins.connection_types.{class_name}",
            "hook-name": hook_name,
            "ui-field-behaviour": _UI[conn_type],
        }
        for conn_type, (class_name, hook_name) in CONNECTION_TYPES.items()
    ]
