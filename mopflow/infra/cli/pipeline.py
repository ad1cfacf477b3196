"""``mopflow run``'s pipeline: the retraining DAG once through ``dag.test()`` on an embedded
Airflow (the product path), its DAG run failed or forgotten in Airflow's DB when it is stopped
or resumed, and the summary the run leaves."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from mopflow.infra.cli import local_runs
from mopflow.infra.cli.airflow_integration import checked_dags_folder
from mopflow.infra.cli.errors import CliError
from mopflow.infra.cli.local_runs import RunRecord

DAG_ID = "mopflow_retrain"

log = logging.getLogger("mopflow")


def run_pipeline(
    conf: Mapping[str, Any],
    resume: str | None = None,
    verbose: bool = True,
    data_roots: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the retraining DAG once through ``dag.test()`` (the product path) and return its summary.

    ``resume`` (a run key, or ``""`` for the latest unfinished run) runs an earlier run again
    with its conf (and its ``data_roots``) instead. ``data_roots``: folders or URL prefixes this
    run may read its data from besides ``MOPFLOW_DATA_ROOTS`` (the stages check them too).
    SIGINT/SIGTERM stop the run (:mod:`mopflow.infra.cli.local_runs`): ``RunStopped``.
    Unless ``verbose``, the logs go to ``$MOPFLOW_HOME/logs/<run key>.log`` and the terminal
    shows the run's progress (:mod:`mopflow.base.progress`).
    """
    from mopflow.base import stopping
    from mopflow.base.heap import collect_less_often
    from mopflow.base.settings import Settings
    from mopflow.training.compute.cluster import shared_local_clusters, start_local_cluster_early

    collect_less_often()  # every stage runs in this process: 4 s of a tiny run's CPU went to it
    settings = Settings.from_env()
    record, run_conf = _run_conf(settings.home, conf, resume)
    timeout_s = local_runs.stop_timeout_s()
    dags = checked_dags_folder(os.environ)  # before Airflow starts: a bad folder is one line
    # the output of everything from here on (the cluster's start and shutdown, Airflow's
    # migration) goes to the run's log; the terminal shows mopflow's own lines
    with (
        local_runs.run_output(settings.home, verbose) as output,
        shared_local_clusters(),  # the stages run here in turn: one LocalCluster serves them all
    ):
        if not settings.dask_address:  # its workers start and import while Airflow gets ready
            start_local_cluster_early(settings.dask_workers)
        _prepare_airflow(settings.airflow_home)
        dag = _load_dag(dags)
        record = _open_record(settings.home, record, run_conf, data_roots)
        _allow_data_roots(settings.data_roots, record.data_roots)
        stopping.reset()
        tracking = (settings.tracking_uri, settings.experiment_name)
        handlers = local_runs.stopping_handlers(record, settings.home, tracking, timeout_s, fail_dag_run)
        started = time.monotonic()
        log_file = local_runs.log_file_of(settings.home, record.run_key)
        output.settle(log_file)
        dag_run = _run_dag(
            dag, run_conf, record, log_file, output.terminal if not verbose else None, handlers
        )
    wall = time.monotonic() - started
    if stopping.stop_requested():
        raise _stopped(record, settings.home, tracking)
    state = str(getattr(dag_run, "state", "unknown"))
    return _finished_summary(settings, record, state, wall, log_file, verbose)


def _run_conf(
    home: str, conf: Mapping[str, Any], resume: str | None
) -> tuple[RunRecord | None, dict[str, Any]]:
    """The run to resume (if ``resume`` is given) and the conf to run, refused when invalid before
    anything starts."""
    from mopflow.pipeline.config import ConfigError, PipelineConfig

    record = local_runs.find_resumable(home, resume or None) if resume is not None else None
    run_conf = dict(record.conf) if record is not None else dict(conf)
    try:
        PipelineConfig.from_conf(run_conf)
    except ConfigError as exc:
        raise CliError(f"invalid config: {exc}") from exc
    return record, run_conf


def _prepare_airflow(airflow_home: str) -> dict[str, str]:
    """Point this process's embedded Airflow at ``airflow_home`` and migrate its metadata DB
    (idempotent) so that ``dag.test()`` has one; returns Airflow's settings. Airflow is first
    imported here, after its settings are in the environment."""
    from mopflow.infra.stack.environment import airflow_env

    env = airflow_env(airflow_home, os.environ, str(Path(sys.executable).parent))
    os.environ.update(env)
    _migrate_airflow_db(airflow_home)
    return env


