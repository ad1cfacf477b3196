"""The scale-out profile for real: Airflow metadata, MLflow backend and Optuna storage on
PostgreSQL, MLflow artifacts, shards and checkpoints on S3 (an S3-compatible server on
127.0.0.1), an external Dask scheduler and workers as separate processes. The whole retraining
pipeline runs with ``MOPFLOW_PROFILE=scale-out`` and the outcomes match the embedded run's.

Here ``mopflow run`` runs the DAG in-process (``dag.test``); the real Airflow components in this
profile (``mopflow up``: scheduler, dag-processor, api-server, the LocalExecutor running tasks in
parallel, the CeleryExecutor with a Redis broker) are tested in ``test_airflow_executors.py``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1
from mopflow.infra.stack.profile import apply_profile, parse_profile, read_profile
from tests.conftest import PG, pg_admin_sql, require_service
from tests.dags.test_end_to_end import TINY
from tests.scale_out_env import BIN, REPO, child_env, start_s3


def test_scale_out_profile_moves_every_part_and_the_environment_wins() -> None:
    values = read_profile("scale-out")
    assert values["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
    assert values["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert values["MOPFLOW_OPTUNA_STORAGE"].startswith("postgresql")
    assert values["MOPFLOW_TRACKING_URI"].startswith("http://")
    assert values["MOPFLOW_MLFLOW_BACKEND_STORE"].startswith("postgresql")
    assert values["MOPFLOW_DATA_ROOT"].startswith("s3://") and values["MOPFLOW_ARTIFACT_ROOT"].startswith(
        "s3://"
    )
    assert values["MOPFLOW_DASK_ADDRESS"].startswith("tcp://")
    env = {"MOPFLOW_PROFILE": "scale-out", "MOPFLOW_DASK_ADDRESS": "tcp://10.0.0.5:8786"}
    applied = apply_profile(env)
    assert env["MOPFLOW_DASK_ADDRESS"] == "tcp://10.0.0.5:8786" and "MOPFLOW_DASK_ADDRESS" not in applied
    assert env["MOPFLOW_OPTUNA_STORAGE"] == values["MOPFLOW_OPTUNA_STORAGE"]
    assert apply_profile({}) == {}  # no profile: the embedded defaults


def test_bad_profiles_are_refused_with_the_name_or_line() -> None:
    from mopflow.infra.stack.profile import ProfileError

    with pytest.raises(ProfileError, match="unknown profile 'cloud'"):
        apply_profile({"MOPFLOW_PROFILE": "cloud"})
    with pytest.raises(ProfileError, match="p.env:2: expected KEY=VALUE"):
        parse_profile("A=1\nnot a line\n", "p.env")
    with pytest.raises(ProfileError, match="A is set twice"):
        parse_profile("A=1\nA=2\n", "p.env")


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{what} did not answer at {url}")


def _wait_scheduler_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    """The address a Dask scheduler started with ``--scheduler-file`` wrote, once it accepts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the dask scheduler exited with {proc.returncode}")
        try:
            address = str(json.loads(path.read_text())["address"])
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=1):
                return address
        except (OSError, ValueError, KeyError):
            time.sleep(0.3)
    raise AssertionError(f"the dask scheduler wrote no reachable address to {path}")


