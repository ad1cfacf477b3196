"""The Airflow that mopflow runs itself (``mopflow run``'s dag.test, ``mopflow up``'s stack): its
environment and its metadata database. One place for both, so the two cannot drift apart."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
# The Airflow pool the training tasks (search, distill) share: at most its slots train at once.
TRAINING_POOL = "mopflow_training"


class AirflowSetupError(RuntimeError):
    """Airflow's metadata database could not be created or upgraded; the message has its output."""


def embedded_airflow_env(airflow_home: str, environ: Mapping[str, str], repo: Path = REPO) -> dict[str, str]:
    """Airflow's settings shared by every Airflow mopflow starts: its home (SQLite metadata there),
    this repository's dags/ (or ``MOPFLOW_DAGS_FOLDER``) and plugins/, no example DAGs."""
    return {
        "AIRFLOW_HOME": airflow_home,
        "AIRFLOW__CORE__DAGS_FOLDER": environ.get("MOPFLOW_DAGS_FOLDER") or str(repo / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(repo / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    }


def migrate_airflow_db(env: Mapping[str, str], bin_dir: str, inherit: bool = True) -> None:
    """``airflow db migrate`` (idempotent: creates or upgrades the metadata tables) with ``env``
    (on top of this process's environment when ``inherit``; the stack passes a whole one), using
    the ``airflow`` of ``bin_dir`` when it has one."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    airflow_bin = Path(bin_dir) / "airflow"
    cmd = [str(airflow_bin) if airflow_bin.exists() else "airflow", "db", "migrate"]
    log.info("airflow: migrating metadata DB in %s", env["AIRFLOW_HOME"])
    proc = subprocess.run(
        cmd,
        env={**(os.environ if inherit else {}), **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AirflowSetupError(f"`airflow db migrate` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