def _migrate_airflow_db(airflow_home: str) -> None:
    """What ``airflow db migrate`` does, in this process (its Airflow settings already in the
    environment): the tables created or upgraded without a second interpreter importing Airflow
    again (2.8 s, of which the migration is 1 s). ``mopflow up`` keeps the command: it passes a
    whole environment of its own."""
    from airflow.utils import db
    from airflow.utils.providers_configuration_loader import providers_configuration_loaded

    from mopflow.base.airflow_home import AirflowSetupError

    Path(airflow_home).mkdir(parents=True, exist_ok=True)
    log.info("airflow: migrating metadata DB in %s", airflow_home)
    try:
        providers_configuration_loaded(db.upgradedb)()
    except Exception as exc:
        raise AirflowSetupError(
            f"migrating Airflow's metadata DB in {airflow_home} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _allow_data_roots(known: Sequence[str], roots: Sequence[str]) -> None:
    """Let the stages of this process read from ``roots`` too, besides the ``known`` ones (the
    settings' ``data_roots``): they check the dataset against ``MOPFLOW_DATA_ROOTS`` however a
    run was created."""
    if roots:
        os.environ["MOPFLOW_DATA_ROOTS"] = ",".join([*known, *(r for r in roots if r not in known)])


def _load_dag(dags_folder: Path) -> Any:
    """The retraining DAG, from its file in the DAGs folder."""
    import importlib.util

    dag_file = dags_folder / "retrain.py"
    spec = importlib.util.spec_from_file_location("mopflow_dag_retrain", dag_file)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load the DAG file {dag_file}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if getattr(v, "dag_id", None) == DAG_ID)


def _open_record(
    home: str, record: RunRecord | None, conf: Mapping[str, Any], data_roots: Sequence[str] = ()
) -> RunRecord:
    """A new run's record, or the resumed run's (its DAG run forgotten: dag.test makes it again)."""
    if record is None:
        record = new_run_record(conf)
        record.data_roots = list(data_roots)
    else:
        forget_dag_run(DAG_ID, record.airflow_run_id)  # dag.test makes it again, same id
        record.resumed += 1
        record.state, record.ended_at, record.message = "running", "", ""
        log.info("mopflow run: resuming run %s (attempt %d)", record.run_key, record.resumed + 1)
    local_runs.save_record(home, record)
    return record


def _run_dag(
    dag: Any,
    conf: Mapping[str, Any],
    record: RunRecord,
    log_file: Path,
    terminal: TextIO | None,
    handlers: tuple[Callable[[int], None], Callable[[int], None]],
) -> Any:
    """``dag.test()`` with this process owning SIGINT/SIGTERM (``handlers``) and, given the
    ``terminal`` (the run is not verbose; its output already goes to ``log_file``), its progress
    there. Returns the DAG run, or None when a stop came between tasks."""
    from mopflow.base import progress, stopping

    when = datetime.fromisoformat(record.logical_date)
    if terminal is not None:
        print(
            f"mopflow run: run key {record.run_key}; full log: {log_file} (--verbose streams it)",
            file=terminal,
        )
    try:
        with (
            progress.ProgressView(terminal, live=terminal.isatty())
            if terminal is not None
            else contextlib.nullcontext(),
            local_runs.owned_signals(*handlers),
        ):
            log.info("mopflow run: running DAG %s once (dag.test), run key %s", DAG_ID, record.run_key)
            return dag.test(run_conf=conf, logical_date=when, run_after=when)
    except stopping.PipelineStopped:
        return None  # between tasks: the DAG run is closed by the caller