class Services:
    """Processes started for the test, each in its own session, stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []  # type: list[subprocess.Popen[bytes]]
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def scale_out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Start PostgreSQL databases, S3, an MLflow server and a Dask cluster; run the pipeline once."""
    require_service("PostgreSQL", *PG)

    root = tmp_path_factory.mktemp("scaleout")
    suffix = uuid.uuid4().hex[:8]
    dbs = {part: f"mopflow_so_{part}_{suffix}" for part in ("airflow", "mlflow", "optuna")}

    admin_sql = pg_admin_sql

    cleanup = contextlib.ExitStack()  # undoes whatever was set up, even when setup fails half-way
    try:  # setup: on failure, undo what was made before re-raising
        for db in dbs.values():
            admin_sql(f"CREATE DATABASE {db}")
            cleanup.callback(admin_sql, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        pg = f"postgresql+psycopg2://postgres@{PG[0]}:{PG[1]}"

        endpoint = start_s3("127.0.0.1", cleanup)
        base = child_env()
        mlflow_port = free_port()  # from this worker's range: `mlflow server` cannot report a port 0 bind
        # What differs from the profile's defaults: this test's ports and database names.
        overrides = {
            "MOPFLOW_PROFILE": "scale-out",
            "MOPFLOW_HOME": str(root / "home"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{pg}/{dbs['airflow']}",
            "MOPFLOW_OPTUNA_STORAGE": f"{pg}/{dbs['optuna']}",
            "MOPFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
            "MOPFLOW_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}}),
            "MLFLOW_S3_ENDPOINT_URL": endpoint,
            "MOPFLOW_RETRY_DELAY_S": "1",
        }
        env = base | overrides
        apply_profile(env)  # everything else from infra/profiles/scale-out.env
    except BaseException:
        cleanup.close()
        raise
    services = Services(root / "logs")
    try:
        mlflow = services.start(
            "mlflow",
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                f"{pg}/{dbs['mlflow']}",
                "--artifacts-destination",
                env["MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION"],
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--workers",
                "1",
            ],
            env,
        )
        # the scheduler binds port 0 and reports its address in its scheduler file
        scheduler_file = root / "scheduler.json"
        scheduler = services.start(
            "dask-scheduler",
            [
                str(BIN / "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--scheduler-file",
                str(scheduler_file),
                "--no-dashboard",
            ],
            env,
        )
        address = _wait_scheduler_file(scheduler_file, scheduler)
        overrides["MOPFLOW_DASK_ADDRESS"] = env["MOPFLOW_DASK_ADDRESS"] = address
        for i in range(2):
            services.start(
                f"dask-worker-{i}",
                [
                    str(BIN / "dask"),
                    "worker",
                    env["MOPFLOW_DASK_ADDRESS"],
                    "--nworkers",
                    "1",
                    "--nthreads",
                    "1",
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                    "--name",
                    f"so-{i}",
                ],
                env,
            )
        _wait_http(f"http://127.0.0.1:{mlflow_port}/health", mlflow, "mlflow server")
        config = root / "tiny.json"
        config.write_text(json.dumps(TINY | {"model_name": "scaleout"}))
        summary_file = root / "summary.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mopflow.infra.cli",
                "run",
                "--config",
                str(config),
                "--summary-json",
                str(summary_file),
            ],
            cwd=REPO,
            env=base | overrides,  # the CLI applies the profile itself
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        yield {
            "summary": json.loads(summary_file.read_text()),
            "env": env,
            "dbs": dbs,
            "pg": pg,
            "endpoint": endpoint,
            "stdout": proc.stdout + proc.stderr,
            "dask_workers": {f"so-{i}" for i in range(2)},
        }
    finally:
        services.stop()
        cleanup.close()


@pytest.mark.slow
@pytest.mark.services
def test_pipeline_in_the_scale_out_profile_has_the_embedded_outcomes(scale_out: dict) -> None:
    import optuna
    import s3fs
    import sqlalchemy
    from mlflow import MlflowClient
    from optuna.trial import TrialState

    from mopflow.base.optuna_storage import make_storage

    summary, env = scale_out["summary"], scale_out["env"]
    # Registry: the student is registered and is the champion, as in the embedded run.
    # registry_uri explicitly: an earlier test in this process may have set a global registry URI
    client = MlflowClient(tracking_uri=env["MOPFLOW_TRACKING_URI"], registry_uri=env["MOPFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("scaleout-student", "champion")
    assert champion.version == summary["registered"]["version"]
    assert "champion" in summary["registered"]["aliases"]
    # Lineage: every stage run carries the manifest hash and the Airflow run id.
    experiment = client.get_experiment_by_name("mopflow")
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{summary['run_key']}'")
    stages = {r.data.tags.get("mopflow.stage") for r in runs}
    assert {"pipeline", "shard", "search", "ensemble", "distill", "register", "trial"} <= stages
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        assert run.data.tags["mopflow.airflow_run_id"] == summary["airflow_run_id"]
        if run.data.tags["mopflow.stage"] != "pipeline":
            assert run.data.tags["mopflow.manifest_hash"] == summary["manifest_hash"]
    # Optuna on PostgreSQL: the trial counts match the runs; trials ran on the external workers.
    study = optuna.load_study(
        study_name=summary["optuna"]["study_name"], storage=make_storage(env["MOPFLOW_OPTUNA_STORAGE"])
    )
    finished = [
        t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    ]
    assert (
        len([r for r in runs if r.data.tags["mopflow.stage"] == "trial"]) == len(finished) >= TINY["n_trials"]
    )
    assert summary["optuna"]["storage"].startswith("postgresql")
    # S3 holds the shards, the trial checkpoints and bundles, and the MLflow artifacts.
    fs = s3fs.S3FileSystem(
        key="testing", secret="testing", client_kwargs={"endpoint_url": scale_out["endpoint"]}
    )
    assert fs.glob("mopflow/data/**/manifest.json")
    assert fs.glob("mopflow/artifacts/studies/**/weights.safetensors")
    assert fs.glob("mopflow/mlflow/**/MLmodel")
    # Airflow's metadata went to PostgreSQL: the DAG run is recorded there.
    engine = sqlalchemy.create_engine(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    with engine.connect() as conn:
        states = conn.execute(
            sqlalchemy.text("SELECT state FROM dag_run WHERE dag_id = 'mopflow_retrain' AND run_id = :r"),
            {"r": summary["airflow_run_id"]},
        ).scalars()
        assert list(states) == ["success"]
    engine.dispose()
