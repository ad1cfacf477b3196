"""Airflow's Celery workers on other hosts than the stack (test hosts: ``tests/hosts.py``).

``control`` runs ``mopflow up`` in the scale-out profile with the CeleryExecutor on its own
address (``MOPFLOW_STACK_HOST``); its own Celery worker is stopped, so every task must run on
``w1`` or ``w2``, where ``airflow celery worker`` runs with the settings ``mopflow worker-env``
prints: the shared secrets, the Execution API's address, the broker, the databases. A sweep runs
through to success, and a task's log, kept on the worker host, is read through the stack's REST
API (the api-server fetches it from that host, signed with the shared secret key).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PG, pg_admin_sql, require_service, skip_unless_required
from tests.hosts import HostCluster, namespaces_problem
from tests.rest import request_json
from tests.scale_out_env import BIN, child_env, s3_client, start_s3

pytestmark = [pytest.mark.slow, pytest.mark.services]

REDIS_PORT = 6379
DAG_ID = "mopflow_sweep"
CELERY_HOSTS = ("w1", "w2")
CELERY_READY = " ready."  # the line a Celery worker logs once it takes tasks ("celery@w1 ready.")
TINY = {
    "num_samples": 600,
    "n_shards": 2,
    "n_trials": 2,
    "epochs": 1,
    "min_resource": 1,
    "top_k": 1,
    "distill_epochs": 1,
    "munge_multiplier": 0,
    "max_gap_to_ensemble": 100,
    "model_name": "celery-hosts",
}


class Stack:
    """`mopflow up` on the control host and its REST API, seen from this machine."""

    def __init__(self, hosts: HostCluster, env: dict[str, str], optuna_url: str = "") -> None:
        self.hosts, self.env, self.control = hosts, env, hosts["control"]
        self.optuna_url = optuna_url  # the study's storage, as this machine reaches it
        self.s3_endpoint = ""  # the S3 server, as this machine reaches it
        self.home = hosts.private_home  # the control host's own MOPFLOW_HOME
        self.token = ""
        self.worker_env: dict[str, str] = {}  # a Celery worker host's environment (worker-env's settings)
        self.logs = Path()  # where this machine keeps the Celery workers' output
        self.airflow = f"http://{self.control.address}:8080"
        self.airflow_db = ""  # Airflow's metadata database, as this machine reaches it

    def mopflow(self, *args: str, timeout: float = 600) -> Any:
        return self.control.run(
            [sys.executable, "-m", "mopflow.infra.cli", *args], self.hosts.env(self.env), timeout=timeout
        )

    def read(self, path: Path | str) -> str:
        """A file on the control host's own disk."""
        done = self.control.run(["cat", str(path)], {})
        assert done.returncode == 0, done.stderr
        return str(done.stdout)

    def connect(self) -> dict[str, Any]:
        state = json.loads(self.read(self.home / "stack" / "state.json"))
        password = json.loads(self.read(state["airflow_password_file"]))["admin"]
        status, answer = request_json(
            "POST", f"{self.airflow}/auth/token", {"username": "admin", "password": password}
        )
        assert status == 201, answer
        self.token = answer["access_token"]
        return dict(state)

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return request_json(method, f"{self.airflow}/api/v2{path}", body, self.token)

    def ensure_celery_workers(self) -> None:
        """Start ``airflow celery worker`` on each worker host where none runs (its host was
        killed, or it was never started), with the settings ``mopflow worker-env`` printed, and
        wait until each started one is ready."""
        started = []
        for name in CELERY_HOSTS:
            host = self.hosts[name]
            if all(proc.poll() is not None for proc in host.procs):
                log = self.logs / f"celery-{name}.log"
                ready = log.read_text().count(CELERY_READY) if log.exists() else 0
                host.start(
                    [str(BIN / "airflow"), "celery", "worker", "--concurrency", "2"],
                    self.hosts.env(self.worker_env)
                    | {"AIRFLOW_HOME": str(self.hosts.private_home / "airflow")},
                    log,
                )
                started.append((log, ready))
        deadline = time.monotonic() + 120
        for log, ready in started:
            while log.read_text().count(CELERY_READY) <= ready:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)


