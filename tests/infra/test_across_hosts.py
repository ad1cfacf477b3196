"""The scale-out profile across hosts: a cluster of test hosts (``tests/hosts.py``), each with
its own address, hostname and private disk, the profile's services spread over them.

- ``control``: the MLflow server, the Dask scheduler, and the coordinator (``mopflow run``,
  which runs the retraining DAG's tasks in its own process);
- ``w1``, ``w2``, ``w3``: one Dask worker each;
- PostgreSQL and Redis of this machine, forwarded to the bridge's address; an S3 server (moto)
  bound to the bridge's address.

Each host maps its own name to 127.0.1.1, as Debian does. A sweep runs under each strategy
through to a registered champion, and afterwards no host holds a file of the run on its local
disk, and Optuna and MLflow agree on every trial.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from mopflow.infra.stack.profile import apply_profile
from tests.conftest import PG, pg_admin_sql, require_service, skip_unless_required
from tests.dags.test_end_to_end import TINY
from tests.hosts import HostCluster, namespaces_problem
from tests.scale_out_env import BIN, BUCKET, child_env, s3_client, start_s3

pytestmark = [pytest.mark.slow, pytest.mark.services]

WORKER_HOSTS = ("w1", "w2", "w3")
LOCAL_FOLDERS = ("data", "artifacts", "optuna", "mlflow")  # under a host's MOPFLOW_HOME
# The smallest sweep that still ensembles and distils: a trial or two of two epochs.
SWEEP = {
    "num_samples": 600,
    "n_trials": 2,
    "epochs": 2,
    "top_k": 1,
    "distill_epochs": 1,
    "warm_start": False,  # each study its own: Optuna and MLflow then hold the same trials
    "warm_start_studies": 0,
}


def _wait(check: Any, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if (value := check()) is not None:
                return value
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout:.0f}s")


class Deployment:
    """The services of the scale-out profile on the test hosts, and runs of the pipeline."""

    def __init__(
        self,
        hosts: HostCluster,
        env: dict[str, str],
        worker_env: dict[str, str],
        logs: Path,
        dbs: dict[str, str],
    ) -> None:
        self.hosts, self.env, self.worker_env, self.logs, self.dbs = hosts, env, worker_env, logs, dbs
        self.control = hosts["control"]
        self.client: Any = None  # a Dask client in this process (processing), made at its first use
        self.shared = logs.parent / "shared"  # config files and summaries the test reads
        self.shared.mkdir(exist_ok=True)

    def host_env(self, **extra: str) -> dict[str, str]:
        """The environment of a process on the control host: the profile's settings, its private disk."""
        return self.hosts.env(self.env) | extra

    def start_dask_worker(self, name: str) -> None:
        host = self.hosts[name]
        host.start(
            [
                str(BIN / "dask"),
                "worker",
                self.env["MOPFLOW_DASK_ADDRESS"],
                "--nworkers",
                "1",
                "--nthreads",
                "1",
                "--no-dashboard",
                "--name",
                name,
            ],
            self.hosts.env(self.worker_env),
            self.logs / f"dask-worker-{name}.log",
        )

    def ask_scheduler(self, expression: str) -> Any:
        """``expression`` (over a Dask client ``c``) evaluated on the control host, as JSON."""
        code = (
            "import json, distributed; "
            f"c = distributed.Client({self.env['MOPFLOW_DASK_ADDRESS']!r}, timeout=20); "
            f"print(json.dumps({expression})); c.close()"
        )
        done = self.control.run([sys.executable, "-c", code], self.host_env(), timeout=60)
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

            self.client = distributed.Client(self.env["MOPFLOW_DASK_ADDRESS"], timeout=20)
        running = self.client.processing()
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        return {w["name"]: [str(k) for k in running.get(a, ())] for a, w in workers.items()}

    def ensure_workers(self) -> None:
        """Start again a Dask worker whose process ended (its host was cut off), and wait for all."""
        for name in WORKER_HOSTS:
            host = self.hosts[name]
            if all(proc.poll() is not None for proc in host.procs):
                self.start_dask_worker(name)
        _wait(lambda: len(self.dask_workers()) == len(WORKER_HOSTS) or None, "every Dask worker joined", 180)

    def start_run(self, conf: dict[str, Any], name: str) -> Any:
        """``mopflow run`` started on the control host; :meth:`finish` waits for its summary."""
        config = self.shared / f"{name}.json"
        config.write_text(json.dumps(TINY | SWEEP | {"model_name": name} | conf))
        argv = [sys.executable, "-m", "mopflow.infra.cli", "run", "--config", str(config)]
        argv += ["--summary-json", str(self.shared / f"{name}-summary.json")]
        return self.control.start(argv, self.host_env(), self.logs / f"run-{name}.log")

    def finish(self, proc: Any, name: str, timeout: float = 900) -> dict[str, Any]:
        """The summary of a run started by :meth:`start_run`, once it ends."""
        returncode = proc.wait(timeout=timeout)
        if returncode != 0:  # the run's own lines, then its full log, kept on the control host's disk
            printed = (self.logs / f"run-{name}.log").read_text()
            full = re.search(r"full log: (\S+)", printed)
            kept = self.control.run(["cat", full.group(1)], {}).stdout if full else ""
            (self.logs / f"run-{name}-full.log").write_text(kept)
            raise AssertionError(printed[-3000:] + "\n--- full log ---\n" + kept[-12000:])
        return dict(json.loads((self.shared / f"{name}-summary.json").read_text()))

    def run(self, conf: dict[str, Any], name: str) -> dict[str, Any]:
        """``mopflow run`` on the control host, to its end; its summary."""
        return self.finish(self.start_run(conf, name), name)

    def run_log(self, summary: dict[str, Any]) -> str:
        """The run's full log, on the control host's own disk."""
        done = self.control.run(
            ["cat", str(self.hosts.private_home / "logs" / f"{summary['run_key']}.log")], {}
        )
        return done.stdout

    def local_files(self) -> dict[str, list[str]]:
        """Files of a run on any host's own disk: under its MOPFLOW_HOME's data, artifacts,
        optuna and mlflow folders."""
        home = self.hosts.private_home
        return {
            name: files
            for name, host in self.hosts.hosts.items()
            if (files := [f for folder in LOCAL_FOLDERS for f in host.files(home / folder)])
        }


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Build the hosts and start the profile's services on them (once for the module)."""
    require_service("PostgreSQL", *PG)
    if problem := namespaces_problem():
        skip_unless_required(problem)
    root = tmp_path_factory.mktemp("hosts")
    suffix = uuid.uuid4().hex[:8]
    dbs = {part: f"mopflow_xh_{part}_{suffix}" for part in ("airflow", "mlflow", "optuna")}
    with contextlib.ExitStack() as cleanup:
        hosts = HostCluster(["control", *WORKER_HOSTS], root, second_network=True)
        cleanup.callback(hosts.close)
        for db in dbs.values():
            pg_admin_sql(f"CREATE DATABASE {db}")
            cleanup.callback(pg_admin_sql, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        pg_host, pg_port = hosts.forward(PG[1])
        pg = f"postgresql+psycopg2://postgres@{pg_host}:{pg_port}"
        s3_port = start_s3(hosts.gateway, cleanup).rsplit(":", 1)[1]
        # The control host reaches S3 by a name only it resolves; the workers by their own setting.
        hosts.add_name("control", "objects", hosts.gateway)
        endpoint = f"http://objects:{s3_port}"
        control = hosts["control"]
        base = child_env()
        env = base | {
            "MOPFLOW_PROFILE": "scale-out",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{pg}/{dbs['airflow']}",
            "MOPFLOW_OPTUNA_STORAGE": f"{pg}/{dbs['optuna']}",
            "MOPFLOW_TRACKING_URI": f"http://{control.address}:5000",
            "MOPFLOW_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}}),
            "MLFLOW_S3_ENDPOINT_URL": endpoint,
            "MOPFLOW_DASK_ADDRESS": f"tcp://{control.address}:8786",
            "MOPFLOW_RETRY_DELAY_S": "1",
            # the coordinator's own shard cache, on a disk every host sees: no worker may use it
            "MOPFLOW_SHARD_CACHE": str(root / "coordinator-shard-cache"),
        }
        env.pop("MOPFLOW_HOME", None)
        apply_profile(env)  # everything else from infra/profiles/scale-out.env
        worker_env = {k: v for k, v in env.items() if k != "MOPFLOW_SHARD_CACHE"} | {
            "MOPFLOW_STORAGE_OPTIONS": json.dumps(
                {"client_kwargs": {"endpoint_url": f"http://{hosts.gateway}:{s3_port}"}}
            )
        }
        deployment = Deployment(hosts, env, worker_env, root / "logs", dbs)
        cleanup.callback(lambda: deployment.client and deployment.client.close(timeout=10))
        control.start(
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                f"{pg}/{dbs['mlflow']}",
                "--artifacts-destination",
                env["MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION"],
                "--host",
                control.address,
                "--port",
                "5000",
                "--workers",
                "1",
                "--allowed-hosts",
                f"{control.address}:5000,control:5000",
            ],
            deployment.host_env(),
            deployment.logs / "mlflow.log",
        )
        control.start(
            [str(BIN / "dask"), "scheduler", "--host", control.address, "--port", "8786", "--no-dashboard"],
            deployment.host_env(),
            deployment.logs / "dask-scheduler.log",
        )
        _wait(lambda: socket.create_connection((control.address, 8786), 1).close() or True, "dask scheduler")
        for name in WORKER_HOSTS:
            deployment.start_dask_worker(name)
        _wait(
            lambda: (
                urllib.request.urlopen(f"http://{control.address}:5000/health", timeout=2).status == 200
                or None
            ),
            "the MLflow server answered",
        )
        _wait(
            lambda: len(deployment.dask_workers()) == len(WORKER_HOSTS) or None, "three Dask workers joined"
        )
        yield deployment


