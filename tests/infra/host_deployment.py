"""The scale-out profile on a cluster of test hosts (``tests/hosts.py``), built once for
``tests/infra/test_across_hosts.py``:

- ``control``: ``mopflow up`` with the CeleryExecutor on the host's own address
  (``MOPFLOW_STACK_HOST``): Airflow's api-server, scheduler and dag-processor, the MLflow server,
  the Dask scheduler. The stack's own Celery worker and Dask worker are stopped, so that every
  task runs on a Celery host and every unit of training on a Dask host;
- ``celery1``, ``celery2``: ``airflow celery worker`` with the settings ``mopflow worker-env``
  prints (the shared secrets, the Execution API's address, the broker, the databases). Their
  tasks are the coordinators of the pipeline's stages;
- ``dask1``–``dask3``: a Dask worker each, on a second network too (``eth1``, for DDP's ranks);
- PostgreSQL and Redis of this machine, forwarded to the bridge's address; an S3 server (moto)
  bound to it. The coordinators reach S3 by a name only they (and ``control``) resolve; the
  Dask workers by their own ``MOPFLOW_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.conftest import PG, pg_admin_sql, require_service, skip_unless_required
from tests.hosts import HostCluster, namespaces_problem
from tests.rest import request_json
from tests.scale_out_env import BIN, BUCKET, child_env, s3_client, start_s3

REDIS_PORT = 6379
DAG_ID = "mopflow_sweep"
CELERY_HOSTS = ("celery1", "celery2")
DASK_HOSTS = ("dask1", "dask2", "dask3")
LOCAL_FOLDERS = ("data", "artifacts", "optuna", "mlflow")  # under a host's MOPFLOW_HOME
# mopflow_retrain's Param defaults, on S3 (MOPFLOW_RETRAIN_CONFIG): every host that parses the
# DAG files reads them there
RETRAIN_CONFIG = {"model_name": "xh-retrain", "n_trials": 2, "top_k": 1, "epochs": 1}
CELERY_READY = " ready."  # the line a Celery worker logs once it takes tasks ("celery@celery1 ready.")
# The smallest sweep that still ensembles and distils. Each study its own (no warm start): Optuna
# and MLflow then hold the same trials.
SWEEP = {
    "num_samples": 600,
    "n_shards": 2,
    "n_trials": 2,
    "epochs": 1,
    "min_resource": 1,
    "top_k": 1,
    "distill_epochs": 1,
    "munge_multiplier": 0,
    "max_gap_to_ensemble": 100,
    "warm_start": False,
    "warm_start_studies": 0,
}


def wait_for(check: Any, what: str, timeout: float = 120) -> Any:
    """The first value of ``check()`` that is not None (errors count as None), polled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if (value := check()) is not None:
                return value
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout:.0f}s")


