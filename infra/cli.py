"""The ``mopflow`` command: the operator's entry point (the face of ``infra``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from infra import airflow_home
from infra.airflow_home import embedded_airflow_env
from infra.local_runs import RunEnded

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = Path(__file__).with_name("configs") / "demo.yaml"
DAG_ID = "mopflow_retrain"

log = logging.getLogger("mopflow")


class CliError(RuntimeError):
    """A user-facing error: printed without a traceback, exit code 2."""


def setup_logging() -> None:
    """Progress of our stages at INFO; chatty libraries at WARNING."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for noisy in (
        "distributed",
        "tornado",
        "alembic",
        "optuna",
        "pytorch_lightning",
        "lightning",
        "mlflow",
        "urllib3",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_config_file(path: str | None) -> dict[str, Any]:
    """Read a flat YAML/JSON config (the DAG's Params); None reads the packaged default."""
    file = Path(path) if path else DEFAULT_CONFIG
    try:
        text = file.read_text()
    except OSError as exc:
        raise CliError(f"cannot read config file {file}: {exc}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise CliError(f"config file {file} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CliError(f"config file {file} must hold a mapping of settings, got {type(data).__name__}")
    return data


def airflow_env(airflow_home: str) -> dict[str, str]:
    """Environment for the embedded Airflow of ``mopflow run`` (the venv's scripts on PATH)."""
    env = embedded_airflow_env(airflow_home, os.environ)
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        env["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return env


def migrate_airflow_db(env: Mapping[str, str]) -> None:
    """``airflow db migrate`` (idempotent) so that dag.test() has its metadata DB."""
    try:
        airflow_home.migrate_airflow_db(env, str(Path(sys.executable).parent))
    except airflow_home.AirflowSetupError as exc:
        raise CliError(str(exc)) from exc


def run_pipeline(conf: Mapping[str, Any], resume: str | None = None, verbose: bool = True) -> dict[str, Any]:
    """Run the retraining DAG once through ``dag.test()`` (the product path) and return its summary.

    ``resume`` (a run key, or ``""`` for the latest unfinished run) runs an earlier run again
    with its conf instead. SIGINT/SIGTERM stop the run (:mod:`infra.local_runs`): ``RunStopped``.
    Unless ``verbose``, the logs go to ``$MOPFLOW_HOME/logs/<run key>.log`` and the terminal
    shows the run's progress (:mod:`infra.progress`).
    """
    from infra import local_runs, progress, stopping, storage
    from infra.settings import Settings
    from infra.stages.config import ConfigError, PipelineConfig

    settings = Settings.from_env()
    record = local_runs.find_resumable(settings.home, resume or None) if resume is not None else None
    conf = dict(record.conf) if record is not None else dict(conf)
    try:
        PipelineConfig.from_conf(conf)  # refuse bad input before anything starts
    except ConfigError as exc:
        raise CliError(f"invalid config: {exc}") from exc
    timeout_s = local_runs.stop_timeout_s()
    env = airflow_env(settings.airflow_home)
    os.environ.update(env)
    migrate_airflow_db(env)

    import importlib.util

    dag_file = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "retrain.py"
    spec = importlib.util.spec_from_file_location("mopflow_dag_retrain", dag_file)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load the DAG file {dag_file}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dag = next(v for v in vars(module).values() if getattr(v, "dag_id", None) == DAG_ID)
    if record is None:
        record = new_run_record(conf)
    else:
        forget_dag_run(DAG_ID, record.airflow_run_id)  # dag.test makes it again, same id
        record.resumed += 1
        record.state, record.ended_at, record.message = "running", "", ""
        log.info("mopflow run: resuming run %s (attempt %d)", record.run_key, record.resumed + 1)
    local_runs.save_record(settings.home, record)
    stopping.reset()
    tracking = (settings.tracking_uri, settings.experiment_name)
    first, second = local_runs.stopping_handlers(record, settings.home, tracking, timeout_s, fail_dag_run)
    started = time.monotonic()
    when = datetime.fromisoformat(record.logical_date)
    dag_run = None
    log_file = local_runs.log_file_of(settings.home, record.run_key)
    if not verbose:
        print(
            f"mopflow run: run key {record.run_key}; full log: {log_file} (--verbose streams it)", flush=True
        )
    try:
        with (
            local_runs.run_output(log_file, verbose) as terminal,
            progress.ProgressView(terminal, live=terminal.isatty())
            if not verbose
            else contextlib.nullcontext(),
            local_runs.owned_signals(first, second),
        ):
            log.info("mopflow run: running DAG %s once (dag.test), run key %s", DAG_ID, record.run_key)
            dag_run = dag.test(run_conf=conf, logical_date=when, run_after=when)
    except stopping.PipelineStopped:
        pass  # between tasks: the DAG run is closed below
    wall = time.monotonic() - started
    if stopping.stop_requested():
        raise _stopped(record, settings, tracking)
    state = str(getattr(dag_run, "state", "unknown"))
    summary_uri = storage.join(settings.artifact_root, "runs", record.run_key, "summary.json")
    if not state.endswith("success") or not storage.exists(summary_uri, settings.storage_options):
        from infra.stages import read_failure

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
    summary: dict[str, Any] = storage.read_json(summary_uri, settings.storage_options)
    summary["wall_time_s"] = round(wall, 1)
    summary["how_to_open"] = ui_hints(settings, summary)
    summary["resumed"] = record.resumed
    summary["log_file"] = "" if verbose else str(log_file)
    return summary


def _stopped(record: Any, settings: Any, tracking: tuple[str, str]) -> Exception:
    """Close a stopped run: DAG run failed, MLflow runs KILLED, children ended, record stopped."""
    import signal

    from infra import local_runs, stopping

    signum = stopping.stop_signal() or signal.SIGINT
    fail_dag_run(DAG_ID, record.airflow_run_id)
    killed = local_runs.kill_leftover_runs(*tracking, record.run_key)
    local_runs.end_child_processes()
    record.state, record.ended_at = "stopped", local_runs.now_iso()
    record.message = f"stopped by {signal.Signals(signum).name}"
    local_runs.save_record(settings.home, record)
    log.info("mopflow run: run %s stopped; %d MLflow run(s) marked KILLED", record.run_key, killed)
    return local_runs.RunStopped(
        f"run {record.run_key} stopped by {signal.Signals(signum).name}; {local_runs.resume_hint(record)}",
        local_runs.exit_code(signum),
    )


def new_run_record(conf: Mapping[str, Any]) -> Any:
    """A new run's record: its logical date now, its run id and key from it (as dag.test makes them)."""
    from datetime import UTC

    from airflow.models.dagrun import DagRun
    from airflow.utils.types import DagRunType

    from infra import local_runs

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
    from infra.optuna_storage import journal_path, redact_url, storage_kind

    optuna_url = settings.optuna_storage
    optuna_arg = journal_path(optuna_url) if storage_kind(optuna_url) == "journal" else redact_url(optuna_url)
    return {
        "mlflow": f"mlflow ui --backend-store-uri {settings.tracking_uri} --host 127.0.0.1 --port 5000",
        "optuna": f"optuna-dashboard {optuna_arg} --host 127.0.0.1 --port 8081",
    }


def _arch_params(arch: dict[str, Any]) -> str:
    """A model's family params as ``name=value`` pairs (the width/depth form of older summaries too)."""
    params = arch.get("params") or {k: arch[k] for k in ("width", "depth") if k in arch}
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()))