@pytest.fixture(scope="module")
def stack_and_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_service("PostgreSQL", *PG)
    require_service("Redis", "127.0.0.1", REDIS_PORT)
    if problem := namespaces_problem():
        skip_unless_required(problem)
    import redis

    root = tmp_path_factory.mktemp("airflow-hosts")
    suffix = uuid.uuid4().hex[:8]
    dbs = {part: f"mopflow_ah_{part}_{suffix}" for part in ("airflow", "mlflow", "optuna")}
    queue = f"mopflow_hosts_{suffix}"  # a queue of this test's own on the shared Redis
    with contextlib.ExitStack() as cleanup:
        hosts = HostCluster(["control", *CELERY_HOSTS], root)
        cleanup.callback(hosts.close)
        for db in dbs.values():
            pg_admin_sql(f"CREATE DATABASE {db}")
            cleanup.callback(pg_admin_sql, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        gateway, _ = hosts.forward(PG[1])
        hosts.forward(REDIS_PORT)
        broker = redis.Redis(host="127.0.0.1", port=REDIS_PORT, db=0)
        cleanup.callback(broker.close)
        cleanup.callback(broker.delete, queue, f"_kombu.binding.{queue}")
        endpoint = start_s3(gateway, cleanup)
        pg = f"postgresql+psycopg2://postgres@{gateway}:{PG[1]}"
        base = child_env()
        control = hosts["control"]
        env = base | {
            "MOPFLOW_PROFILE": "scale-out",
            "MOPFLOW_STACK_HOST": control.address,
            "MOPFLOW_STACK_GRACE_S": "15",
            "MOPFLOW_RETRY_DELAY_S": "1",
            # the profile's 60 s, shortened: a dead worker host's task is retried sooner
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__OPERATORS__DEFAULT_QUEUE": queue,
            "AIRFLOW__CELERY__BROKER_URL": f"redis://{gateway}:{REDIS_PORT}/0",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{pg}/{dbs['airflow']}",
            "MOPFLOW_MLFLOW_BACKEND_STORE": f"{pg}/{dbs['mlflow']}",
            "MOPFLOW_OPTUNA_STORAGE": f"{pg}/{dbs['optuna']}",
            "MOPFLOW_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}}),
            "MLFLOW_S3_ENDPOINT_URL": endpoint,
        }
        stack = Stack(hosts, env, f"postgresql+psycopg2://postgres@127.0.0.1:{PG[1]}/{dbs['optuna']}")
        stack.airflow_db = f"postgresql+psycopg2://postgres@127.0.0.1:{PG[1]}/{dbs['airflow']}"
        stack.s3_endpoint = endpoint
        up = stack.mopflow("up")
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        cleanup.callback(stack.mopflow, "down", timeout=180)
        state = stack.connect()
        # The stack's own Celery worker goes: every task must now run on another host.
        local_worker = next(s for s in state["services"] if s["name"] == "airflow-celery-worker")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(local_worker["pid"]), signal.SIGTERM)
        worker_env = stack.mopflow("worker-env", "--format", "json")
        assert worker_env.returncode == 0, worker_env.stderr
        shared = json.loads(worker_env.stdout)
        assert not any(
            line.startswith("# warning") for line in stack.mopflow("worker-env").stdout.splitlines()
        )
        stack.worker_env, stack.logs = base | shared, root / "logs"
        stack.ensure_celery_workers()
        yield stack


def _trigger(s: Stack, conf: dict[str, Any]) -> str:
    """Trigger a sweep of ``conf``; the REST path of its DAG run."""
    deadline = time.monotonic() + 180
    while (found := s.api("GET", f"/dags/{DAG_ID}"))[0] != 200:
        assert time.monotonic() < deadline, f"{DAG_ID} never appeared: {found}"
        time.sleep(2)
    assert s.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
    status, run = s.api("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    assert status == 200, run
    return f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(str(run['dag_run_id']), safe='')}"


def _finish(s: Stack, run_path: str, timeout_s: float = 900) -> list[dict[str, Any]]:
    """Wait for the run to end; its task instances, once it succeeded."""
    deadline = time.monotonic() + timeout_s
    while (state := s.api("GET", run_path)[1]["state"]) not in ("success", "failed"):
        assert time.monotonic() < deadline, f"the run is still {state}"
        time.sleep(3)
    status, answer = s.api("GET", f"{run_path}/taskInstances")
    assert status == 200, answer
    tis: list[dict[str, Any]] = answer["task_instances"]
    assert state == "success", {t["task_id"]: (t["state"], t["hostname"], t["try_number"]) for t in tis}
    return tis