class Deployment:
    """The services of the scale-out profile on the test hosts, and sweeps through its REST API."""

    def __init__(self, hosts: HostCluster, root: Path, dbs: dict[str, str]) -> None:
        self.hosts, self.dbs = hosts, dbs
        self.control = hosts["control"]
        self.logs = root / "logs"  # the output of the processes started on the hosts
        self.coordinator_cache = root / "coordinator-shard-cache"  # a disk every host sees
        self.stack_env: dict[str, str] = {}  # `mopflow up`'s environment on the control host
        self.celery_env: dict[str, str] = {}  # a Celery host's: worker-env's settings, its shard cache
        self.dask_env: dict[str, str] = {}  # a Dask host's: worker-env's, its own S3 endpoint
        self.s3_endpoint = ""  # the S3 server, as this machine reaches it
        self.airflow = f"http://{self.control.address}:8080"
        self.token = ""
        self.client: Any = None  # a Dask client in this process (processing), made at its first use

    # -- this machine's view of the profile's stores -------------------------------------------
    def pg_url(self, part: str) -> str:
        """A database of the deployment, as this machine reaches it."""
        return f"postgresql+psycopg2://postgres@127.0.0.1:{PG[1]}/{self.dbs[part]}"

    @property
    def tracking_uri(self) -> str:
        return f"http://{self.control.address}:5000"

    @property
    def dask_address(self) -> str:
        return self.celery_env["MOPFLOW_DASK_ADDRESS"]

    # -- the stack on the control host ---------------------------------------------------------
    def mopflow(self, *args: str, timeout: float = 600) -> Any:
        return self.control.run(
            [sys.executable, "-m", "mopflow.infra.cli", *args],
            self.hosts.env(self.stack_env),
            timeout=timeout,
        )

    def read(self, host: str, path: Path | str) -> str:
        """A file on ``host``'s own disk."""
        done = self.hosts[host].run(["cat", str(path)], {})
        assert done.returncode == 0, done.stderr
        return str(done.stdout)

    def connect(self) -> dict[str, Any]:
        """Log in to the stack's REST API; the stack's state file."""
        state = json.loads(self.read("control", self.hosts.private_home / "stack" / "state.json"))
        password = json.loads(self.read("control", state["airflow_password_file"]))["admin"]
        status, answer = request_json(
            "POST", f"{self.airflow}/auth/token", {"username": "admin", "password": password}
        )
        assert status == 201, answer
        self.token = answer["access_token"]
        return dict(state)

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return request_json(method, f"{self.airflow}/api/v2{path}", body, self.token)

    def trigger(self, conf: dict[str, Any]) -> str:
        """Trigger a sweep of ``SWEEP | conf``; the REST path of its DAG run."""
        deadline = time.monotonic() + 180
        while (found := self.api("GET", f"/dags/{DAG_ID}"))[0] != 200:
            assert time.monotonic() < deadline, f"{DAG_ID} never appeared: {found}"
            time.sleep(2)
        assert self.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
        status, run = self.api(
            "POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": SWEEP | conf}
        )
        assert status == 200, run
        return f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(str(run['dag_run_id']), safe='')}"

    def finish(self, run_path: str, timeout_s: float = 900) -> list[dict[str, Any]]:
        """Wait for the DAG run to end; its task instances, once it succeeded."""
        deadline = time.monotonic() + timeout_s
        while (state := self.api("GET", run_path)[1]["state"]) not in ("success", "failed"):
            assert time.monotonic() < deadline, f"the run is still {state}"
            time.sleep(2)
        status, answer = self.api("GET", f"{run_path}/taskInstances")
        assert status == 200, answer
        tis: list[dict[str, Any]] = answer["task_instances"]
        assert state == "success", {t["task_id"]: (t["state"], t["hostname"], t["try_number"]) for t in tis}
        return tis

    def run_pipeline(
        self, host: str, conf: dict[str, Any], name: str, timeout: float = 900
    ) -> dict[str, Any]:
        """``mopflow run`` of ``SWEEP | conf`` on ``host``, with a Celery host's settings (the
        retraining DAG's tasks in its own process, no scheduler), to its end; its summary."""
        shared = self.logs.parent / "shared"  # config files and summaries the test reads
        shared.mkdir(exist_ok=True)
        config = shared / f"{name}.json"
        config.write_text(json.dumps(SWEEP | {"model_name": name} | conf))
        summary = shared / f"{name}-summary.json"
        argv = [sys.executable, "-m", "mopflow.infra.cli", "run", "--config", str(config)]
        log = self.logs / f"run-{name}.log"
        proc = self.hosts[host].start(
            [*argv, "--summary-json", str(summary)], self.hosts.env(self.celery_env), log
        )
        if proc.wait(timeout=timeout) != 0:  # the run's own lines, then its full log, kept on the host's disk
            printed = log.read_text()
            full = re.search(r"full log: (\S+)", printed)
            kept = self.hosts[host].run(["cat", full.group(1)], {}).stdout if full else ""
            raise AssertionError(printed[-3000:] + "\n--- full log ---\n" + kept[-12000:])
        return dict(json.loads(summary.read_text()))

    def task_lines(self, needle: str) -> list[dict[str, Any]]:
        """The task log records (Airflow's JSON lines) on the Celery hosts' own disks whose
        event holds ``needle``."""
        found = []
        for name in CELERY_HOSTS:
            logs = self.hosts.private_home / "airflow" / "logs"
            done = self.hosts[name].run(["grep", "-rhF", needle, str(logs)], {})
            for line in done.stdout.splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if needle in str(record.get("event", "")):
                        found.append(record)
        return sorted(found, key=lambda r: str(r.get("timestamp", "")))

    # -- the Celery hosts ----------------------------------------------------------------------
    def ensure_celery_workers(self) -> None:
        """Start ``airflow celery worker`` on each Celery host where none runs (its host was
        killed, or it was never started), and wait until each started one is ready."""
        started = []
        for name in CELERY_HOSTS:
            host = self.hosts[name]
            if all(proc.poll() is not None for proc in host.procs):
                log = self.logs / f"celery-{name}.log"
                ready = log.read_text().count(CELERY_READY) if log.exists() else 0
                host.start(
                    [str(BIN / "airflow"), "celery", "worker", "--concurrency", "2"],
                    self.hosts.env(self.celery_env)
                    | {"AIRFLOW_HOME": str(self.hosts.private_home / "airflow")},
                    log,
                )
                started.append((log, ready))
        deadline = time.monotonic() + 120
        for log, ready in started:
            while log.read_text().count(CELERY_READY) <= ready:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)

    # -- the Dask hosts ------------------------------------------------------------------------
    def start_dask_worker(self, name: str) -> None:
        argv = [str(BIN / "dask"), "worker", self.dask_address, "--nworkers", "1", "--nthreads", "1"]
        self.hosts[name].start(
            [*argv, "--no-dashboard", "--name", name],
            self.hosts.env(self.dask_env),
            self.logs / f"dask-worker-{name}.log",
        )

    def ask_scheduler(self, expression: str) -> Any:
        """``expression`` (over a Dask client ``c``) evaluated on the control host, as JSON."""
        code = (
            "import json, distributed; "
            f"c = distributed.Client({self.dask_address!r}, timeout=20); "
            f"print(json.dumps({expression})); c.close()"
        )
        done = self.control.run([sys.executable, "-c", code], self.hosts.env(self.celery_env), timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def dask_workers(self) -> dict[str, str]:
        """Worker name -> address, as the scheduler knows them."""
        return dict(
            self.ask_scheduler("{w['name']: a for a, w in c.scheduler_info(n_workers=-1)['workers'].items()}")
        )

    def processing(self) -> dict[str, list[str]]:
        """Worker name -> the keys of the tasks it runs now, asked by a client in this process: a
        client process started on the control host for each look takes seconds on a busy machine,
        and a short trial would train between two looks."""
        if self.client is None:
            import distributed

            self.client = distributed.Client(self.dask_address, timeout=20)
        running = self.client.processing()
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        return {w["name"]: [str(k) for k in running.get(a, ())] for a, w in workers.items()}

    def ensure_dask_workers(self) -> None:
        """Start again a Dask worker whose process ended (its host was cut off), and wait for all."""
        for name in DASK_HOSTS:
            if all(proc.poll() is not None for proc in self.hosts[name].procs):
                self.start_dask_worker(name)
        wait_for(
            lambda: sorted(self.dask_workers()) == sorted(DASK_HOSTS) or None,
            "only the Dask hosts' workers",
            180,
        )

    # -- what a sweep left -----------------------------------------------------------------------
    def local_files(self) -> dict[str, list[str]]:
        """Files of a run on any host's own disk: under its MOPFLOW_HOME's data, artifacts,
        optuna and mlflow folders."""
        home = self.hosts.private_home
        return {
            name: files
            for name, host in self.hosts.hosts.items()
            if (files := [f for folder in LOCAL_FOLDERS for f in host.files(home / folder)])
        }

    def s3_keys(self) -> dict[str, Any]:
        """Every object in the profile's bucket: key -> (ETag, time)."""
        return {
            o["Key"]: (o["ETag"], o["LastModified"])
            for page in s3_client(self.s3_endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])
        }


