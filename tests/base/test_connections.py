"""Plain connection fields mapped to the settings' environment values (no Airflow involved)."""

from __future__ import annotations

import json

import pytest

from mopflow.base.connections import (
    ConnectionFields,
    ConnectionSettingsError,
    conn_ids,
    dask_env,
    database_url,
    mlflow_env,
    optuna_env,
    redacted,
    settings_env,
    storage_env,
)
from mopflow.base.settings import Settings


def test_conn_ids_default_and_can_be_renamed_or_turned_off() -> None:
    assert conn_ids({}) == {
        "mlflow": "mopflow_mlflow",
        "storage": "mopflow_storage",
        "optuna": "mopflow_optuna",
        "dask": "mopflow_dask",
    }
    ids = conn_ids({"MOPFLOW_MLFLOW_CONN_ID": "my_mlflow", "MOPFLOW_DASK_CONN_ID": ""})
    assert ids["mlflow"] == "my_mlflow" and "dask" not in ids


@pytest.mark.parametrize(
    ("fields", "uri"),
    [
        (ConnectionFields("m", "http", host="mlflow", port=5000), "http://mlflow:5000"),
        (
            ConnectionFields("m", "http", host="mlflow.example.com", schema="https"),
            "https://mlflow.example.com",
        ),
        (
            ConnectionFields("m", "https", host="mlflow.example.com", port=8443),
            "https://mlflow.example.com:8443",
        ),
        (
            ConnectionFields("m", "http", host="https://mlflow.example.com/", port=443),
            "https://mlflow.example.com:443",
        ),
        (ConnectionFields("m", "generic", extra={"tracking_uri": "databricks"}), "databricks"),
        (
            ConnectionFields("m", "postgres", host="db", port=5432, schema="mlflow", login="u", password="p"),
            "postgresql+psycopg2://u:p@db:5432/mlflow",
        ),
    ],
)
def test_mlflow_tracking_uri(fields: ConnectionFields, uri: str) -> None:
    assert mlflow_env(fields)["MOPFLOW_TRACKING_URI"] == uri


def test_mlflow_login_and_password_are_mlflow_s_basic_auth_user() -> None:
    env = mlflow_env(ConnectionFields("m", "http", host="mlflow", login="admin", password="pw"))
    assert env == {
        "MOPFLOW_TRACKING_URI": "http://mlflow",
        "MLFLOW_TRACKING_USERNAME": "admin",
        "MLFLOW_TRACKING_PASSWORD": "pw",
    }


def test_an_empty_mlflow_connection_is_an_error_naming_it() -> None:
    with pytest.raises(ConnectionSettingsError, match="'my_mlflow'"):
        mlflow_env(ConnectionFields("my_mlflow", "http"))