def format_summary(summary: Mapping[str, Any]) -> str:
    """The human-readable summary that `mopflow run` prints."""
    best = summary["best_trial"]
    ens = summary["ensemble"]
    stu = summary["student"]
    reg = summary["registered"]
    trials = summary["trials"]
    lines = [
        "",
        "mopflow run summary",
        "===================",
        f"trials           : {trials.get('COMPLETE', 0)} complete, {trials.get('PRUNED', 0)} pruned, {trials.get('FAIL', 0)} failed",
        f"best trial       : #{best['number']} {best['params']}",
        f"                   val_acc={best['val_acc']:.4f}  test_acc={best['test_acc']:.4f}",
        f"ensemble         : trials {ens['members']}  test_acc={ens['test_acc']:.4f}  params={ens['num_params']}",
        f"student          : {stu['arch']['family']} {_arch_params(stu['arch'])}"
        f"  test_acc={stu['test_acc']:.4f}  params={stu['num_params']}"
        f" ({100 * stu['param_ratio']:.1f}% of the ensemble's {ens['num_params']})",
        f"registered model : {reg['name']} version {reg['version']} aliases {reg['aliases']}",
        f"                   promotion: {reg['reason']}",
        f"MLflow           : {summary['mlflow']['tracking_uri']} (experiment {summary['mlflow']['experiment']},"
        f" run {summary['mlflow']['parent_run_id']})",
        f"Optuna           : {summary['optuna']['storage']} (study {summary['optuna']['study_name']})",
    ]
    hints = summary.get("how_to_open", {})
    if hints:
        lines += [f"open MLflow UI   : {hints['mlflow']}", f"open Optuna UI   : {hints['optuna']}"]
    if summary.get("resumed"):
        lines.append(
            f"resumed          : {summary['resumed']} time(s): shards reused, finished trials kept, "
            "interrupted ones continued from their checkpoints"
        )
    if summary.get("log_file"):
        lines.append(f"full log         : {summary['log_file']}")
    if "wall_time_s" in summary:
        lines.append(f"wall time        : {summary['wall_time_s']:.1f} s")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume is not None and (args.config or args.set):
        raise CliError("--resume continues a run with its own config; drop --config and --set")
    conf = load_config_file(args.config)
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--set expects KEY=VALUE, got {item!r}")
        conf[key] = yaml.safe_load(value)
    summary = run_pipeline(conf, args.resume, verbose=args.verbose)
    print(format_summary(summary))
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
        print(f"summary JSON     : {args.summary_json}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve models:/<model>@champion (MLflow's scoring protocol), reloading when the alias moves."""
    from infra.serve import NoChampion, serve
    from infra.settings import Settings

    if not 0.5 <= args.poll_s <= 3600:
        raise CliError(f"--poll-s {args.poll_s} must be between 0.5 and 3600 seconds")
    if not 1 <= args.port <= 65535:
        raise CliError(f"--port {args.port} is not a TCP port (1-65535)")
    settings = Settings.from_env()
    try:
        serve(settings.tracking_uri, args.model, args.host, args.port, args.poll_s, wait=args.wait)
    except NoChampion as exc:
        raise CliError(
            f"cannot serve {args.model}@champion from {settings.tracking_uri}: {exc} "
            "(register one with `mopflow run`, promote a version with `mopflow promote`, or pass --wait)"
        ) from exc
    except Exception as exc:
        from mlflow.exceptions import MlflowException

        if isinstance(exc, MlflowException):
            raise CliError(
                f"cannot serve {args.model}@champion from {settings.tracking_uri}: {exc.message} "
                "(register one with `mopflow run` or promote a version with `mopflow promote`)"
            ) from exc
        raise
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """List the runs `mopflow run` started on this machine, newest first."""
    from infra import local_runs
    from infra.settings import Settings

    print(local_runs.format_runs(local_runs.load_records(Settings.from_env().home)))
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    from infra.settings import SETTING_ENV, Settings

    settings = Settings.from_env().describe()
    for name, (env, help_text) in SETTING_ENV.items():
        print(f"{name:26} {env:28} {settings[name]}\n{'':26} {help_text}")
    from infra.stack import PORT_ENV, STACK_ENV

    print("\nlocal stack (mopflow up):")
    for name, (env, default) in PORT_ENV.items():
        print(f"{name + ' port':26} {env:28} {os.environ.get(env) or default}")
    for name, (env, help_text) in STACK_ENV.items():
        print(f"{name:26} {env:28} {os.environ.get(env, '')}\n{'':26} {help_text}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from infra.optuna_storage import journal_path, make_storage, storage_kind
    from infra.settings import Settings

    url = Settings.from_env().optuna_storage
    make_storage(url)  # creates an empty journal on a fresh machine (optuna-dashboard needs the file)
    target = journal_path(url) if storage_kind(url) == "journal" else url
    dash = Path(sys.executable).with_name("optuna-dashboard")
    cmd = [
        str(dash) if dash.exists() else "optuna-dashboard",
        target,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
    ]
    print("running:", " ".join(cmd))
    return subprocess.call(cmd)


def _registry_client() -> Any:
    from infra.settings import Settings
    from infra.tracking import MlflowTracker

    settings = Settings.from_env()
    return MlflowTracker(
        settings.tracking_uri, settings.experiment_name, settings.mlflow_artifact_location
    ).client


def cmd_promote(args: argparse.Namespace) -> int:
    from compression.registry import RegistryError, promote

    try:
        print(promote(_registry_client(), args.name, str(args.version)))
    except RegistryError as exc:
        raise CliError(str(exc)) from exc
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from compression.registry import RegistryError, rollback

    try:
        print(rollback(_registry_client(), args.name))
    except RegistryError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _spot_prices(args: argparse.Namespace) -> Any:
    """The price distribution named by the plan-spot flags (a trace gives its empirical distribution)."""
    from training.volatile.cost import GaussianPrices, UniformPrices, empirical_prices, load_price_trace

    if args.trace:
        return empirical_prices(load_price_trace(args.trace))
    if args.distribution == "uniform":
        if args.low is None or args.high is None:
            raise CliError("--distribution uniform needs --low and --high (prices per worker-hour)")
        return UniformPrices(low=args.low, high=args.high)
    if args.mean is None or args.std is None:
        raise CliError("--distribution gaussian needs --mean and --std (prices per worker-hour)")
    return GaussianPrices(mean=args.mean, std=args.std)


def cmd_plan_spot(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from training.volatile.cost import PriceError
    from training.volatile.spot_plan import (
        PlanError,
        SpotPlanConfig,
        format_report,
        plan_spot,
        report_as_dict,
    )

    constants: dict[str, Any] = {}
    for item in args.convergence or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--convergence expects KEY=VALUE, got {item!r}")
        constants[key.strip()] = yaml.safe_load(value)
    try:
        config = SpotPlanConfig(
            prices=_spot_prices(args),
            deadline_hours=args.deadline_hours,
            error_target=args.error_target,
            n_max=args.n_max,
            on_demand_price=args.on_demand_price,
            iteration_seconds=args.iteration_seconds,
            max_bid=args.max_bid,
            convergence=constants,
        )
        report = plan_spot(config)
    except ValidationError as exc:
        raise CliError(f"invalid plan-spot input: {exc}") from exc
    except (PriceError, PlanError) as exc:
        raise CliError(str(exc)) from exc
    print(format_report(config, report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report_as_dict(config, report), indent=2, sort_keys=True))
    return 0


def _add_plan_spot_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan-spot",
        help="plan a run on spot workers: on-demand, one bid or two bids, and how many workers",
        description="Expected cost and completion time of on-demand, one-bid and two-bid plans"
        " (Zhang et al., INFOCOM 2020); prints the cheapest that meets the deadline and error target.",
    )
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--distribution", choices=("uniform", "gaussian"), default="uniform")
    source.add_argument(
        "--trace", help="CSV of timestamp,price: plan on its time-weighted price distribution"
    )
    plan.add_argument("--low", type=float, help="uniform: lowest price per worker-hour")
    plan.add_argument("--high", type=float, help="uniform: highest price per worker-hour")
    plan.add_argument("--mean", type=float, help="gaussian: mean price per worker-hour (truncated at 0)")
    plan.add_argument("--std", type=float, help="gaussian: standard deviation")
    plan.add_argument("--deadline-hours", type=float, required=True, help="expected completion time allowed")
    plan.add_argument("--error-target", type=float, required=True, help="error bound to reach (epsilon)")
    plan.add_argument("--n-max", type=int, default=16, help="most workers (default 16)")
    plan.add_argument("--on-demand-price", type=float, required=True, help="on-demand price per worker-hour")
    plan.add_argument(
        "--iteration-seconds", type=float, default=1.0, help="seconds per iteration (default 1)"
    )
    plan.add_argument("--max-bid", type=float, help="highest bid allowed (default: the on-demand price)")
    plan.add_argument(
        "--convergence",
        action="append",
        metavar="KEY=VALUE",
        help="error-bound constant: step_size, c, mu, lipschitz, noise, initial_gap (repeatable)",
    )
    plan.add_argument("--json", help="also write the plan as JSON to this file")
    plan.set_defaults(func=cmd_plan_spot)


def _stack_call(fn: Any, *args: Any) -> Any:
    """Run a stack function, turning its errors into CLI errors (printed, exit code 2)."""
    from infra.settings import SettingsError
    from infra.stack import StackError

    try:
        return fn(*args)
    except (StackError, SettingsError) as exc:
        raise CliError(str(exc)) from exc


def cmd_up(args: argparse.Namespace) -> int:
    from infra import stack
    from infra.settings import Settings

    def start() -> object:
        settings = Settings.from_env()
        requested = {name: getattr(args, f"{name}_port") for name in stack.PORT_ENV}
        workers = args.dask_workers or settings.dask_workers
        config = stack.config_from_env(
            os.environ, requested, args.free_ports, workers, stack.free_port, mlflow_auth=args.auth
        )
        if args.timeout is not None:
            config = config.model_copy(update={"timeout_s": args.timeout})
        return stack.up(settings, config, os.environ)

    _stack_call(start)
    return 0


def _stack_home() -> str:
    from infra.settings import Settings

    return Settings.from_env().home


def cmd_down(args: argparse.Namespace) -> int:
    from infra import stack

    def stop() -> object:
        grace = args.grace
        if grace is None:
            grace = stack.config_from_env(os.environ, {}, True, 1, stack.free_port).grace_s
        return stack.down(_stack_home(), grace)

    _stack_call(stop)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from infra import stack

    healthy = _stack_call(stack.status, _stack_home())
    return 0 if healthy else 1


def _port_flags() -> dict[str, tuple[str, int]]:
    from infra.stack import PORT_ENV

    return PORT_ENV


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mopflow", description="Model selection, ensembling and distillation on Airflow"
    )
    parser.add_argument(
        "--profile",
        help="backends profile: embedded (default) or scale-out (infra/profiles/); or set MOPFLOW_PROFILE",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the retraining DAG once on this machine (dag.test)")
    run.add_argument("--config", help="flat YAML/JSON config (default: the packaged demo config)")
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override one config key (repeatable)"
    )
    run.add_argument("--summary-json", help="also write the summary as JSON to this file")
    run.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="RUN_KEY",
        help="continue a stopped or failed run (default: the latest unfinished one) with its config",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="stream Airflow's, Dask's and the stages' logs instead of the progress view",
    )
    run.set_defaults(func=cmd_run)
    srv = sub.add_parser("serve", help="serve the champion over HTTP, following its alias as it moves")
    srv.add_argument(
        "--model", default="mopflow-student", help="registered model name (default mopflow-student)"
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=5001)
    srv.add_argument("--poll-s", type=float, default=5.0, help="seconds between checks of the champion alias")
    srv.add_argument(
        "--wait",
        action="store_true",
        help="start even without a champion and serve it once the alias exists (as `mopflow up` does)",
    )
    srv.set_defaults(func=cmd_serve)
    runs = sub.add_parser("runs", help="list recent `mopflow run` runs with their state and key")
    runs.set_defaults(func=cmd_runs)
    show = sub.add_parser("settings", help="show the effective settings and their environment variables")
    show.set_defaults(func=cmd_settings)
    keys = sub.add_parser(
        "config-keys",
        help="print the pipeline config keys as a Markdown table (docs/user-guide/configuration.md)",
    )
    keys.set_defaults(func=cmd_config_keys)
    dash = sub.add_parser("dashboard", help="open optuna-dashboard on the study storage")
    dash.add_argument("--port", type=int, default=8081)
    dash.set_defaults(func=cmd_dashboard)
    prom = sub.add_parser("promote", help="make a registered model version the champion")
    prom.add_argument("name", help="registered model name, e.g. mopflow-student")
    prom.add_argument("version", help="model version number")
    prom.set_defaults(func=cmd_promote)
    back = sub.add_parser("rollback", help="bring the previous champion back")
    back.add_argument("name", help="registered model name, e.g. mopflow-student")
    back.set_defaults(func=cmd_rollback)
    _add_plan_spot_parser(sub)
    up = sub.add_parser(
        "up", help="start the local stack: Airflow, MLflow, optuna-dashboard, Dask (127.0.0.1)"
    )
    for name, (var, default) in _port_flags().items():
        up.add_argument(
            f"--{name.replace('_', '-')}-port",
            dest=f"{name}_port",
            type=int,
            help=f"port of {name.replace('_', ' ')} (env {var}, default {default})",
        )
    up.add_argument(
        "--free-ports",
        action="store_true",
        default=None,
        help="pick free ports for those not given (env MOPFLOW_STACK_FREE_PORTS=1)",
    )
    up.add_argument("--dask-workers", type=int, help="Dask worker processes (default MOPFLOW_DASK_WORKERS)")
    up.add_argument("--timeout", type=float, help="seconds to wait for the health checks (default 300)")
    up.add_argument(
        "--auth",
        action="store_true",
        default=None,
        help="run MLflow's basic-auth app; tasks and workers get the generated admin credentials (env MOPFLOW_STACK_AUTH=1)",
    )
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the local stack started by `mopflow up`")
    down.add_argument("--grace", type=float, help="seconds between SIGTERM and SIGKILL (default 20)")
    down.set_defaults(func=cmd_down)
    stat = sub.add_parser("status", help="show which services of the local stack run and answer")
    stat.set_defaults(func=cmd_status)
    return parser


def cmd_config_keys(args: argparse.Namespace) -> int:
    """Print every pipeline config key with its default and meaning (the table in
    docs/user-guide/configuration.md)."""
    from infra.stages.config import conf_markdown_table

    print(conf_markdown_table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mopflow`` command."""
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        from infra.profile import ProfileError, apply_profile

        try:  # before anything reads settings or imports Airflow
            applied = apply_profile(os.environ, args.profile)
        except ProfileError as exc:
            raise CliError(str(exc)) from exc
        if applied:
            log.info("profile %s: %s", os.environ.get("MOPFLOW_PROFILE"), ", ".join(sorted(applied)))
        return int(args.func(args))
    except CliError as exc:
        print(f"mopflow: {exc}", file=sys.stderr)
        return 2
    except RunEnded as exc:  # stopped (130/143) or failed (2: bad input, 1: otherwise)
        print(f"mopflow: {exc}", file=sys.stderr)
        return exc.code
    except Exception as exc:
        from infra.stages.config import ConfigError

        if isinstance(exc, ConfigError):
            print(f"mopflow: invalid config: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