def test_celery_workers_on_other_hosts_run_a_sweep_and_serve_its_logs(stack_and_workers: Stack) -> None:
    s = stack_and_workers
    run_path = _trigger(s, TINY)
    tis = _finish(s, run_path)
    assert {t["hostname"] for t in tis} <= set(CELERY_HOSTS), {t["task_id"]: t["hostname"] for t in tis}
    search = next(t for t in tis if t["task_id"] == "search")
    status, log = s.api("GET", f"{run_path}/taskInstances/search/logs/{search['try_number']}")
    assert status == 200, log
    text = json.dumps(log)
    assert "search: study" in text, text[-2000:]  # the stage's own lines, read from the worker host
    _every_task_went_through_celery(s, tis)


def _every_task_went_through_celery(s: Stack, tis: list[dict[str, Any]]) -> None:
    """Each task instance came from this test's queue with a Celery task id, and its Celery task
    ended SUCCESS in the result backend on PostgreSQL (it may report after the task instance)."""
    import sqlalchemy

    assert {t["queue"] for t in tis} == {s.env["AIRFLOW__OPERATORS__DEFAULT_QUEUE"]}
    run_id = tis[0]["dag_run_id"]
    engine = sqlalchemy.create_engine(s.airflow_db)
    try:
        with engine.connect() as conn:
            ids: dict[str, str | None] = dict(
                conn.execute(
                    sqlalchemy.text(
                        "SELECT task_id, external_executor_id FROM task_instance WHERE run_id = :r"
                    ),
                    {"r": run_id},
                ).all()
            )
        assert set(ids) == {t["task_id"] for t in tis} and all(ids.values()), ids
        deadline = time.monotonic() + 60
        while True:
            with engine.connect() as conn:
                results = dict(
                    conn.execute(sqlalchemy.text("SELECT task_id, status FROM celery_taskmeta")).all()
                )
            if all(results.get(str(i)) == "SUCCESS" for i in ids.values()):
                break
            assert time.monotonic() < deadline, (ids, results)
            time.sleep(1)
    finally:
        engine.dispose()


