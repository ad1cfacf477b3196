"""Airflow's executors in the scale-out profile, for real: ``mopflow up`` with
``MOPFLOW_PROFILE=scale-out`` (and no other change than this test's ports, database names and S3
endpoint) starts Airflow with its metadata on PostgreSQL and the LocalExecutor, an MLflow server
on PostgreSQL + S3, Optuna on PostgreSQL and a Dask scheduler and workers; two mopflow_sweep runs
triggered over the REST API run their tasks at the same time. With
``AIRFLOW__CORE__EXECUTOR=CeleryExecutor`` the same ``mopflow up`` runs the Airflow components
separately with a Celery worker on Redis: a sweep through Celery workers, each task's Celery
result checked, runs in ``test_across_hosts.py``.

The fast tests check the wiring ``mopflow up`` derives from the profile without starting anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from mopflow.base.settings import Settings
from mopflow.infra import stack
from mopflow.infra.stack.profile import apply_profile, read_profile
from tests.conftest import PG, pg_admin_sql, require_service
from tests.rest import request_json
from tests.scale_out_env import child_env, start_s3

REPO = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)
DAG_ID = "mopflow_sweep"


def _counter(start: int = 21000) -> Any:
    numbers = itertools.count(start)
    return lambda: next(numbers)


def _scale_out(home: Path, **extra: str) -> dict[str, str]:
    env = {"MOPFLOW_HOME": str(home), "MOPFLOW_PROFILE": "scale-out", **extra}
    apply_profile(env)
    return env


def _specs(env: dict[str, str]) -> dict[str, stack.ServiceSpec]:
    config = stack.config_from_env(env, {}, True, 2, _counter())
    specs = stack.build_specs(Settings.from_env(env), config, BIN, env)
    return {s.name: s for s in specs}


# ---------------------------------------------------------------------------- wiring (fast)


def test_up_in_the_scale_out_profile_serves_its_loopback_servers(tmp_path: Path) -> None:
    """The profile names a tracking server and a Dask scheduler on 127.0.0.1: `mopflow up` serves
    them itself, MLflow on the profile's backend store and S3 destination, Airflow on PostgreSQL."""
    profile = read_profile("scale-out")
    env = _scale_out(tmp_path, AWS_ACCESS_KEY_ID="k")
    specs = _specs(env)
    assert list(specs) == list(stack.SERVICE_ORDER)
    mlflow = specs["mlflow"]
    assert (
        mlflow.argv[mlflow.argv.index("--backend-store-uri") + 1] == profile["MOPFLOW_MLFLOW_BACKEND_STORE"]
    )
    assert (
        mlflow.argv[mlflow.argv.index("--artifacts-destination") + 1]
        == profile["MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION"]
    )
    # The server reaches S3 through MLflow's endpoint variable and the AWS credentials.
    assert mlflow.env["MLFLOW_S3_ENDPOINT_URL"] == profile["MLFLOW_S3_ENDPOINT_URL"]
    assert mlflow.env["AWS_ACCESS_KEY_ID"] == "k"
    airflow = specs["airflow"]
    assert airflow.argv[1:] == ("standalone",)
    assert (
        airflow.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == profile["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    )
    # the LocalExecutor the profile names, its task processes forked with the training stack imported
    assert airflow.env["AIRFLOW__CORE__EXECUTOR"] == "mopflow.plugins.warm_executor.WarmLocalExecutor"
    assert int(airflow.env["AIRFLOW__CORE__PARALLELISM"]) >= 2
    # Tasks talk to the stack's own servers (free ports here), on the profile's storage.
    mlflow_port = int(mlflow.argv[mlflow.argv.index("--port") + 1])
    assert airflow.env["MOPFLOW_TRACKING_URI"] == f"http://127.0.0.1:{mlflow_port}"
    assert airflow.env["MOPFLOW_DASK_ADDRESS"] in specs["dask-workers"].argv
    assert airflow.env["MOPFLOW_OPTUNA_STORAGE"] == profile["MOPFLOW_OPTUNA_STORAGE"]
    assert airflow.env["MOPFLOW_DATA_ROOT"] == profile["MOPFLOW_DATA_ROOT"]
    assert specs["optuna-dashboard"].argv[1] == profile["MOPFLOW_OPTUNA_STORAGE"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"MOPFLOW_TRACKING_URI": "http://10.0.0.5:5000"},
            "MOPFLOW_TRACKING_URI='http://10.0.0.5:5000'.*another host",
        ),
        ({"MOPFLOW_DASK_ADDRESS": "tcp://10.0.0.5:8786"}, "MOPFLOW_DASK_ADDRESS='tcp://10.0.0.5:8786'"),
        ({"MOPFLOW_MLFLOW_BACKEND_STORE": "http://127.0.0.1:5001"}, "must be a database URI"),
        (
            {"AIRFLOW__CORE__EXECUTOR": "KubernetesExecutor"},
            "'KubernetesExecutor'.*LocalExecutor or the CeleryExecutor",
        ),
        (
            {"AIRFLOW__CORE__EXECUTOR": "CeleryExecutor", "AIRFLOW__CELERY__BROKER_URL": ""},
            "needs a broker: set AIRFLOW__CELERY__BROKER_URL",
        ),
        (
            {
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "sqlite:////x.db",
            },
            "CeleryExecutor needs Airflow's metadata on a database server.*sqlite:////x.db",
        ),
    ],
)
def test_servers_elsewhere_and_unsupported_executors_are_refused(
    tmp_path: Path, extra: dict[str, str], needle: str
) -> None:
    with pytest.raises(stack.StackError, match=needle):
        _specs(_scale_out(tmp_path, **extra))