def test_storage_keys_endpoint_and_region_over_the_variable_s_options() -> None:
    conn = ConnectionFields(
        "s",
        "aws",
        login="AKIA",
        password="s3cret/+",
        extra={"endpoint_url": "http://minio:9000", "region_name": "eu-west-1", "aws_session_token": "tok"},
    )
    current = json.dumps({"endpoint_url": "http://old:9000", "use_ssl": False})
    options = json.loads(storage_env(conn, current)["MOPFLOW_STORAGE_OPTIONS"])
    assert options == {
        "key": "AKIA",
        "secret": "s3cret/+",
        "token": "tok",
        "endpoint_url": "http://minio:9000",
        "use_ssl": False,  # the variable's own option, kept
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    settings = Settings.from_env({"MOPFLOW_STORAGE_OPTIONS": json.dumps(options)})
    assert settings.storage_options["key"] == "AKIA"


def test_storage_keys_from_aws_extras_and_options_as_given() -> None:
    conn = ConnectionFields(
        "s",
        "aws",
        extra={
            "aws_access_key_id": "AKIA",
            "aws_secret_access_key": "sk",
            "storage_options": {"anon": False, "key": "overridden"},
        },
    )
    options = json.loads(storage_env(conn)["MOPFLOW_STORAGE_OPTIONS"])
    assert options == {"anon": False, "key": "AKIA", "secret": "sk"}


@pytest.mark.parametrize(
    ("fields", "url"),
    [
        (
            ConnectionFields(
                "o", "postgres", host="db", port=5432, schema="optuna", login="mop", password="p@ss:/"
            ),
            "postgresql+psycopg2://mop:p%40ss%3A%2F@db:5432/optuna",
        ),
        (
            ConnectionFields(
                "o",
                "generic",
                host="db",
                schema="optuna",
                login="mop",
                extra={"dialect": "postgresql", "driver": "psycopg", "query": {"sslmode": "require"}},
            ),
            "postgresql+psycopg://mop@db/optuna?sslmode=require",
        ),
        (ConnectionFields("o", "mysql", host="db", schema="optuna"), "mysql://db/optuna"),
        (ConnectionFields("o", "sqlite", host="/tmp/optuna.db"), "sqlite:////tmp/optuna.db"),
        (ConnectionFields("o", "generic", extra={"url": "/shared/journal.log"}), "/shared/journal.log"),
    ],
)
def test_optuna_storage_url(fields: ConnectionFields, url: str) -> None:
    assert optuna_env(fields) == {"MOPFLOW_OPTUNA_STORAGE": url}


def test_the_optuna_url_s_password_round_trips_through_sqlalchemy() -> None:
    from sqlalchemy.engine import make_url

    url = database_url(ConnectionFields("o", "postgres", host="db", login="mop", password="p@ss:/#?"))
    assert make_url(url).password == "p@ss:/#?"


def test_an_optuna_connection_without_host_is_an_error() -> None:
    with pytest.raises(ConnectionSettingsError, match="no host"):
        optuna_env(ConnectionFields("o", "postgres"))


@pytest.mark.parametrize(
    ("fields", "address"),
    [
        (ConnectionFields("d", "generic", host="dask-scheduler"), "tcp://dask-scheduler:8786"),
        (ConnectionFields("d", "generic", host="sched", port=9000, schema="tls"), "tls://sched:9000"),
        (ConnectionFields("d", "generic", host="tls://sched"), "tls://sched:8786"),
        (ConnectionFields("d", "generic", extra={"address": "ucx://10.0.0.1:13337"}), "ucx://10.0.0.1:13337"),
    ],
)
def test_dask_address(fields: ConnectionFields, address: str) -> None:
    assert dask_env(fields) == {"MOPFLOW_DASK_ADDRESS": address}


def test_settings_env_takes_each_kind_found_and_nothing_else() -> None:
    env = settings_env(
        {"dask": ConnectionFields("d", host="sched"), "mlflow": ConnectionFields("m", host="mlflow")},
        {"MOPFLOW_OPTUNA_STORAGE": "/j.log"},
    )
    assert env == {"MOPFLOW_DASK_ADDRESS": "tcp://sched:8786", "MOPFLOW_TRACKING_URI": "http://mlflow"}


def test_redacted_masks_every_secret() -> None:
    env = {
        "MOPFLOW_TRACKING_URI": "https://user:pw1234@mlflow",
        "MLFLOW_TRACKING_USERNAME": "admin",
        "MLFLOW_TRACKING_PASSWORD": "pw5678",
        "MOPFLOW_OPTUNA_STORAGE": "postgresql+psycopg2://mop:pw9012@db/optuna",
        "MOPFLOW_STORAGE_OPTIONS": json.dumps(
            {
                "key": "AKIA",
                "secret": "sk3456",
                "endpoint_url": "http://minio:9000",
                "client_kwargs": {"aws_secret_access_key": "sk7"},
            }
        ),
        "MOPFLOW_DASK_ADDRESS": "tcp://sched:8786",
    }
    shown = json.dumps(redacted(env))
    for secret in ("pw1234", "pw5678", "pw9012", "AKIA", "sk3456", "sk7"):
        assert secret not in shown
    for kept in (
        "https://user:***@mlflow",
        "admin",
        "mop:***@db/optuna",
        "http://minio:9000",
        "tcp://sched:8786",
    ):
        assert kept in shown
