"""Airflow's environment, one for ``mopflow run``'s embedded Airflow and the stack's: the same
home, DAGs and venv; the stack's also serves on its ports, with tunables the user may override."""

from __future__ import annotations

import os
from pathlib import Path

from mopflow.infra.stack.environment import airflow_env, base_env, mopflow_env
from tests.infra.stack.helpers import BIN, settings_at, stack_config


def test_user_airflow_tunables_win_but_wiring_does_not(tmp_path: Path) -> None:
    environ = {"AIRFLOW__API__WORKERS": "3", "AIRFLOW__API__PORT": "1"}
    env = airflow_env(str(tmp_path), environ, BIN, stack_config().ports)
    assert "AIRFLOW__API__WORKERS" not in env  # the user's value is inherited unchanged
    assert env["AIRFLOW__API__PORT"] != "1"


def test_the_embedded_airflow_shares_home_dags_and_venv_but_serves_nothing(tmp_path: Path) -> None:
    environ = {"PATH": "/usr/bin", "MOPFLOW_DAGS_FOLDER": str(tmp_path / "dags")}
    env = airflow_env(str(tmp_path / "airflow"), environ, BIN)
    served = airflow_env(str(tmp_path / "airflow"), environ, BIN, stack_config().ports)
    assert {k: served[k] for k in env} == env  # the stack's is the embedded one, and more
    assert env["AIRFLOW_HOME"] == str(tmp_path / "airflow")
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(tmp_path / "dags")
    assert env["PATH"] == BIN + os.pathsep + "/usr/bin"
    assert not any(k.startswith(("AIRFLOW__API__", "AIRFLOW__LOGGING__")) for k in env)


def test_the_venv_is_put_on_path_once() -> None:
    assert base_env({"PATH": f"/usr/bin{os.pathsep}{BIN}"}, BIN)["PATH"] == f"/usr/bin{os.pathsep}{BIN}"
    assert base_env({}, BIN)["PATH"] == BIN
    assert "MLFLOW_TRACKING_URI" not in base_env(
        {"MLFLOW_TRACKING_URI": "x", "MLFLOW_S3_ENDPOINT_URL": "y"}, BIN
    )


def test_the_stacks_address_is_where_tasks_reach_its_servers(tmp_path: Path) -> None:
    ports = stack_config().ports
    settings = settings_at(tmp_path)
    env = mopflow_env(settings, ports, "10.0.0.5")
    assert env["MOPFLOW_TRACKING_URI"] == f"http://10.0.0.5:{ports.mlflow}"
    assert env["MOPFLOW_DASK_ADDRESS"] == f"tcp://10.0.0.5:{ports.dask_scheduler}"
    served = airflow_env(str(tmp_path), {}, BIN, ports, "10.0.0.5")
    assert served["AIRFLOW__API__HOST"] == "10.0.0.5"
    assert served["AIRFLOW__API__BASE_URL"] == f"http://10.0.0.5:{ports.airflow}"
    assert served["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == f"http://10.0.0.5:{ports.airflow}/execution/"
    # An IPv6 address is bound as it is and bracketed in the URLs.
    assert airflow_env(str(tmp_path), {}, BIN, ports, "fd00::2")["AIRFLOW__API__BASE_URL"] == (
        f"http://[fd00::2]:{ports.airflow}"
    )
    assert mopflow_env(settings, ports)["MOPFLOW_TRACKING_URI"] == f"http://127.0.0.1:{ports.mlflow}"
