"""The state file (atomic, refused when foreign) and how a state is printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopflow.infra.stack.config import StackError
from mopflow.infra.stack.state import (
    dask_dashboard_url,
    format_status,
    format_up_summary,
    read_state,
    state_path,
    write_state,
)
from tests.infra.stack.helpers import sample_state


def test_state_file_round_trips_atomically(tmp_path: Path) -> None:
    path = state_path(tmp_path)
    assert read_state(path) is None
    state = sample_state(tmp_path)
    write_state(path, state)
    assert read_state(path) == state
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_a_foreign_state_file_is_refused(tmp_path: Path) -> None:
    path = state_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"services": "nope"}))
    with pytest.raises(StackError, match="is not a mopflow stack state"):
        read_state(path)


def test_up_summary_names_every_url_and_the_password_file(tmp_path: Path) -> None:
    state = sample_state(tmp_path)
    text = format_up_summary(state)
    for rec in state.services:
        if rec.name != "dask-workers":
            assert rec.url in text
    assert "/pw/file" in text and "/auth/token" in text
    assert f"http://127.0.0.1:{state.ports.dask_dashboard}/status" in text


def test_dask_dashboard_url_depends_on_bokeh() -> None:
    assert dask_dashboard_url(8787, has_bokeh=True) == "http://127.0.0.1:8787/status"
    plain = dask_dashboard_url(8787, has_bokeh=False)
    assert plain.startswith("http://127.0.0.1:8787/info/main/workers.html") and "bokeh" in plain


def test_status_table_says_healthy_unhealthy_or_stopped(tmp_path: Path) -> None:
    state = sample_state(tmp_path)
    health = {
        "mlflow": (True, True, ""),
        "airflow": (True, False, "scheduler unhealthy"),
        "serve": (True, True, "m-student v2"),
    }
    lines = format_status(state, health).splitlines()
    row = {line.split()[0]: line for line in lines[2:]}
    assert "healthy" in row["mlflow"].split()
    assert "healthy" in row["serve"].split() and row["serve"].endswith("(m-student v2)")  # what it serves
    assert "unhealthy" in row["airflow"] and "scheduler unhealthy" in row["airflow"]
    assert "stopped" in row["optuna-dashboard"]


def test_up_summary_on_a_reachable_address_names_it_and_the_worker_hosts_file(tmp_path: Path) -> None:
    loopback = format_up_summary(sample_state(tmp_path))
    assert "mopflow stack is up (127.0.0.1 only)\n====================================\n" in loopback
    assert "worker-env" not in loopback
    state = sample_state(tmp_path).model_copy(update={"host": "10.0.0.5", "worker_env_file": "/h/worker.env"})
    text = format_up_summary(state)
    assert "mopflow stack is up on 10.0.0.5\n" in text and "127.0.0.1 only" not in text
    assert f"tcp://10.0.0.5:{state.ports.dask_scheduler}" in text
    assert "Celery worker hosts   : the settings in /h/worker.env (mopflow worker-env)" in text
    assert dask_dashboard_url(8787, True, "fd00::2") == "http://[fd00::2]:8787/status"
    # A state file written before the stack had an address is read as loopback.
    legacy = json.loads(sample_state(tmp_path).model_dump_json())
    del legacy["host"], legacy["worker_env_file"]
    state_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    state_path(tmp_path).write_text(json.dumps(legacy))
    assert read_state(state_path(tmp_path)) == sample_state(tmp_path)
