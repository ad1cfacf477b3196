"""The scale-out profile across hosts: Airflow's stack on one test host, its tasks on two Celery
hosts, the units of training on three Dask hosts (``tests/infra/host_deployment.py``), built once
for the module.

A sweep runs under each strategy through the stack's REST API to a registered champion, and
afterwards no host holds a file of the run on its local disk, and Optuna and MLflow agree on
every trial. The sweeps meet the faults on the way: ``task`` loses a Dask host's link, ``ddp``
the link between its two ranks, and the search task's Celery host is killed, then cut off.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mopflow.pipeline.context import make_run_key
from tests.infra.host_deployment import (
    CELERY_HOSTS,
    DAG_ID,
    DASK_HOSTS,
    RETRAIN_CONFIG,
    Deployment,
    deploy,
    log_time,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.services]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deploy(tmp_path_factory.mktemp("hosts")) as built:
        yield built


@dataclass(frozen=True)
class Sweep:
    """A sweep's model name, DAG run, run key and study."""

    name: str
    dag_id: str
    dag_run_id: str
    path: str = ""  # the DAG run's REST path, when triggered through the stack

    @classmethod
    def trigger(cls, d: Deployment, name: str, conf: dict[str, Any]) -> Sweep:
        """A sweep triggered through the stack's REST API."""
        path = d.trigger(conf | {"model_name": name})
        return cls(name, DAG_ID, urllib.parse.unquote(path.rsplit("/", 1)[1]), path)

    @property
    def run_key(self) -> str:
        return make_run_key(self.dag_id, self.dag_run_id)

    @property
    def study(self) -> str:
        return f"{self.name}-{self.run_key}"


def _study(d: Deployment, name: str) -> Any:
    import optuna

    return optuna.load_study(study_name=name, storage=d.pg_url("optuna"))


def _trials_agree(d: Deployment, sweep: Sweep) -> None:
    """Every trial of the study is COMPLETE or PRUNED, MLflow has one run per trial with the
    same state and each epoch once, and the champion comes from this study."""
    from mlflow import MlflowClient

    from mopflow.base.tag_names import STUDY, TRIAL, TRIAL_STATE

    study = _study(d, sweep.study)
    states = {t.number: t.state.name for t in study.trials}
    assert set(states.values()) <= {"COMPLETE", "PRUNED"}, states
    client = MlflowClient(tracking_uri=d.tracking_uri, registry_uri=d.tracking_uri)
    experiment = client.get_experiment_by_name("mopflow")
    runs = client.search_runs(
        [experiment.experiment_id],
        f"tags.`mopflow.run_key` = '{sweep.run_key}' and tags.`mopflow.stage` = 'trial'",
    )
    logged = {int(r.data.tags[TRIAL]): r.data.tags[TRIAL_STATE] for r in runs}
    assert logged == states
    for run in runs:  # no epoch told twice: a resumed trial goes on from its checkpoint
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")]
        assert (
            len(steps) == len(set(steps)) == len(study.trials[int(run.data.tags[TRIAL])].intermediate_values)
        )
    champion = client.get_model_version_by_alias(f"{sweep.name}-student", "champion")
    assert champion.tags[STUDY] == sweep.study


def _nothing_host_local(d: Deployment) -> None:
    """No file of the run on any host's own disk, no shard at the coordinators' cache folder, and
    the shards the Dask workers read in their own caches."""
    assert d.local_files() == {}
    assert not d.coordinator_cache.exists()
    cache = d.hosts.private_tmp / "mopflow-shard-cache"
    cached = {name: d.hosts[name].files(cache) for name in DASK_HOSTS}
    assert any(cached.values()), cached
    assert not d.control.files(cache)


def test_gpus_of_the_same_number_on_two_hosts_are_two_devices(deployment: Deployment) -> None:
    """Every Dask host shows its GPU as device 0 (CUDA_VISIBLE_DEVICES=0): a DDP gang of two
    fits, since they are different devices."""
    from mopflow.training.executors.ddp_workers import concurrent_trials

    devices = deployment.ask_scheduler(
        "c.run(lambda: __import__('os').environ.update(CUDA_VISIBLE_DEVICES='0')) and "
        "c.run(__import__('mopflow.training.executors.ddp_workers', fromlist=['x']).worker_device, gpu=True)"
    )
    deployment.ask_scheduler(
        "c.run(lambda: __import__('os').environ.pop('CUDA_VISIBLE_DEVICES', None)) and 1"
    )
    assert len(set(devices.values())) == len(DASK_HOSTS), devices
    assert concurrent_trials(devices, 2) == 1


