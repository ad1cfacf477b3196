"""Settings from Airflow Connections (``mopflow.operators.connections``): connections given as
``AIRFLOW_CONN_*`` variables, which Airflow reads in a plain process as in a task."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from mopflow import operators
from mopflow.base.settings import Settings
from mopflow.operators.connections import connection_env, connection_settings
from mopflow.pipeline.records import RunContext, ShardRecord

REPO = Path(__file__).resolve().parents[2]
SECRETS = ("mlflowpw123", "optunapw456", "AKIASECRETID", "s3secretkey789")


@pytest.fixture
def conn_ids(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Fresh connection ids (no cache of another test's answers applies), all four pointed at."""
    suffix = uuid.uuid4().hex[:8]
    ids = {kind: f"test_{kind}_{suffix}" for kind in ("mlflow", "storage", "optuna", "dask")}
    for kind, conn_id in ids.items():
        monkeypatch.setenv(f"MOPFLOW_{kind.upper()}_CONN_ID", conn_id)
    return ids


def define(monkeypatch: pytest.MonkeyPatch, conn_id: str, **fields: Any) -> None:
    """An Airflow Connection, as Airflow reads it from the environment (JSON form)."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))


@pytest.fixture
def all_four(monkeypatch: pytest.MonkeyPatch, conn_ids: dict[str, str]) -> dict[str, str]:
    define(
        monkeypatch,
        conn_ids["mlflow"],
        conn_type="http",
        host="mlflow",
        port=5000,
        login="admin",
        password=SECRETS[0],
    )
    define(
        monkeypatch,
        conn_ids["optuna"],
        conn_type="postgres",
        host="db",
        port=5432,
        schema="optuna",
        login="mop",
        password=SECRETS[1],
    )
    define(
        monkeypatch,
        conn_ids["storage"],
        conn_type="aws",
        login=SECRETS[2],
        password=SECRETS[3],
        extra={"endpoint_url": "http://minio:9000"},
    )
    define(monkeypatch, conn_ids["dask"], conn_type="generic", host="sched")
    return conn_ids


def test_connections_win_over_the_variables_for_the_block_only(
    monkeypatch: pytest.MonkeyPatch, all_four: dict[str, str]
) -> None:
    monkeypatch.setenv("MOPFLOW_TRACKING_URI", "http://from-env:5000")
    monkeypatch.setenv("MOPFLOW_STORAGE_OPTIONS", '{"use_ssl": false}')
    monkeypatch.delenv("MOPFLOW_DASK_ADDRESS", raising=False)
    with connection_settings():
        settings = Settings.from_env()
        assert os.environ["MLFLOW_TRACKING_PASSWORD"] == SECRETS[0]
    assert settings.tracking_uri == "http://mlflow:5000"
    assert settings.optuna_storage == f"postgresql+psycopg2://mop:{SECRETS[1]}@db:5432/optuna"
    assert settings.dask_address == "tcp://sched:8786"
    assert dict(settings.storage_options) == {
        "use_ssl": False,
        "key": SECRETS[2],
        "secret": SECRETS[3],
        "endpoint_url": "http://minio:9000",
    }
    # afterwards the process's own variables again
    assert os.environ["MOPFLOW_TRACKING_URI"] == "http://from-env:5000"
    assert "MOPFLOW_DASK_ADDRESS" not in os.environ and "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_missing_connections_leave_the_variables(
    monkeypatch: pytest.MonkeyPatch, conn_ids: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MOPFLOW_TRACKING_URI", "http://from-env:5000")
    define(monkeypatch, conn_ids["dask"], conn_type="generic", host="sched", port=9999)
    before = dict(os.environ)
    with caplog.at_level(logging.INFO, logger="mopflow.operators.connections"):
        assert connection_env() == {"MOPFLOW_DASK_ADDRESS": "tcp://sched:9999"}
    assert conn_ids["dask"] in caplog.text and conn_ids["mlflow"] not in caplog.text
    with connection_settings():
        assert Settings.from_env().tracking_uri == "http://from-env:5000"
    assert dict(os.environ) == before


def test_no_connection_at_all_changes_nothing_and_logs_nothing(
    conn_ids: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="mopflow.operators.connections"),
        connection_settings() as values,
    ):
        assert values == {}
    assert "connection" not in caplog.text


def test_a_connection_s_secrets_are_never_logged(
    all_four: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG), connection_settings():
        pass
    for conn_id in all_four.values():
        assert conn_id in caplog.text
    assert "mop:***@db:5432/optuna" in caplog.text and "http://minio:9000" in caplog.text
    for secret in SECRETS:
        assert secret not in caplog.text


def test_a_stage_called_by_a_task_sees_the_connections(
    monkeypatch: pytest.MonkeyPatch, all_four: dict[str, str]
) -> None:
    monkeypatch.setattr(
        "airflow.sdk.get_current_context", lambda: {"params": {}, "triggering_asset_events": {}}
    )
    monkeypatch.setenv("MOPFLOW_DASK_ADDRESS", "tcp://from-env:8786")
    seen: list[Settings] = []

    def stage(conf: dict[str, Any], run: RunContext) -> ShardRecord:
        seen.append(Settings.from_env())
        return ShardRecord(manifest_uri="/m.json", manifest_hash="ab", reused=True)

    run = RunContext(dag_id="d", airflow_run_id="r", run_key="k", parent_run_id="p")
    operators.call_stage(stage, run.to_xcom())
    assert seen[0].dask_address == "tcp://sched:8786" and seen[0].tracking_uri == "http://mlflow:5000"
    assert os.environ["MOPFLOW_DASK_ADDRESS"] == "tcp://from-env:8786"


PROBE_DAG = """
from airflow.sdk import dag, task


@dag(schedule=None)
def mopflow_connection_probe():
    @task
    def probe():
        import os

        from mopflow.base.settings import Settings
        from mopflow.operators.connections import connection_settings

        with connection_settings():
            settings = Settings.from_env()
        print("PROBE", settings.tracking_uri, settings.dask_address, os.environ["MOPFLOW_TRACKING_URI"])

    probe()


probe_dag = mopflow_connection_probe()

if __name__ == "__main__":
    probe_dag.test()
"""


@pytest.mark.slow
def test_a_task_run_by_dag_test_reads_the_connections(tmp_path: Path) -> None:
    """In a real task (dag.test's supervisor answers the lookups), a connection wins, a missing
    one is not used, and the task's log names the connection without its password."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "probe.py").write_text(PROBE_DAG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_"))}
    env.update(
        PYTHONPATH=str(REPO),
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW_CONN_MOPFLOW_MLFLOW=json.dumps(
            {"conn_type": "http", "host": "mlflow", "port": 5000, "login": "admin", "password": SECRETS[0]}
        ),
        MOPFLOW_TRACKING_URI="http://from-env:5000",
        MOPFLOW_DASK_ADDRESS="tcp://from-env:8786",
    )
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [str(bin_dir / "airflow"), "db", "migrate"], env=env, check=True, capture_output=True, timeout=300
    )
    run = subprocess.run(
        [sys.executable, str(dags / "probe.py")], env=env, capture_output=True, text=True, timeout=300
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "PROBE http://mlflow:5000 tcp://from-env:8786 http://from-env:5000" in out
    assert "connection(s) mopflow_mlflow:" in out and "MLFLOW_TRACKING_PASSWORD=***" in out
    assert SECRETS[0] not in out
