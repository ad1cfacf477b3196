"""Fault battery across the pipeline's stages. Each test states the fault, the expected
behaviour, and checks that nothing already done is lost."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

from mopflow.base import storage
from mopflow.base.optuna_storage import make_storage
from mopflow.base.settings import Settings
from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1
from mopflow.pipeline.config import PipelineConfig
from mopflow.pipeline.context import study_name_for
from mopflow.pipeline.distill import distill_stage
from mopflow.pipeline.ensemble import ensemble_stage
from mopflow.pipeline.register import register_stage
from mopflow.pipeline.run import finalize_pipeline, start_pipeline
from mopflow.pipeline.search import search_stage
from mopflow.pipeline.shard import shard_stage
from mopflow.training.data import ShardIntegrityError, load_manifest
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.study import STALE_ATTR
from mopflow.training.search.sweep import run_strategy_search
from tests.conftest import skip_unless_required
from tests.pipeline.confs import SMALL_CONF
from tests.private_postgres import PrivatePostgres, postgres_bin, private_postgres
from tests.server_waits import wait_until_answering

CONF = SMALL_CONF | {"model_name": "faults"}


class MlflowServer:
    """A real ``mlflow server`` (SQLite backend, local artifacts) that a test can stop and restart."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        mlflow = Path(sys.executable).with_name("mlflow")
        self.proc = subprocess.Popen(
            [
                str(mlflow),
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until_answering(f"{self.url}/health", self.proc, "mlflow server", timeout_s=90, poll_s=0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture()
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path / "mlflow-server")
    server.root.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_mlflow_server_down_mid_run_fails_clearly_and_leaves_no_run_running(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """Fault: the MLflow server stops between the shard and search stages.
    Expected: the search task fails after bounded retries with an error naming the server, before
    any training; once MLflow is back, finalize closes the pipeline run as FAILED and no run is
    left RUNNING; the shards written before the fault are still there (a retry reuses them)."""
    settings = Settings.from_env(
        {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_TRACKING_URI": mlflow_server.url}
    )
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__mlflow_down", settings)
    shard = shard_stage(CONF, ctx, settings)
    mlflow_server.stop()
    with pytest.raises(Exception) as failure:
        search_stage(CONF, ctx, shard, settings)
    assert f"127.0.0.1:{mlflow_server.port}" in str(failure.value)
    study_name = study_name_for(PipelineConfig.from_conf(CONF), ctx)
    with pytest.raises(KeyError):  # nothing was trained without tracking
        optuna.load_study(study_name=study_name, storage=make_storage(settings.optuna_storage))

    mlflow_server.start()
    with pytest.raises(RuntimeError, match="did not complete"):
        finalize_pipeline(ctx, settings)
    client = MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.get_experiment_by_name(settings.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{ctx.run_key}'")
    assert runs and not [r for r in runs if r.info.status == "RUNNING"]
    assert client.get_run(ctx.parent_run_id).info.status == "FAILED"
    assert storage.exists(shard.manifest_uri)
    assert shard_stage(CONF, ctx, settings).reused  # the retry redoes nothing


@pytest.fixture()
def sharded(tmp_path: Path) -> tuple[Settings, dict, dict]:
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path / "home")})
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__shards", settings)
    return settings, ctx, shard_stage(CONF, ctx, settings)


def _shard_path(shard: dict, split: str) -> Path:
    manifest = load_manifest(shard.manifest_uri)
    base = Path(shard.manifest_uri).parent
    return base / manifest["splits"][split][0]["name"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_damaged_shard_between_stages_is_named_before_any_training(
    sharded: tuple[Settings, dict, dict], damage: str
) -> None:
    """Fault: a training shard is corrupted (bytes changed) or deleted after the shard stage.
    Expected: the search stage names the shard and fails before any trial starts; the search
    run is FAILED, not RUNNING."""
    settings, ctx, shard = sharded
    victim = _shard_path(shard, "train")
    if damage == "corrupt":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    with pytest.raises((ShardIntegrityError, FileNotFoundError)) as failure:
        search_stage(CONF, ctx, shard, settings)
    assert victim.name in str(failure.value)
    study_name = study_name_for(PipelineConfig.from_conf(CONF), ctx)
    storage_ = make_storage(settings.optuna_storage)
    assert not [
        s for s in optuna.get_all_study_summaries(storage_) if s.study_name == study_name and s.n_trials
    ]
    client = MlflowClient(tracking_uri=settings.tracking_uri)
    experiment = client.get_experiment_by_name(settings.experiment_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`mopflow.stage` = 'search'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_unwritable_data_root_fails_clearly_and_leaves_no_manifest(tmp_path: Path) -> None:
    """Fault: the shard output location cannot be written (its parent is a file, not a folder).
    Expected: a clear error naming the location; no manifest and no half-written folder."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    settings = Settings.from_env(
        {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_DATA_ROOT": str(blocker / "data")}
    )
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__unwritable", settings)
    with pytest.raises(OSError) as failure:
        shard_stage(CONF, ctx, settings)
    assert "not-a-folder" in str(failure.value)
    assert blocker.read_text() == "x"


def test_a_dataset_outside_the_data_roots_is_refused_by_the_shard_stage_before_any_read(
    tmp_path: Path,
) -> None:
    """Fault: a run created past the trigger guard (`airflow dags trigger`, a user's DAG) names a
    dataset outside MOPFLOW_DATA_ROOTS. Expected: the shard stage refuses it (a permanent error,
    naming the path and the roots) before reading it; nothing is written."""
    from mopflow.pipeline.config import ConfigError
    from mopflow.pipeline.context import permanent_errors

    outside = tmp_path / "elsewhere" / "table.csv"
    outside.parent.mkdir()
    outside.write_text("x,label\n1,0\n")
    before = outside.stat().st_atime_ns
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path / "home")})
    conf = CONF | {"dataset": str(outside)}
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__outside", settings)
    with pytest.raises(ConfigError) as refused:
        shard_stage(conf, ctx, settings)
    assert isinstance(refused.value, permanent_errors())  # not retried
    message = str(refused.value)
    assert f"dataset={str(outside)!r} outside the data roots" in message and settings.data_root in message
    assert not (Path(settings.data_root) / "datasets").exists()
    assert outside.stat().st_atime_ns == before  # never opened


def test_a_local_data_root_with_workers_on_other_hosts_is_refused_before_any_shard(
    tmp_path: Path, dask_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: MOPFLOW_DASK_ADDRESS names a scheduler whose workers run on other hosts (here: the
    coordinator's host name differs from the workers') while MOPFLOW_DATA_ROOT is a local folder.
    Expected: the shard stage refuses it (a permanent error naming the setting, its value and what
    is expected) before any work; no shard is written."""
    import socket

    from mopflow.base.hosts import AcrossHostsError
    from mopflow.pipeline.context import permanent_errors

    settings = Settings.from_env(
        {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_DASK_ADDRESS": dask_client.scheduler.address}
    )
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__across_hosts", settings)
    monkeypatch.setattr("mopflow.pipeline.hosts.gethostname", lambda: "coordinator-elsewhere")
    with pytest.raises(AcrossHostsError) as refused:
        shard_stage(CONF, ctx, settings)
    assert isinstance(refused.value, permanent_errors())  # not retried
    message = str(refused.value)
    assert f"({socket.gethostname()}) than this one (coordinator-elsewhere)" in message
    assert f"MOPFLOW_DATA_ROOT={settings.data_root!r} is on this host only" in message
    assert "expected an s3:// (or another shared) URL" in message
    assert not (Path(settings.data_root) / "datasets").exists()


@pytest.fixture()
def s3_endpoint() -> Iterator[dict]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)  # it binds port 0 and reports its port
    server.start()
    _, port = server.get_host_and_port()
    try:
        yield {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        }
    finally:
        server.stop()


@pytest.mark.slow
def test_missing_bucket_fails_clearly_and_leaves_no_manifest(s3_endpoint: dict, tmp_path: Path) -> None:
    """Fault: the S3 bucket for the shards does not exist. Expected: the shard stage fails with an
    error naming the bucket; nothing is written; the shard run is FAILED."""
    import json

    settings = Settings.from_env(
        {
            "MOPFLOW_HOME": str(tmp_path / "home"),
            "MOPFLOW_DATA_ROOT": "s3://no-such-bucket/mopflow/data",
            "MOPFLOW_STORAGE_OPTIONS": json.dumps(s3_endpoint),
        }
    )
    import boto3

    # moto's in-process backend is shared by every moto server in this process: compare, don't assume empty
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint["client_kwargs"]["endpoint_url"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    buckets_before = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__nobucket", settings)
    with pytest.raises(Exception) as failure:
        shard_stage(CONF, ctx, settings)
    assert "no-such-bucket" in str(failure.value)
    assert {b["Name"] for b in s3.list_buckets()["Buckets"]} == buckets_before  # no bucket was created
    client = MlflowClient(tracking_uri=settings.tracking_uri)
    experiment = client.get_experiment_by_name(settings.experiment_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`mopflow.stage` = 'shard'")
    assert [r.info.status for r in runs] == ["FAILED"]


@pytest.mark.slow
@pytest.mark.services
def test_postgresql_restart_mid_sweep_loses_and_duplicates_no_trial(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    """Fault: PostgreSQL (the Optuna storage) restarts while trials train and report.
    Expected: storage calls are retried across the restart; the sweep completes with exactly
    n_trials counted trials, each once, none left RUNNING. The server is the test's own (a
    throwaway cluster), so the restart disturbs no other test."""

    if postgres_bin() is None:
        skip_unless_required(
            "no PostgreSQL server programs (initdb, pg_ctl) to start a server of the test's own"
        )
    with private_postgres() as server:
        _sweep_across_a_restart(small_manifest, tmp_path, dask_client, server)


def _sweep_across_a_restart(
    small_manifest: str, tmp_path: Path, dask_client: object, server: PrivatePostgres
) -> None:
    pg_url = server.url
    space = {
        "families": {
            "cnn": {
                "width": {"type": "int", "low": 4, "high": 8},
                "depth": {"type": "int", "low": 2, "high": 3},
            }
        },
        "common": {"lr": {"type": "float", "low": 0.005, "high": 0.02, "log": True}},
    }
    cfg = SearchConfig(n_trials=4, epochs=12, parallel_trials=2, space=space, pruner="none", sampler="random")
    first_report = threading.Event()
    restarted: list[object] = []

    def restart_when_training() -> None:
        if first_report.wait(timeout=180):
            try:
                server.restart()
                restarted.append(True)
            except Exception as exc:  # reported below: the test must not pass without a restart
                restarted.append(exc)

    restarter = threading.Thread(target=restart_when_training)
    restarter.start()
    try:
        outcome = run_strategy_search(
            cfg,
            small_manifest,
            "pgr",
            pg_url,
            str(tmp_path / "art"),
            dask_client,
            on_trial_done=lambda r: first_report.set(),
        )
    finally:
        restarter.join(timeout=180)
    assert restarted == [True], f"PostgreSQL was not restarted during the sweep: {restarted}"
    trials = optuna.load_study(study_name="pgr", storage=make_storage(pg_url)).trials
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    counted = [t for t in trials if not t.user_attrs.get(STALE_ATTR)]
    assert len(outcome.results) == cfg.n_trials == len(counted)
    assert len({r.number for r in outcome.results}) == cfg.n_trials
    assert all(r.state == "COMPLETE" for r in outcome.results), [r.error for r in outcome.results]


class _UnitStarted(logging.Handler):
    """Sets ``address`` and ``started`` when the MOP executor logs its first unit submission."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started = threading.Event()
        self.address = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not self.started.is_set() and " runs on tcp://" in message:
            self.address = message.rsplit(" runs on ", 1)[1].strip()
            self.started.set()


def _worker_pid(address: str) -> int | None:
    """The pid of this process's Dask worker process listening at ``address`` (tcp://host:port)."""
    import psutil

    port = int(address.rsplit(":", 1)[1])
    for child in psutil.Process().children(recursive=True):
        try:
            if any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")
            ):
                return child.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_dask_worker_killed_mid_unit_leaves_the_pipeline_result_complete(tmp_path: Path) -> None:
    """Fault: a Dask worker process is SIGKILLed (no notice) while it runs a MOP unit of the
    search stage; its nanny starts a new one.
    Expected: the pipeline's result is what an undisturbed run gives (as the pipeline tests
    assert it): every trial COMPLETE, the student registered with its aliases on a new version,
    lineage tags on the runs and the version, no MLflow run left RUNNING, and the lost work logged
    as ``redone_unit_seconds`` > 0."""
    import dask

    conf = CONF | {"strategy": "mop", "model_slots": 2, "model_name": "killed"}
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path / "home")})
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__worker_killed", settings)
    shard = shard_stage(conf, ctx, settings)

    watcher = _UnitStarted()
    killed: list[object] = []

    def kill_a_busy_worker() -> None:
        if not watcher.started.wait(timeout=180):
            killed.append("no unit started")
            return
        time.sleep(0.1)  # the unit is on its worker (a fresh worker spends seconds loading it)
        pid = _worker_pid(watcher.address)
        if pid is None:
            killed.append(f"no worker process listens at {watcher.address}")
            return
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    mop_log = logging.getLogger("mopflow.training.executors.mop")
    mop_log.addHandler(watcher)
    level = mop_log.level
    mop_log.setLevel(logging.INFO)
    killer = threading.Thread(target=kill_a_busy_worker)
    killer.start()
    try:
        # a worker killed while loading takes a while to come back on a loaded 2-core machine
        with dask.config.set({"distributed.deploy.lost-worker-timeout": "120s"}):
            search = search_stage(conf, ctx, shard, settings)
    finally:
        mop_log.removeHandler(watcher)
        mop_log.setLevel(level)
        killer.join(timeout=200)
    assert len(killed) == 1 and isinstance(killed[0], int), f"no worker was killed mid-unit: {killed}"
    ens = ensemble_stage(conf, ctx, shard, search, settings)
    student = distill_stage(conf, ctx, shard, ens, settings)
    registered = register_stage(conf, ctx, shard, search, ens, student, settings)

    # every trial COMPLETE, each once
    assert search.counts == {"COMPLETE": conf["n_trials"], "PRUNED": 0, "FAIL": 0}
    study = optuna.load_study(study_name=search.study_name, storage=make_storage(settings.optuna_storage))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * conf["n_trials"]

    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)
    experiment = client.get_experiment_by_name(settings.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{ctx.run_key}'")
    # no run left RUNNING by the stages (the parent is closed by finalize)
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == [
        client.get_run(ctx.parent_run_id).info.run_name
    ]
    stage_tags = [r.data.tags["mopflow.stage"] for r in runs]
    assert stage_tags.count("trial") == conf["n_trials"] and stage_tags.count("search") == 1
    for run in runs:  # lineage
        if run.data.tags["mopflow.stage"] != "pipeline":
            assert run.data.tags["mopflow.manifest_hash"] == shard.manifest_hash, run.info.run_name
    search_run = next(r for r in runs if r.data.tags["mopflow.stage"] == "search")
    assert search_run.data.metrics["redone_unit_seconds"] > 0  # the killed unit was done again
    assert search_run.data.metrics["trials_complete"] == conf["n_trials"]

    # the registry: a new version carrying the lineage, aliased
    assert registered.version == "1" and "challenger" in registered.aliases
    version = client.get_model_version_by_alias(registered.name, "challenger")
    assert str(version.version) == registered.version
    assert version.tags["mopflow.manifest_hash"] == shard.manifest_hash
    assert version.tags["mopflow.study"] == search.study_name
    if registered.promoted:
        assert client.get_model_version_by_alias(registered.name, "champion").version == version.version

    finalize_pipeline(ctx, settings)
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{ctx.run_key}'")
    assert {r.info.status for r in runs} == {"FINISHED"}