def test_host_local_locations_are_refused_with_workers_on_other_hosts(deployment: Deployment) -> None:
    """A data root on the coordinator's own disk cannot be read by the workers: the stages'
    check refuses it before any work, naming the setting (a permanent error: no retry)."""
    code = (
        "import distributed; from mopflow.base.settings import Settings; "
        "from mopflow.pipeline.hosts import check_cluster_hosts; "
        f"c = distributed.Client({deployment.dask_address!r}, timeout=20); "
        "check_cluster_hosts(c, Settings.from_env())"
    )
    done = deployment.hosts[CELERY_HOSTS[0]].run(
        [sys.executable, "-c", code],
        deployment.hosts.env(deployment.celery_env) | {"MOPFLOW_DATA_ROOT": "/var/lib/mopflow/data"},
        timeout=120,
    )
    assert done.returncode != 0
    assert "AcrossHostsError" in done.stderr and "MOPFLOW_DATA_ROOT='/var/lib/mopflow/data'" in done.stderr


def test_the_retrain_config_on_s3_gives_the_retrain_dag_its_params_where_it_is_parsed(
    deployment: Deployment,
) -> None:
    """MOPFLOW_RETRAIN_CONFIG as a URL on shared storage (``s3://mopflow/retrain.yaml``, read with
    the host's own MOPFLOW_STORAGE_OPTIONS): the stack's dag-processor reads it there, so the
    retraining DAG's Params take its values, and the DAG files parse without error. ``mopflow
    run`` on the control host reads it too (the ``mop`` sweep's)."""
    d = deployment
    assert d.celery_env["MOPFLOW_RETRAIN_CONFIG"] == "s3://mopflow/retrain.yaml"  # passed to every host

    def params() -> dict[str, Any] | None:
        status, details = d.api("GET", "/dags/mopflow_retrain/details")
        return details["params"] if status == 200 else None

    found = wait_for(params, "the retraining DAG parsed", 180)
    assert {k: found[k]["value"] for k in RETRAIN_CONFIG} == RETRAIN_CONFIG, found
    status, errors = d.api("GET", "/importErrors")
    assert status == 200 and errors["total_entries"] == 0, errors


def test_a_mop_sweep_by_mopflow_run_reaches_a_champion_with_every_part_in_the_profiles_stores(
    deployment: Deployment,
) -> None:
    """``mopflow run`` on the control host with a Celery host's settings (the retraining DAG's
    tasks in its own process, no scheduler), every unit on a Dask host. The Dask workers reach S3
    with their own MOPFLOW_STORAGE_OPTIONS (the coordinator's endpoint name does not resolve on
    them) and cache shards on their own disk, never at the coordinator's MOPFLOW_SHARD_CACHE."""
    d = deployment
    summary = d.run_pipeline("control", {"strategy": "mop"}, "xh-mop")
    sweep = Sweep("xh-mop", "mopflow_retrain", summary["airflow_run_id"])
    assert (sweep.run_key, sweep.study) == (summary["run_key"], summary["optuna"]["study_name"])
    _trials_agree(d, sweep)
    _nothing_host_local(d)
    _every_part_in_the_profiles_stores(d, sweep)


def _ran_on_the_celery_hosts(d: Deployment, sweep: Sweep, tis: list[dict[str, Any]]) -> None:
    """Every task ran on a Celery host, and the search task's log, kept there, is read through
    the stack's REST API (the api-server fetches it from that host, signed with the shared secret
    key)."""
    assert {t["hostname"] for t in tis} <= set(CELERY_HOSTS), {t["task_id"]: t["hostname"] for t in tis}
    search = next(t for t in tis if t["task_id"] == "search")
    status, log = d.api("GET", f"{sweep.path}/taskInstances/search/logs/{search['try_number']}")
    assert status == 200, log
    assert "search: study" in json.dumps(log), json.dumps(log)[-2000:]  # the stage's own lines
    _every_task_went_through_celery(d, tis)


