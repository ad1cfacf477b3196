"""The example DAG (examples/airflow_dag): a user's preprocessing task before mopflow's tasks.

It loads in a DagBag with mopflow's tasks after the user's own, and ``airflow dags test`` runs it
end to end as its docstring tells a user to: the pipeline trains on the table the user's task
wrote, and the student is registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.dags.test_end_to_end import REPO, _env

EXAMPLE = REPO / "examples" / "airflow_dag"
DAG_ID = "example_mopflow_after_my_preprocessing"
TINY = {
    "n_trials": 2,
    "epochs": 1,
    "min_resource": 1,
    "top_k": 2,
    "distill_epochs": 1,
    "model_name": "parts",
    "max_gap_to_ensemble": 100,  # tiny models are far from their ensemble; the gate is tested elsewhere
}


def test_the_example_loads_with_mopflows_tasks_after_the_users_own(tmp_path: Path) -> None:
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path / "airflow"))
    from airflow.dag_processing.dagbag import DagBag

    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    bag = DagBag(dag_folder=str(EXAMPLE))
    assert bag.import_errors == {}
    dag = bag.dags[DAG_ID]
    assert dag.get_task("start").upstream_task_ids == {"prepare"}
    order = ["prepare", "start", "shard", "search", "ensemble", "distill", "register"]
    for upstream, downstream in zip(order, order[1:], strict=False):
        assert downstream in dag.get_task(upstream).downstream_task_ids
    assert dag.params["n_trials"] == 8 and "dataset" in dag.params  # mopflow's config keys as Params


def _airflow(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``airflow`` command as a user of the example runs it, Airflow's home in ``home``."""
    from mopflow.base.settings import Settings
    from mopflow.infra.stack.environment import airflow_env

    env = _env(home)
    settings = Settings.from_env(env)
    env |= airflow_env(settings.airflow_home, env, str(Path(sys.executable).parent))
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(EXAMPLE)
    return subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_airflow_dags_test_runs_the_example_on_the_users_table(tmp_path: Path) -> None:
    home = tmp_path / "home"
    migrated = _airflow(home, "db", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    run = _airflow(home, "dags", "test", DAG_ID, "-c", json.dumps(TINY))
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "state=success" in output, output[-4000:]

    (summary_file,) = (home / "artifacts" / "runs").glob("*/summary.json")
    summary: dict[str, Any] = json.loads(summary_file.read_text())
    (manifest_file,) = (home / "data" / "datasets").glob("*/manifest.json")
    manifest = json.loads(manifest_file.read_text())
    assert manifest["manifest_hash"] == summary["manifest_hash"]
    # the shards are of the table the user's task wrote, its label column set by the same task
    assert manifest["dataset"] == str(home.resolve() / "data" / "prepared" / "parts.parquet")
    assert manifest["label_column"] == "label" and manifest["num_classes"] == 3
    assert summary["registered"]["version"] == "1" and "champion" in summary["registered"]["aliases"]