def test_celery_executor_runs_each_component_and_a_worker(tmp_path: Path) -> None:
    env = _scale_out(tmp_path, AIRFLOW__CORE__EXECUTOR="CeleryExecutor")
    specs = _specs(env)
    assert list(specs) == [*stack.SERVICE_ORDER, *stack.CELERY_SERVICES]
    argv = {name: spec.argv[1:] for name, spec in specs.items() if name.startswith("airflow")}
    airflow_port = specs["airflow"].ports[0]
    assert argv == {
        "airflow": ("api-server",),
        "airflow-scheduler": ("scheduler",),
        "airflow-dag-processor": ("dag-processor",),
        "airflow-triggerer": ("triggerer",),
        "airflow-celery-worker": ("celery", "worker", "--celery-hostname", f"mopflow-{airflow_port}@%h"),
    }
    worker = specs["airflow-celery-worker"].env
    assert worker["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert worker["AIRFLOW__CELERY__BROKER_URL"] == "redis://127.0.0.1:6379/0"
    assert worker["AIRFLOW__CELERY__WORKER_CONCURRENCY"] == "4"
    assert worker == specs["airflow-scheduler"].env == specs["airflow"].env  # one Airflow config
    # Every port is some service's, none twice (the log servers: the worker's and the triggerer's).
    ports = [p for spec in specs.values() for p in spec.ports]
    assert len(ports) == len(set(ports))
    assert specs["airflow-celery-worker"].ports == (int(worker["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"]),)


# ---------------------------------------------------------------------------- the real stack (slow)


_admin_sql = pg_admin_sql


class ScaleOutStack:
    """A `mopflow up` in the scale-out profile on fresh PostgreSQL databases and a moto S3 server."""

    def __init__(self, root: Path, overrides: dict[str, str]) -> None:
        self.root, self.home = root, root / "home"
        self.env = child_env() | overrides
        self.airflow = self.token = self.airflow_db = ""

    def mopflow(self, *args: str, timeout: int = 420) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mopflow.infra.cli", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def connect(self) -> None:
        state = stack.read_state(stack.state_path(self.home))
        assert state is not None
        self.state = state
        self.airflow = next(s.url for s in state.services if s.name == "airflow")
        password = json.loads(Path(state.airflow_password_file).read_text())["admin"]
        status, answer = request_json(
            "POST", f"{self.airflow}/auth/token", {"username": "admin", "password": password}
        )
        assert status == 201, answer
        self.token = answer["access_token"]

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return request_json(method, f"{self.airflow}/api/v2{path}", body, self.token)

    def trigger(self, conf: dict[str, Any]) -> str:
        deadline = time.monotonic() + 120
        while (found := self.api("GET", f"/dags/{DAG_ID}"))[0] != 200:  # parsed at start
            assert time.monotonic() < deadline, f"{DAG_ID} never appeared: {found}"
            time.sleep(2)
        assert self.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
        status, run = self.api("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
        assert status == 200, run
        return str(run["dag_run_id"])

    def wait(self, run_ids: list[str], timeout: float) -> dict[str, list[dict[str, Any]]]:
        """Wait until every run is finished; their task instances, run id -> list."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            for run_id in run_ids:
                status, run = self.api("GET", f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}")
                assert status == 200, run
                states[run_id] = run["state"]
            if all(s in ("success", "failed") for s in states.values()):
                break
            assert time.monotonic() < deadline, f"runs still {states} after {timeout:.0f} s"
            time.sleep(3)
        tis = {}
        for run_id in run_ids:
            status, answer = self.api(
                "GET", f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances"
            )
            assert status == 200, answer
            tis[run_id] = list(answer["task_instances"])
        failed = {r: {t["task_id"]: t["state"] for t in tis[r]} for r, s in states.items() if s != "success"}
        assert not failed, f"{failed}\n{self.failed_logs()}"
        return tis

    def wait_task(self, run_id: str, task_id: str, timeout: float) -> None:
        """Wait until a task instance of a run has succeeded."""
        path = f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/{task_id}"
        deadline = time.monotonic() + timeout
        while (found := self.api("GET", path))[1].get("state") != "success":
            assert found[1].get("state") not in ("failed", "upstream_failed"), (
                f"{found}\n{self.failed_logs()}"
            )
            assert time.monotonic() < deadline, (
                f"{task_id} of {run_id} not done after {timeout:.0f} s: {found}"
            )
            time.sleep(2)

    def failed_logs(self) -> str:
        """The ends of the failed task instances' logs, and of the Airflow service's log."""
        logs = [
            p
            for p in sorted((self.home / "airflow" / "logs").rglob("attempt=*.log"))
            if "failed" in p.read_text(errors="replace")[-4000:].lower()
        ]
        logs += sorted((self.home / "stack" / "logs").glob("airflow*.log"))
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}" for p in logs[-4:])


@contextlib.contextmanager
def scale_out_stack(root: Path, **extra: str) -> Iterator[ScaleOutStack]:
    """Fresh databases, an S3 server with the bucket, `mopflow up` in the scale-out profile; all
    undone at the end (`mopflow down`, the S3 server stopped, the databases dropped)."""
    require_service("PostgreSQL", *PG)

    suffix = uuid.uuid4().hex[:8]
    dbs = {part: f"mopflow_ex_{part}_{suffix}" for part in ("airflow", "mlflow", "optuna")}
    pg = f"postgresql+psycopg2://postgres@{PG[0]}:{PG[1]}"
    with contextlib.ExitStack() as cleanup:
        for db in dbs.values():
            _admin_sql(f"CREATE DATABASE {db}")
            cleanup.callback(_admin_sql, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        endpoint = start_s3("127.0.0.1", cleanup)
        # What differs from infra/profiles/scale-out.env: this test's ports, databases and S3 endpoint.
        s = ScaleOutStack(
            root,
            {
                "MOPFLOW_PROFILE": "scale-out",
                "MOPFLOW_HOME": str(root / "home"),
                "MOPFLOW_STACK_FREE_PORTS": "1",
                "MOPFLOW_STACK_GRACE_S": "15",
                "MOPFLOW_RETRY_DELAY_S": "1",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{pg}/{dbs['airflow']}",
                "MOPFLOW_MLFLOW_BACKEND_STORE": f"{pg}/{dbs['mlflow']}",
                "MOPFLOW_OPTUNA_STORAGE": f"{pg}/{dbs['optuna']}",
                "MOPFLOW_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}}),
                "MLFLOW_S3_ENDPOINT_URL": endpoint,
                **extra,
            },
        )
        s.airflow_db = f"{pg}/{dbs['airflow']}"
        try:
            up = s.mopflow("up")
            assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
            s.connect()
            yield s
        finally:
            down = s.mopflow("down", timeout=180)
            assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]


# Two trials of one epoch on 1000 samples; distinct data seeds and model names per run.
TINY = {
    "num_samples": 1000,
    "n_shards": 2,
    "n_trials": 2,
    "epochs": 1,
    "min_resource": 1,
    "top_k": 2,
    "distill_epochs": 1,
    "munge_multiplier": 0,
    "max_gap_to_ensemble": 100,
}


def _overlapping(tis: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of task instances (run/task) whose [start, end] intervals intersect."""
    spans = [
        (
            f"{t['dag_run_id']}/{t['task_id']}",
            datetime.fromisoformat(t["start_date"]),
            datetime.fromisoformat(t["end_date"]),
        )
        for t in tis
    ]
    return [(a, b) for (a, sa, ea), (b, sb, eb) in itertools.combinations(spans, 2) if sa < eb and sb < ea]


@pytest.mark.slow
@pytest.mark.services
def test_local_executor_on_postgresql_runs_two_sweeps_in_parallel(tmp_path: Path) -> None:
    import sqlalchemy

    with scale_out_stack(tmp_path, MOPFLOW_TRAINING_POOL_SLOTS="2") as s:
        # The second run starts once the first one's shard task has published its Asset event:
        # Airflow 3.3.2 links an AssetAlias to its Asset on the first event without a lock, and
        # two first events at once fail one task (UniqueViolation on asset_alias_asset_pkey, the
        # task set to failed without retries). The first run's search then overlaps the second
        # run's first tasks, and the two searches (two pool slots) overlap each other.
        runs = [s.trigger(TINY | {"model_name": "par1", "data_seed": 1})]
        s.wait_task(runs[0], "shard", timeout=240)
        runs.append(s.trigger(TINY | {"model_name": "par2", "data_seed": 2}))
        tis = s.wait(runs, timeout=900)  # the behaviour is the overlap; a loaded machine is slow
        every = [t for run in runs for t in tis[run]]
        for t in sorted(every, key=lambda t: t["start_date"]):
            print(t["start_date"], t["end_date"], t["dag_run_id"], t["task_id"], t["duration"])
        assert {t["state"] for t in every} == {"success"}
        overlaps = _overlapping(every)
        assert overlaps, [(t["dag_run_id"], t["task_id"], t["start_date"], t["end_date"]) for t in every]
        # The tasks of one run still follow its graph: only tasks of different runs overlap.
        assert all(a.split("/")[0] != b.split("/")[0] for a, b in overlaps)
        # From Airflow's metadata on PostgreSQL: both runs succeeded; one scheduler ran the
        # overlapping task instances, each in a process of its own.
        engine = sqlalchemy.create_engine(s.airflow_db)
        try:
            with engine.connect() as conn:
                states = conn.execute(
                    sqlalchemy.text("SELECT run_id, state FROM dag_run WHERE dag_id = :d"), {"d": DAG_ID}
                ).all()
                rows = conn.execute(
                    sqlalchemy.text(
                        "SELECT run_id, task_id, pid, queued_by_job_id FROM task_instance WHERE dag_id = :d"
                    ),
                    {"d": DAG_ID},
                ).all()
        finally:
            engine.dispose()
        assert sorted(states) == sorted((r, "success") for r in runs)
        by_key = {f"{r.run_id}/{r.task_id}": r for r in rows}
        a, b = (by_key[key] for key in overlaps[0])
        assert a.pid and b.pid and a.pid != b.pid
        assert a.queued_by_job_id == b.queued_by_job_id is not None