def _every_task_went_through_celery(d: Deployment, tis: list[dict[str, Any]]) -> None:
    """Each task instance came from this deployment's queue with a Celery task id, and its Celery
    task ended SUCCESS in the result backend on PostgreSQL (it may report after the task instance)."""
    import sqlalchemy

    assert {t["queue"] for t in tis} == {d.stack_env["AIRFLOW__OPERATORS__DEFAULT_QUEUE"]}
    engine = sqlalchemy.create_engine(d.pg_url("airflow"))
    try:
        with engine.connect() as conn:
            ids: dict[str, str | None] = dict(
                conn.execute(
                    sqlalchemy.text(
                        "SELECT task_id, external_executor_id FROM task_instance WHERE run_id = :r"
                    ),
                    {"r": tis[0]["dag_run_id"]},
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


def _every_part_in_the_profiles_stores(d: Deployment, sweep: Sweep) -> None:
    """The profile's stores hold the run: every stage's MLflow run finished, with the manifest
    hash and the Airflow run id (lineage); the DAG run in Airflow's metadata on PostgreSQL; the
    shards, the trials' checkpoints and the registered model's files on S3."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=d.tracking_uri, registry_uri=d.tracking_uri)
    experiment = client.get_experiment_by_name("mopflow")
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{sweep.run_key}'")
    stages = {r.data.tags.get("mopflow.stage") for r in runs}
    assert {"pipeline", "shard", "search", "ensemble", "distill", "register", "trial"} <= stages
    hashes = set()
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        assert run.data.tags["mopflow.airflow_run_id"] == sweep.dag_run_id
        if run.data.tags["mopflow.stage"] != "pipeline":
            hashes.add(run.data.tags["mopflow.manifest_hash"])
    assert len(hashes) == 1, hashes
    import sqlalchemy

    engine = sqlalchemy.create_engine(d.pg_url("airflow"))
    try:
        with engine.connect() as conn:
            states = conn.execute(
                sqlalchemy.text("SELECT state FROM dag_run WHERE dag_id = :d AND run_id = :r"),
                {"d": sweep.dag_id, "r": sweep.dag_run_id},
            ).scalars()
            assert list(states) == ["success"]
    finally:
        engine.dispose()
    keys = list(d.s3_keys())
    assert any(k.startswith("data/") and k.endswith("manifest.json") for k in keys), keys[:20]
    assert any(k.startswith("artifacts/studies/") and k.endswith("weights.safetensors") for k in keys)
    assert any(k.startswith("mlflow/") and k.endswith("MLmodel") for k in keys)


def test_a_task_sweep_goes_on_when_a_dask_host_is_cut_off(deployment: Deployment) -> None:
    """Fault (a), on the ``task`` strategy's sweep, triggered through the stack's REST API and run
    by the Celery hosts: a Dask host's link is cut while it trains a trial, and brought back later. The scheduler lets it go within the profile's TCP timeout and
    worker TTL (not Dask's 5-minute default), its trial goes on elsewhere from its checkpoint, and
    the sweep finishes to a champion with nothing on any host's own disk."""
    d = deployment
    d.ensure_dask_workers()
    sweep = Sweep.trigger(d, "xh-task", {"strategy": "task", "n_trials": 3, "epochs": 3})
    busy = wait_for(
        lambda: [w for w, keys in d.processing().items() if keys] or None, "a trial training", 300
    )
    victim = d.hosts[busy[0]]
    victim.cut()
    cut_at = time.monotonic()
    wait_for(lambda: victim.name not in d.dask_workers() or None, f"{victim.name} let go", 120)
    noticed_s = time.monotonic() - cut_at
    victim.mend()
    tis = d.finish(sweep.path)
    _ran_on_the_celery_hosts(d, sweep, tis)
    _trials_agree(d, sweep)
    ttl_s = float(d.celery_env["DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"].removesuffix("s"))
    print(f"a cut-off Dask host was let go after {noticed_s:.1f} s (worker TTL {ttl_s:.0f} s)")
    assert noticed_s <= ttl_s + 15  # + one poll of the scheduler from the control host
    _nothing_host_local(d)


def test_a_ddp_sweep_whose_ranks_lose_their_link_resumes_on_a_gang_without_the_lost_worker(
    deployment: Deployment,
) -> None:
    """The ``ddp`` strategy's sweep and fault (c): the trial's two ranks start on two hosts and
    talk over a second network (the workers set GLOO_SOCKET_IFNAME=eth1, as a cluster with its own
    interconnect does); after its first epoch, rank 1's link on it is cut while the Dask workers
    stay connected. The trial notices within its collective timeout and resumes from its
    checkpoint on a gang without the worker it lost, to a champion."""
    d = deployment
    d.ensure_dask_workers()
    d.ask_scheduler("c.run(lambda: __import__('os').environ.update(GLOO_SOCKET_IFNAME='eth1')) and 1")
    timeout_s = 45.0  # a rank starved by a busy machine is not lost
    names = {address: worker for worker, address in d.dask_workers().items()}
    lost = None
    try:
        conf = {
            "strategy": "ddp",
            "n_trials": 1,
            "epochs": 8,
            "pruner": "none",
            "ddp_collective_timeout_s": timeout_s,
        }
        sweep = Sweep.trigger(d, "xh-ddp", conf)
        # Probes that take milliseconds (the study), not a client process on the control host:
        # on a busy machine that takes seconds, and the trial would end before the cut.
        wait_for(lambda: _epochs_told(d, sweep) >= 1 or None, "the trial's first epoch", 300)
        first = _gangs(d, names)[0][1]
        assert len(set(first)) == 2, first  # two hosts, a worker each
        lost = d.hosts[first[1]]  # rank 1's
        lost.cut("eth1")
        cut_at = time.time()
        d.finish(sweep.path)
    finally:
        if lost is not None:
            lost.mend()
        d.ask_scheduler("c.run(lambda: __import__('os').environ.pop('GLOO_SOCKET_IFNAME', None)) and 1")
    _trials_agree(d, sweep)
    _nothing_host_local(d)
    again = [(at, gang) for at, gang in _gangs(d, names) if at > cut_at]
    assert again and lost.name not in again[0][1], again
    restarted_s = again[0][0] - cut_at
    print(
        f"ranks on {sorted(first)}, {lost.name}'s link cut: on {sorted(again[0][1])} after {restarted_s:.1f} s"
    )
    assert restarted_s <= timeout_s + 30  # the collective timeout, then the new gang's rendezvous
    assert d.task_lines("starting again from its last checkpoint")


def _epochs_told(d: Deployment, sweep: Sweep) -> int:
    """Epochs the sweep's single trial has been told (0 before it exists)."""
    try:
        trials = _study(d, sweep.study).trials
    except KeyError:  # the search has not made it yet
        return 0
    return len(trials[0].intermediate_values) if trials else 0


def _gangs(d: Deployment, names: dict[str, str]) -> list[tuple[float, tuple[str, ...]]]:
    """When trial-0000 started on a gang, and the gang's hosts by rank, from the search task's log."""
    found = []
    for record in d.task_lines("trial-0000 starts on 2 ranks"):
        ranks = re.search(r"\((\S+), (\S+)\)", str(record["event"]))
        assert ranks, record
        found.append((log_time(record), tuple(names.get(a, a) for a in ranks.groups())))
    assert found, "the trial's gang is not in the search task's log"
    return found


@pytest.mark.parametrize("fault", ["killed", "cut"])
def test_a_celery_host_lost_during_the_search_is_retried_on_the_other_from_its_checkpoints(
    deployment: Deployment, fault: str
) -> None:
    """Fault (b): the Celery host running the search task is lost. ``killed``: every process on it
    dies. ``cut``: its link goes down, its processes live on, and it comes back once the retry
    runs. Airflow notices the missing heartbeats, and the retry, on the other host, takes the
    study's lease and resumes the trials from their checkpoints in S3: every trial COMPLETE, each
    epoch told once, a champion registered. A cut-off try that comes back writes nothing after the
    retry took over: the study and every object in S3 are as the retry left them once it ended."""
    from mopflow.training.search.lease import lease_of
    from mopflow.training.search.study import MODEL_ATTR, STALE_ATTR

    d = deployment
    d.ensure_celery_workers()  # a host killed by an earlier test is back
    d.ensure_dask_workers()
    sweep = Sweep.trigger(d, f"xh-celery-{fault}", {"n_trials": 3, "epochs": 4, "pruner": "none"})
    deadline, victim = time.monotonic() + 600, ""
    while not victim:  # the search task runs, and its first epoch was told to the study
        assert time.monotonic() < deadline, d.api("GET", f"{sweep.path}/taskInstances/search")
        time.sleep(0.5)
        search = d.api("GET", f"{sweep.path}/taskInstances/search")[1]
        if search.get("state") == "running" and _any_epoch_told(d, sweep):
            victim = search["hostname"]
    assert victim in CELERY_HOSTS
    survivor = next(h for h in CELERY_HOSTS if h != victim)
    lost_at = time.monotonic()
    if fault == "killed":
        d.hosts[victim].kill_all()
    else:
        d.hosts[victim].cut()
        try:  # the retry starts on the other host while this one is still cut off
            while (search := d.api("GET", f"{sweep.path}/taskInstances/search")[1]).get(
                "try_number"
            ) != 2 or (search.get("state") != "running"):
                assert time.monotonic() < lost_at + 300, search
                time.sleep(1)
            print(
                f"the search's retry runs on {search['hostname']} {time.monotonic() - lost_at:.1f} s after the cut"
            )
        finally:
            d.hosts[victim].mend()
    tis = d.finish(sweep.path)
    search = next(t for t in tis if t["task_id"] == "search")
    assert (search["try_number"], search["hostname"]) == (2, survivor), search
    if fault == "killed":  # the killed host's worker is gone: the later tasks ran on the survivor
        assert {t["hostname"] for t in tis if t["task_id"] in ("ensemble", "distill", "register")} == {
            survivor
        }
    trials = _study(d, sweep.study).trials
    counted = [t for t in trials if not t.user_attrs.get(STALE_ATTR)]
    assert sorted(t.state.name for t in counted) == ["COMPLETE"] * 3, [
        (t.number, t.state.name) for t in trials
    ]
    assert any(t.user_attrs.get(STALE_ATTR) for t in trials)  # the lost try's trials, failed and retried
    assert any("resumed_from_epoch" in t.user_attrs for t in counted)  # from its checkpoint in S3
    for trial in counted:  # each model's epochs told once, in order, whichever try trained them
        assert sorted(trial.intermediate_values) == list(range(4)), (trial.number, trial.intermediate_values)
    assert len({t.user_attrs[MODEL_ATTR] for t in counted}) == 3
    assert lease_of(_study(d, sweep.study))["generation"] == 2
    print(
        f"search retried on {survivor} and the run done {time.monotonic() - lost_at:.1f} s after the host was {fault}"
    )
    if fault == "cut":
        _the_cut_off_try_ends_writing_nothing(d, victim, sweep)


def _any_epoch_told(d: Deployment, sweep: Sweep) -> bool:
    try:
        return any(t.intermediate_values for t in _study(d, sweep.study).trials)
    except KeyError:  # the search has not made the study yet
        return False


# The processes of an Airflow task on a Celery worker: its supervisor and the task itself.
TASK_PROCESSES = ("airflow task supervisor", "airflow worker --")
# How a cut-off try can end: its lease taken (mopflow), or its supervisor told or giving up (Airflow).
ENDINGS = ("Superseded", "shouldn't be running anymore", "Too many failed heartbeats")


def _the_cut_off_try_ends_writing_nothing(d: Deployment, victim: str, sweep: Sweep) -> None:
    """Wait for the first try's processes on ``victim`` to end; nothing it could reach (the study,
    the objects in S3) changed meanwhile."""
    before = _written(d, sweep)
    mended_at = time.monotonic()
    while tasks := [c for c in d.hosts[victim].processes().values() if c.startswith(TASK_PROCESSES)]:
        assert time.monotonic() < mended_at + 300, tasks
        time.sleep(2)
    ended_s = time.monotonic() - mended_at
    assert _written(d, sweep) == before
    logs = Path(d.hosts.private_home) / "airflow" / "logs"
    found = d.hosts[victim].run(["grep", "-rhoE", "|".join(ENDINGS), str(logs)], {}).stdout
    print(
        f"the cut-off try ended {ended_s:.1f} s after the run, writing nothing: {sorted(set(found.split(chr(10))) - {''})}"
    )


def _written(d: Deployment, sweep: Sweep) -> dict[str, Any]:
    """What a sweep can write: the study's trials, and every object in S3 with its ETag and time."""
    trials = _study(d, sweep.study).trials
    return {
        "trials": [(t.number, t.state.name, t.intermediate_values, t.user_attrs) for t in trials],
        "objects": d.s3_keys(),
    }
