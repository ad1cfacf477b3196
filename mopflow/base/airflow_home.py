"""The Airflow that mopflow runs itself (``mopflow run``'s dag.test, ``mopflow up``'s stack): its
environment and its metadata database. One place for both, so the two cannot drift apart."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

# The installed package (site-packages/mopflow, or the checkout through its mopflow/ links): the
# DAG files ship in it as mopflow/dags.
PACKAGED_DAGS = Path(__file__).resolve().parents[1] / "dags"


class AirflowSetupError(RuntimeError):
    """Airflow's metadata database could not be created or upgraded; the message has its output."""


def dags_folder(environ: Mapping[str, str]) -> Path:
    """The DAGs folder of the Airflow mopflow runs: ``MOPFLOW_DAGS_FOLDER``, else the packaged DAGs."""
    return Path(environ.get("MOPFLOW_DAGS_FOLDER") or PACKAGED_DAGS)


def embedded_airflow_env(airflow_home: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Airflow's settings shared by every Airflow mopflow starts: its home (SQLite metadata there),
    the DAGs folder (:func:`dags_folder`), its home's own plugins folder (mopflow's plugin loads
    through its entry point), no example DAGs."""
    return {
        "AIRFLOW_HOME": airflow_home,
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder(environ)),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(Path(airflow_home) / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    }


def migrate_airflow_db(env: Mapping[str, str], bin_dir: str, inherit: bool = True) -> None:
    """``airflow db migrate`` (idempotent: creates or upgrades the metadata tables) with ``env``
    (on top of this process's environment when ``inherit``; the stack passes a whole one), using
    the ``airflow`` of ``bin_dir`` when it has one."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    airflow_bin = Path(bin_dir) / "airflow"
    # Without the venv's script (a bare environment), the Airflow this interpreter imports.
    cmd = [str(airflow_bin)] if airflow_bin.exists() else [sys.executable, "-m", "airflow"]
    cmd += ["db", "migrate"]
    log.info("airflow: migrating metadata DB in %s", env["AIRFLOW_HOME"])
    proc = subprocess.run(
        cmd,
        env={**(os.environ if inherit else {}), **env},
        cwd=env["AIRFLOW_HOME"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AirflowSetupError(f"`airflow db migrate` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
