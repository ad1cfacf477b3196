"""The settings of an Airflow worker on another host: what ``mopflow up`` writes to
``<home>/stack/worker.env`` on an address other hosts reach (and only there), private, read back
whole, with what cannot work from another host said."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import psutil
import pytest

from mopflow.infra.cli.parser import main
from mopflow.infra.stack import lifecycle
from mopflow.infra.stack.auth import AIRFLOW_SECRETS
from mopflow.infra.stack.config import StackError
from mopflow.infra.stack.services import ServiceSpec
from mopflow.infra.stack.specs import build_specs
from mopflow.infra.stack.state import StackState
from mopflow.infra.stack.worker_env import read_worker_env, worker_env, worker_env_path, write_worker_env
from tests.infra.stack.helpers import BIN, settings_at, stack_config

SHARED = {
    "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg2://postgres@10.0.0.5:5432/mopflow_airflow",
    "AIRFLOW__CELERY__BROKER_URL": "redis://10.0.0.5:6379/0",
    "AIRFLOW__OPERATORS__DEFAULT_QUEUE": "gpu",
    "MOPFLOW_OPTUNA_STORAGE": "postgresql+psycopg2://postgres@10.0.0.5:5432/mopflow_optuna",
    "MOPFLOW_DATA_ROOT": "s3://mopflow/data",
    "MOPFLOW_ARTIFACT_ROOT": "s3://mopflow/artifacts",
    "MOPFLOW_STORAGE_OPTIONS": '{"client_kwargs": {"endpoint_url": "http://10.0.0.5:9000"}}',
    "MOPFLOW_RETRAIN_CONFIG": "s3://mopflow/retrain.yaml",
    # the profile's Dask timeouts: a task's Dask client on the worker host lets a silent host go as soon
    "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "15s",
    "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "30s",
}
SECRETS = {
    "AIRFLOW__CORE__FERNET_KEY": "f" * 44,
    "AIRFLOW__API__SECRET_KEY": "s",
    "AIRFLOW__API_AUTH__JWT_SECRET": "j",
}


def _airflow_env(home: Path, environ: dict[str, str]) -> dict[str, str]:
    """The stack's Airflow environment on 10.0.0.5 with ``environ``'s settings."""
    settings = settings_at(home, **{k: v for k, v in environ.items() if k.startswith("MOPFLOW_")})
    config = stack_config(host="10.0.0.5")
    specs = build_specs(settings, config, BIN, {"PATH": "/usr/bin", **environ}, airflow_secrets=SECRETS)
    return next(s for s in specs if s.name == "airflow").env


def test_a_worker_host_gets_what_joins_it_to_the_stack_and_not_the_hosts_own(tmp_path: Path) -> None:
    airflow = _airflow_env(tmp_path / "home", SHARED)
    env = worker_env(airflow)
    api = airflow["AIRFLOW__API__BASE_URL"]
    assert api.startswith("http://10.0.0.5:")
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == f"{api}/execution/"
    assert env["AIRFLOW__API__BASE_URL"] == api
    assert {k: env[k] for k in SECRETS} == SECRETS
    for var in (*SHARED, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT", "AIRFLOW__CORE__DAGS_FOLDER"):
        assert env[var] == airflow[var], var
    assert env["MOPFLOW_TRACKING_URI"] == airflow["MOPFLOW_TRACKING_URI"]
    assert env["MOPFLOW_TRACKING_URI"].startswith("http://10.0.0.5:")
    assert env["MOPFLOW_DASK_ADDRESS"].startswith("tcp://10.0.0.5:")
    for own in ("MOPFLOW_HOME", "MOPFLOW_AIRFLOW_HOME", "AIRFLOW_HOME", "PATH", "AIRFLOW__API__HOST"):
        assert own not in env, own  # each host's own, or the api-server's alone
    assert next(iter(env)) == "AIRFLOW__CORE__EXECUTOR"  # the first line says which executor
    # Under the LocalExecutor, said as such: no Celery worker takes tasks.
    assert worker_env({}) == {"AIRFLOW__CORE__EXECUTOR": "LocalExecutor"}


def test_the_file_is_private_read_back_whole_and_sourced_by_a_shell(tmp_path: Path) -> None:
    home = tmp_path / "home"
    airflow = _airflow_env(home, SHARED)
    path, warnings = write_worker_env(home, airflow)
    assert path == worker_env_path(home) and warnings == []
    assert os.stat(path).st_mode & 0o777 == 0o600  # it holds the shared secrets
    text, env = read_worker_env(home)
    assert text == path.read_text() and env == worker_env(airflow)
    # A POSIX shell that sources it sees every value as written (JSON with spaces and quotes too).
    script = f"set -a; . {shlex.quote(str(path))}; set +a; exec {shlex.quote(BIN)}/python -c " + shlex.quote(
        "import json, os; print(json.dumps(dict(os.environ)))"
    )
    sourced = json.loads(
        subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    )
    assert {k: sourced[k] for k in env} == env


def test_what_cannot_work_from_another_host_is_said_in_the_file(tmp_path: Path) -> None:
    """The scale-out profile's loopback defaults: every worker host would connect to itself."""
    loopback = {
        **SHARED,
        "AIRFLOW__CELERY__BROKER_URL": "redis://127.0.0.1:6379/0",
        "MOPFLOW_STORAGE_OPTIONS": '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}',
        "MOPFLOW_DATA_ROOT": str(tmp_path / "data"),
        "MOPFLOW_OPTUNA_STORAGE": str(tmp_path / "journal.log"),
    }
    path, warnings = write_worker_env(tmp_path / "home", _airflow_env(tmp_path / "home", loopback))
    assert len(warnings) == 4
    text = path.read_text()
    assert (
        "# warning: AIRFLOW__CELERY__BROKER_URL='redis://127.0.0.1:6379/0' is on the stack host's loopback"
        in text
    )
    assert "endpoint 'http://127.0.0.1:9000', on loopback" in text
    assert f"MOPFLOW_DATA_ROOT='{tmp_path / 'data'}' is on the stack's host only" in text
    assert "MOPFLOW_OPTUNA_STORAGE=" in text and "is a journal file on the stack's host" in text