def log_time(record: dict[str, Any]) -> float:
    """The POSIX time of an Airflow task log record."""
    return datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()


@contextlib.contextmanager
def deploy(root: Path) -> Iterator[Deployment]:
    """Build the hosts and start the profile's services on them; everything goes at the end."""
    require_service("PostgreSQL", *PG)
    require_service("Redis", "127.0.0.1", REDIS_PORT)
    if problem := namespaces_problem():
        skip_unless_required(problem)
    import redis

    suffix = uuid.uuid4().hex[:8]
    dbs = {part: f"mopflow_xh_{part}_{suffix}" for part in ("airflow", "mlflow", "optuna")}
    queue = f"mopflow_hosts_{suffix}"  # a queue of this test's own on the shared Redis
    with contextlib.ExitStack() as cleanup:
        hosts = HostCluster(["control", *CELERY_HOSTS, *DASK_HOSTS], root, second_network=True)
        cleanup.callback(hosts.close)
        for db in dbs.values():
            pg_admin_sql(f"CREATE DATABASE {db}")
            cleanup.callback(pg_admin_sql, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        gateway, _ = hosts.forward(PG[1])
        hosts.forward(REDIS_PORT)
        broker = redis.Redis(host="127.0.0.1", port=REDIS_PORT, db=0)
        cleanup.callback(broker.close)
        cleanup.callback(broker.delete, queue, f"_kombu.binding.{queue}")
        s3_endpoint = start_s3(gateway, cleanup)
        s3_port = s3_endpoint.rsplit(":", 1)[1]
        s3_client(s3_endpoint).put_object(Bucket=BUCKET, Key="retrain.yaml", Body=json.dumps(RETRAIN_CONFIG))
        for name in ("control", *CELERY_HOSTS):  # a name the Dask hosts do not resolve
            hosts.add_name(name, "objects", gateway)
        named_endpoint = f"http://objects:{s3_port}"
        pg = f"postgresql+psycopg2://postgres@{gateway}:{PG[1]}"
        base = child_env()
        d = Deployment(hosts, root, dbs)
        d.s3_endpoint = s3_endpoint
        d.stack_env = base | {
            "MOPFLOW_PROFILE": "scale-out",
            "MOPFLOW_STACK_HOST": d.control.address,
            "MOPFLOW_STACK_GRACE_S": "15",
            "MOPFLOW_RETRY_DELAY_S": "1",
            # the profile's 60 s, shortened: a dead Celery host's task is retried sooner
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__OPERATORS__DEFAULT_QUEUE": queue,
            "AIRFLOW__CELERY__BROKER_URL": f"redis://{gateway}:{REDIS_PORT}/0",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{pg}/{dbs['airflow']}",
            "MOPFLOW_MLFLOW_BACKEND_STORE": f"{pg}/{dbs['mlflow']}",
            "MOPFLOW_OPTUNA_STORAGE": f"{pg}/{dbs['optuna']}",
            "MOPFLOW_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": named_endpoint}}),
            "MLFLOW_S3_ENDPOINT_URL": named_endpoint,
            "MOPFLOW_RETRAIN_CONFIG": f"s3://{BUCKET}/retrain.yaml",
        }
        up = d.mopflow("up")
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        cleanup.callback(d.mopflow, "down", timeout=180)
        cleanup.callback(lambda: d.client and d.client.close(timeout=10))
        state = d.connect()
        # The stack's own Celery and Dask workers go: tasks run on the Celery hosts, units on the Dask hosts.
        for service in state["services"]:
            if service["name"] in ("airflow-celery-worker", "dask-workers"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int(service["pid"]), signal.SIGTERM)
        printed = d.mopflow("worker-env", "--format", "json")
        assert printed.returncode == 0, printed.stderr
        shared = json.loads(printed.stdout)
        assert not any(line.startswith("# warning") for line in d.mopflow("worker-env").stdout.splitlines())
        # the coordinators' own shard cache, on a disk every host sees: no Dask worker may use it
        d.celery_env = base | shared | {"MOPFLOW_SHARD_CACHE": str(d.coordinator_cache)}
        gateway_endpoint = f"http://{gateway}:{s3_port}"
        d.dask_env = (
            base
            | shared
            | {
                "MOPFLOW_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": gateway_endpoint}}),
                "MLFLOW_S3_ENDPOINT_URL": gateway_endpoint,
            }
        )
        for name in DASK_HOSTS:
            d.start_dask_worker(name)
        d.ensure_celery_workers()
        d.ensure_dask_workers()
        yield d