def _finished_summary(
    settings: Any, record: RunRecord, state: str, wall: float, log_file: Path, verbose: bool
) -> dict[str, Any]:
    """Close the record of a finished DAG run: the run's summary when it succeeded, else
    ``RunFailed`` with the failed stage's error (exit code 2 when retrying cannot help)."""
    from mopflow.base import storage
    from mopflow.pipeline.context import summary_uri

    summary_file = summary_uri(settings, record.run_key)
    if not state.endswith("success") or not storage.exists(summary_file, settings.storage_options):
        from mopflow.pipeline.context import read_failure

        failure = read_failure(settings, record.run_key)
        record.state, record.ended_at = "failed", local_runs.now_iso()
        record.message = f"{failure['stage']}: {failure['error']}" if failure else f"DAG run {state}"
        local_runs.save_record(settings.home, record)
        permanent = bool(failure and failure.get("permanent"))
        message = local_runs.failure_message(record.run_key, failure, state)
        if not verbose:
            message += f"\nfull log: {log_file}"
        raise local_runs.RunFailed(message, 2 if permanent else 1)
    record.state, record.ended_at = "succeeded", local_runs.now_iso()
    local_runs.save_record(settings.home, record)
    summary: dict[str, Any] = storage.read_json(summary_file, settings.storage_options)
    summary["wall_time_s"] = round(wall, 1)
    summary["how_to_open"] = ui_hints(settings, summary)
    summary["resumed"] = record.resumed
    summary["log_file"] = "" if verbose else str(log_file)
    return summary


def _stopped(record: RunRecord, home: str, tracking: tuple[str, str]) -> Exception:
    """Close a stopped run: DAG run failed, MLflow runs KILLED, children ended, record stopped."""
    import signal

    from mopflow.base import stopping

    signum = stopping.stop_signal() or signal.SIGINT
    fail_dag_run(DAG_ID, record.airflow_run_id)
    killed = local_runs.kill_leftover_runs(*tracking, record.run_key)
    local_runs.end_child_processes()
    record.state, record.ended_at = "stopped", local_runs.now_iso()
    record.message = f"stopped by {signal.Signals(signum).name}"
    local_runs.save_record(home, record)
    log.info("mopflow run: run %s stopped; %d MLflow run(s) marked KILLED", record.run_key, killed)
    return local_runs.RunStopped(
        f"run {record.run_key} stopped by {signal.Signals(signum).name}; {local_runs.resume_hint(record)}",
        local_runs.exit_code(signum),
    )


def new_run_record(conf: Mapping[str, Any]) -> RunRecord:
    """A new run's record: its logical date now, its run id and key from it (as dag.test makes them)."""
    from datetime import UTC

    from airflow.models.dagrun import DagRun
    from airflow.utils.types import DagRunType

    logical = datetime.now(UTC)
    run_id = DagRun.generate_run_id(run_type=DagRunType.MANUAL, logical_date=logical, run_after=logical)
    return local_runs.started_record(DAG_ID, conf, run_id, logical)


def fail_dag_run(dag_id: str, run_id: str) -> None:
    """Mark an interrupted DAG run (and its unfinished task instances) failed in Airflow's DB."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import update

    with create_session() as session:
        session.execute(
            update(TaskInstance)
            .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
            .where(TaskInstance.state.not_in(["success", "failed", "skipped", "upstream_failed"]))
            .values(state=TaskInstanceState.FAILED)
        )
        session.execute(
            update(DagRun)
            .where(DagRun.dag_id == dag_id, DagRun.run_id == run_id, DagRun.state != DagRunState.SUCCESS)
            .values(state=DagRunState.FAILED)
        )


def forget_dag_run(dag_id: str, run_id: str) -> None:
    """Delete an unfinished DAG run from Airflow's DB so that ``dag.test()`` creates it again with
    the same run id (the MLflow runs, the study, shards and checkpoints are kept: they are keyed by
    the run key, which the run id gives)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import delete

    with create_session() as session:
        session.execute(
            delete(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        )
        session.execute(delete(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))


def ui_hints(settings: Any, summary: Mapping[str, Any]) -> dict[str, str]:
    """Commands that open the MLflow and Optuna UIs on this run's data."""
    from mopflow.base.optuna_storage import journal_path, redact_url, storage_kind

    optuna_url = settings.optuna_storage
    optuna_arg = journal_path(optuna_url) if storage_kind(optuna_url) == "journal" else redact_url(optuna_url)
    return {
        "mlflow": f"mlflow ui --backend-store-uri {settings.tracking_uri} --host 127.0.0.1 --port 5000",
        "optuna": f"optuna-dashboard {optuna_arg} --host 127.0.0.1 --port 8081",
    }