def test_without_a_file_the_command_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MOPFLOW_HOME", str(tmp_path / "home"))
    with pytest.raises(StackError, match=r"no worker settings in .*worker.env.*MOPFLOW_STACK_HOST"):
        read_worker_env(tmp_path / "home")
    assert main(["worker-env"]) == 2
    assert "mopflow up --host ADDR" in capsys.readouterr().err
    write_worker_env(tmp_path / "home", _airflow_env(tmp_path / "home", SHARED))
    assert main(["worker-env", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == read_worker_env(tmp_path / "home")[1]
    assert main(["worker-env"]) == 0
    assert capsys.readouterr().out == worker_env_path(tmp_path / "home").read_text()


def _local_address() -> str | None:
    """An IPv4 address of this host that is not loopback (the stack can bind it), if any."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family.name == "AF_INET" and not address.address.startswith("127."):
                return str(address.address)
    return None


def test_up_on_a_reachable_address_shares_its_secrets_and_writes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``up`` on this host's own address: the Airflow components get the shared secrets, the same
    on a second start, and the worker hosts' file."""
    address = _local_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    started: list[dict[str, ServiceSpec]] = []

    def record(specs: list[ServiceSpec], state: StackState, *rest: object) -> StackState:
        started.append({s.name: s for s in specs})  # nothing is started: what would be is recorded
        return state

    monkeypatch.setattr(lifecycle, "_start", record)
    home = tmp_path / "home"
    has = lambda name, _: name != "bokeh"  # noqa: E731
    for _ in range(2):
        state = lifecycle.up(settings_at(home), stack_config(host=address), {}, lambda _: None, BIN, has)
        assert state.host == address and state.worker_env_file == str(worker_env_path(home))
    first, second = (specs["airflow"].env for specs in started)
    assert {k: first[k] for k in AIRFLOW_SECRETS} == {k: second[k] for k in AIRFLOW_SECRETS}
    assert read_worker_env(home)[1]["AIRFLOW__API__SECRET_KEY"] == second["AIRFLOW__API__SECRET_KEY"]
    # Back on loopback: no worker hosts' file, but the secrets made stay in force.
    state = lifecycle.up(settings_at(home), stack_config(), {}, lambda _: None, BIN, has)
    assert state.worker_env_file == "" and not worker_env_path(home).exists()
    assert {k: started[-1]["airflow"].env[k] for k in AIRFLOW_SECRETS} == {
        k: first[k] for k in AIRFLOW_SECRETS
    }
    # A stack that never left loopback gets none: its components read Airflow's own airflow.cfg.
    fresh = tmp_path / "fresh"
    lifecycle.up(settings_at(fresh), stack_config(), {}, lambda _: None, BIN, has)
    assert not any(var in started[-1]["airflow"].env for var in AIRFLOW_SECRETS)