def _trials_agree(deployment: Deployment, summary: dict[str, Any], name: str) -> None:
    """Every trial of the study is COMPLETE or PRUNED, and MLflow has one run per trial with
    the same state."""
    import optuna
    from mlflow import MlflowClient

    from mopflow.base.optuna_storage import make_storage
    from mopflow.base.tag_names import TRIAL, TRIAL_STATE

    env = {
        k: v.replace("@" + deployment.hosts.gateway + ":", "@127.0.0.1:") for k, v in deployment.env.items()
    }
    study = optuna.load_study(
        study_name=summary["optuna"]["study_name"], storage=make_storage(env["MOPFLOW_OPTUNA_STORAGE"])
    )
    states = {t.number: t.state.name for t in study.trials}
    assert set(states.values()) <= {"COMPLETE", "PRUNED"}, states
    uri = deployment.env["MOPFLOW_TRACKING_URI"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name("mopflow")
    runs = client.search_runs(
        [experiment.experiment_id],
        f"tags.`mopflow.run_key` = '{summary['run_key']}' and tags.`mopflow.stage` = 'trial'",
    )
    logged = {int(r.data.tags[TRIAL]): r.data.tags[TRIAL_STATE] for r in runs}
    assert logged == states
    for run in runs:  # no epoch told twice: a resumed trial goes on from its checkpoint
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")]
        assert (
            len(steps) == len(set(steps)) == len(study.trials[int(run.data.tags[TRIAL])].intermediate_values)
        )
    champion = client.get_model_version_by_alias(f"{name}-student", "champion")
    assert champion.version == summary["registered"]["version"]


def _nothing_host_local(deployment: Deployment) -> None:
    """No file of the run on any host's own disk, no shard at the coordinator's cache folder, and
    the workers' shards in their own caches."""
    assert deployment.local_files() == {}
    assert not Path(deployment.env["MOPFLOW_SHARD_CACHE"]).exists()
    cache = deployment.hosts.private_tmp / "mopflow-shard-cache"
    cached = {name: deployment.hosts[name].files(cache) for name in WORKER_HOSTS}
    assert any(cached.values()), cached
    assert not deployment.control.files(cache)


@pytest.mark.parametrize("strategy", ["mop", "ddp"])
def test_a_sweep_runs_across_hosts_to_a_champion(deployment: Deployment, strategy: str) -> None:
    """A strategy through to a registered champion (``task``'s is the cut-off host's test). The
    workers reach S3 with their own MOPFLOW_STORAGE_OPTIONS (the coordinator's endpoint name
    does not resolve on them) and cache shards on their own disk, never at the coordinator's
    MOPFLOW_SHARD_CACHE. Under ``ddp`` the two ranks of a trial are on two hosts."""
    deployment.ensure_workers()
    summary = deployment.run({"strategy": strategy}, f"xh-{strategy}")
    _trials_agree(deployment, summary, f"xh-{strategy}")
    _nothing_host_local(deployment)
    if strategy == "mop":
        _every_part_in_the_profiles_stores(deployment, summary)


def _every_part_in_the_profiles_stores(deployment: Deployment, summary: dict[str, Any]) -> None:
    """The profile's stores hold the run: every stage's MLflow run finished, with the manifest
    hash and the Airflow run id (lineage); the Airflow run on PostgreSQL; the shards, the trials'
    checkpoints and the registered model's files on S3."""
    import sqlalchemy
    from mlflow import MlflowClient

    uri = deployment.env["MOPFLOW_TRACKING_URI"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name("mopflow")
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{summary['run_key']}'")
    stages = {r.data.tags.get("mopflow.stage") for r in runs}
    assert {"pipeline", "shard", "search", "ensemble", "distill", "register", "trial"} <= stages
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        assert run.data.tags["mopflow.airflow_run_id"] == summary["airflow_run_id"]
        if run.data.tags["mopflow.stage"] != "pipeline":
            assert run.data.tags["mopflow.manifest_hash"] == summary["manifest_hash"]
    engine = sqlalchemy.create_engine(
        f"postgresql+psycopg2://postgres@127.0.0.1:{PG[1]}/{deployment.dbs['airflow']}"
    )
    try:
        with engine.connect() as conn:
            states = conn.execute(
                sqlalchemy.text("SELECT state FROM dag_run WHERE dag_id = 'mopflow_retrain' AND run_id = :r"),
                {"r": summary["airflow_run_id"]},
            ).scalars()
            assert list(states) == ["success"]
    finally:
        engine.dispose()
    endpoint = json.loads(deployment.worker_env["MOPFLOW_STORAGE_OPTIONS"])["client_kwargs"]["endpoint_url"]
    keys = [
        item["Key"]
        for page in s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        for item in page.get("Contents", [])
    ]
    assert any(k.startswith("data/") and k.endswith("manifest.json") for k in keys), keys[:20]
    assert any(k.startswith("artifacts/studies/") and k.endswith("weights.safetensors") for k in keys)
    assert any(k.startswith("mlflow/") and k.endswith("MLmodel") for k in keys)


def test_gpus_of_the_same_number_on_two_hosts_are_two_devices(deployment: Deployment) -> None:
    """Every worker host shows its GPU as device 0 (CUDA_VISIBLE_DEVICES=0): a DDP gang of two
    fits, since they are different devices."""
    from mopflow.training.executors.ddp_workers import concurrent_trials

    deployment.ensure_workers()
    devices = deployment.ask_scheduler(
        "c.run(lambda: __import__('os').environ.update(CUDA_VISIBLE_DEVICES='0')) and "
        "c.run(__import__('mopflow.training.executors.ddp_workers', fromlist=['x']).worker_device, gpu=True)"
    )
    deployment.ask_scheduler(
        "c.run(lambda: __import__('os').environ.pop('CUDA_VISIBLE_DEVICES', None)) and 1"
    )
    assert len(set(devices.values())) == len(WORKER_HOSTS), devices
    assert concurrent_trials(devices, 2) == 1


def test_host_local_locations_are_refused_with_workers_on_other_hosts(deployment: Deployment) -> None:
    """A data root on the control host's own disk cannot be read by the workers: the stages'
    check refuses it before any work, naming the setting (a permanent error: no retry)."""
    code = (
        "import distributed; from mopflow.base.settings import Settings; "
        "from mopflow.pipeline.hosts import check_cluster_hosts; "
        f"c = distributed.Client({deployment.env['MOPFLOW_DASK_ADDRESS']!r}, timeout=20); "
        "check_cluster_hosts(c, Settings.from_env())"
    )
    done = deployment.control.run(
        [sys.executable, "-c", code],
        deployment.host_env(MOPFLOW_DATA_ROOT="/var/lib/mopflow/data"),
        timeout=120,
    )
    assert done.returncode != 0
    assert "AcrossHostsError" in done.stderr and "MOPFLOW_DATA_ROOT='/var/lib/mopflow/data'" in done.stderr


def test_a_task_sweep_goes_on_when_a_worker_host_is_cut_off(deployment: Deployment) -> None:
    """Fault (a), on the ``task`` strategy's sweep: a Dask worker host's link is cut while it
    trains a trial, and brought back later. The scheduler lets it go within the profile's TCP
    timeout and worker TTL (not Dask's 5-minute default), its trial goes on elsewhere from its
    checkpoint, and the sweep finishes to a champion with nothing on any host's own disk."""
    deployment.ensure_workers()
    name = "xh-task"
    run = deployment.start_run({"strategy": "task", "n_trials": 3, "epochs": 3}, name)
    busy = _wait(
        lambda: [w for w, keys in deployment.processing().items() if keys] or None, "a trial training", 300
    )
    victim = deployment.hosts[busy[0]]
    victim.cut()
    cut_at = time.monotonic()
    _wait(lambda: victim.name not in deployment.dask_workers() or None, f"{victim.name} let go", 120)
    noticed_s = time.monotonic() - cut_at
    victim.mend()
    summary = deployment.finish(run, name)
    _trials_agree(deployment, summary, name)
    ttl_s = float(deployment.env["DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"].removesuffix("s"))
    print(f"a cut-off worker host was let go after {noticed_s:.1f} s (worker TTL {ttl_s:.0f} s)")
    assert noticed_s <= ttl_s + 15  # + one poll of the scheduler from the control host
    _nothing_host_local(deployment)


def test_a_cut_link_between_ddp_ranks_resumes_the_trial_on_a_gang_without_the_lost_worker(
    deployment: Deployment,
) -> None:
    """Fault (c): the ranks of a DDP trial talk over a second network (the workers set
    GLOO_SOCKET_IFNAME=eth1, as a cluster with its own interconnect does), and rank 1's link on it
    is cut; the Dask workers stay connected. The trial notices within its collective timeout and
    resumes from its checkpoint on a gang without the worker it lost."""
    deployment.ensure_workers()
    deployment.ask_scheduler(
        "c.run(lambda: __import__('os').environ.update(GLOO_SOCKET_IFNAME='eth1')) and 1"
    )
    name, timeout_s = "xh-cut-ranks", 45.0  # a rank starved by a busy machine is not lost
    names = {address: worker for worker, address in deployment.dask_workers().items()}
    lost = None
    try:
        run = deployment.start_run(
            {
                "strategy": "ddp",
                "n_trials": 1,
                "epochs": 8,
                "pruner": "none",
                "ddp_collective_timeout_s": timeout_s,
            },
            name,
        )
        # Probes that take milliseconds (the run's log, the study), not a client process on the
        # control host: on a busy machine that takes seconds, and the trial would end before the cut.
        _wait(lambda: _epochs_told(deployment, name) >= 1 or None, "the trial's first epoch", 300)
        first = _wait(lambda: _first_gang(deployment, name, names), "the trial's ranks in its log", 60)
        lost = deployment.hosts[first[1]]
        lost.cut("eth1")
        cut_at = time.time()
        summary = deployment.finish(run, name)
    finally:
        if lost is not None:
            lost.mend()
        deployment.ask_scheduler(
            "c.run(lambda: __import__('os').environ.pop('GLOO_SOCKET_IFNAME', None)) and 1"
        )
    _trials_agree(deployment, summary, name)
    log = deployment.run_log(summary)
    starts = [
        (datetime.fromisoformat(at).timestamp(), {names.get(a, a), names.get(b, b)})
        for at, a, b in re.findall(r"^(\S+) .*trial-0000 starts on 2 ranks \((\S+), (\S+)\)", log, re.M)
    ]
    assert starts[0][1] == set(first)
    again = [(at, gang) for at, gang in starts if at > cut_at]
    assert again and lost.name not in again[0][1], starts
    restarted_s = again[0][0] - cut_at
    print(
        f"ranks on {sorted(first)}, {lost.name}'s link cut: on {sorted(again[0][1])} after {restarted_s:.1f} s"
    )
    assert restarted_s <= timeout_s + 30  # the collective timeout, then the new gang's rendezvous
    assert "starting again from its last checkpoint" in log


def _epochs_told(deployment: Deployment, name: str) -> int:
    """Epochs the study of run ``name``'s single trial has been told (0 before it exists)."""
    import optuna

    storage = deployment.env["MOPFLOW_OPTUNA_STORAGE"].replace(f"@{deployment.hosts.gateway}:", "@127.0.0.1:")
    studies = [s for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith(f"{name}-")]
    if not studies:
        return 0
    trials = optuna.load_study(study_name=studies[0].study_name, storage=storage).trials
    return len(trials[0].intermediate_values) if trials else 0


def _first_gang(deployment: Deployment, name: str, names: dict[str, str]) -> tuple[str, str] | None:
    """The workers of rank 0 and rank 1 of run ``name``'s first trial, from the run's full log on
    the control host (None before its gang started)."""
    found = re.search(r"full log: (\S+)", (deployment.logs / f"run-{name}.log").read_text())
    if found is None:
        return None
    log = deployment.control.run(["cat", found.group(1)], {}).stdout
    gang = re.search(r"trial-0000 starts on 2 ranks \((\S+), (\S+)\)", log)
    return (
        (names.get(gang.group(1), gang.group(1)), names.get(gang.group(2), gang.group(2))) if gang else None
    )