@pytest.mark.parametrize("fault", ["killed", "cut"])
def test_a_celery_worker_host_lost_during_the_search_is_retried_on_the_other_from_its_checkpoints(
    stack_and_workers: Stack, fault: str
) -> None:
    """Fault (b): the host running the search task is lost. ``killed``: every process on it dies.
    ``cut``: its link goes down, its processes live on, and it comes back once the retry runs.
    Airflow notices the missing heartbeats, and the retry, on the other host, takes the study's
    lease and resumes the trials from their checkpoints in S3: every trial COMPLETE, each epoch
    told once, a champion registered. A cut-off try that comes back writes nothing after the
    retry took over: the study and every object in S3 are as the retry left them once it ended."""
    import optuna

    from mopflow.training.search.lease import lease_of
    from mopflow.training.search.study import MODEL_ATTR, STALE_ATTR

    s = stack_and_workers
    s.ensure_celery_workers()  # a host killed by an earlier test is back
    conf = TINY | {"n_trials": 3, "epochs": 4, "pruner": "none", "model_name": f"celery-hosts-{fault}"}
    earlier = set(optuna.get_all_study_names(s.optuna_url))
    run_path = _trigger(s, conf)
    deadline, victim, study = time.monotonic() + 600, "", ""
    while not victim:  # the search task runs, and its first epoch was told to the study
        assert time.monotonic() < deadline, s.api("GET", f"{run_path}/taskInstances/search")
        time.sleep(0.5)
        search = s.api("GET", f"{run_path}/taskInstances/search")[1]
        if search.get("state") != "running":
            continue
        names = [n for n in optuna.get_all_study_names(s.optuna_url) if n not in earlier]
        if names and any(
            t.intermediate_values
            for t in optuna.load_study(study_name=names[-1], storage=s.optuna_url).trials
        ):
            victim, study = search["hostname"], names[-1]
    assert victim in CELERY_HOSTS
    survivor = next(h for h in CELERY_HOSTS if h != victim)
    lost_at = time.monotonic()
    if fault == "killed":
        s.hosts[victim].kill_all()
    else:
        s.hosts[victim].cut()
        try:  # the retry starts on the other host while this one is still cut off
            while (search := s.api("GET", f"{run_path}/taskInstances/search")[1]).get("try_number") != 2 or (
                search.get("state") != "running"
            ):
                assert time.monotonic() < lost_at + 300, search
                time.sleep(1)
            print(
                f"the search's retry runs on {search['hostname']} {time.monotonic() - lost_at:.1f} s after the cut"
            )
        finally:
            s.hosts[victim].mend()
    tis = _finish(s, run_path)
    search = next(t for t in tis if t["task_id"] == "search")
    assert (search["try_number"], search["hostname"]) == (2, survivor), search
    if fault == "killed":  # the cut-off host comes back, and may take later tasks
        assert {t["hostname"] for t in tis if t["task_id"] in ("ensemble", "distill", "register")} == {
            survivor
        }
    trials = optuna.load_study(study_name=study, storage=s.optuna_url).trials
    counted = [t for t in trials if not t.user_attrs.get(STALE_ATTR)]
    assert sorted(t.state.name for t in counted) == ["COMPLETE"] * 3, [
        (t.number, t.state.name) for t in trials
    ]
    assert any(t.user_attrs.get(STALE_ATTR) for t in trials)  # the lost try's trials, failed and retried
    assert any("resumed_from_epoch" in t.user_attrs for t in counted)  # from its checkpoint in S3
    for trial in counted:  # each model's epochs told once, in order, whichever try trained them
        assert sorted(trial.intermediate_values) == list(range(4)), (trial.number, trial.intermediate_values)
    assert len({t.user_attrs[MODEL_ATTR] for t in counted}) == 3
    assert lease_of(optuna.load_study(study_name=study, storage=s.optuna_url))["generation"] == 2
    print(
        f"search retried on {survivor} and the run done {time.monotonic() - lost_at:.1f} s after the host was {fault}"
    )
    if fault == "cut":
        _the_cut_off_try_ends_writing_nothing(s, victim, study)


def _the_cut_off_try_ends_writing_nothing(s: Stack, victim: str, study: str) -> None:
    """Wait for the first try's processes on ``victim`` to end; nothing it could reach (the study,
    the objects in S3) changed meanwhile."""
    before = _written(s, study)
    mended_at = time.monotonic()
    while tasks := [c for c in s.hosts[victim].processes().values() if c.startswith(TASK_PROCESSES)]:
        assert time.monotonic() < mended_at + 300, tasks
        time.sleep(2)
    ended_s = time.monotonic() - mended_at
    assert _written(s, study) == before
    found = (
        s.hosts[victim]
        .run(["grep", "-rhoE", "|".join(ENDINGS), str(s.hosts.private_home / "airflow" / "logs")], {})
        .stdout
    )
    print(
        f"the cut-off try ended {ended_s:.1f} s after the run, writing nothing: {sorted(set(found.split(chr(10))) - {''})}"
    )


# The processes of an Airflow task on a Celery worker: its supervisor and the task itself.
TASK_PROCESSES = ("airflow task supervisor", "airflow worker --")
# How a cut-off try can end: its lease taken (mopflow), or its supervisor told or giving up (Airflow).
ENDINGS = ("Superseded", "shouldn't be running anymore", "Too many failed heartbeats")


def _written(s: Stack, study: str) -> dict[str, Any]:
    """What a sweep can write: the study's trials, and every object in S3 with its ETag and time."""
    import optuna

    trials = optuna.load_study(study_name=study, storage=s.optuna_url).trials
    bucket = s3_client(s.s3_endpoint)
    objects = {
        o["Key"]: (o["ETag"], o["LastModified"])
        for page in bucket.get_paginator("list_objects_v2").paginate(Bucket="mopflow")
        for o in page.get("Contents", [])
    }
    return {
        "trials": [(t.number, t.state.name, t.intermediate_values, t.user_attrs) for t in trials],
        "objects": objects,
    }
