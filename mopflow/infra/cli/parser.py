"""The ``mopflow`` command line: its subcommands and flags, each bound to the function that runs
it, and ``main``, which turns the operator's errors into messages and exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mopflow.base.airflow_home import AirflowSetupError
from mopflow.base.extras import MissingExtraError, require_extras_of
from mopflow.base.heap import freeze_long_lived
from mopflow.base.settings import SettingsError
from mopflow.infra.cli.airflow_integration import cmd_dags_install, cmd_dags_path
from mopflow.infra.cli.errors import CliError
from mopflow.infra.cli.info import cmd_config_keys, cmd_dashboard, cmd_settings
from mopflow.infra.cli.local_runs import RunEnded
from mopflow.infra.cli.registry import cmd_promote, cmd_rollback, cmd_serve
from mopflow.infra.cli.run import cmd_run, cmd_runs
from mopflow.infra.cli.spot import cmd_plan_spot
from mopflow.infra.cli.stack_commands import cmd_down, cmd_status, cmd_up, cmd_worker_env

log = logging.getLogger("mopflow")


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


def build_parser() -> argparse.ArgumentParser:
    """The ``mopflow`` parser; each subcommand's ``func`` runs it."""
    parser = argparse.ArgumentParser(
        prog="mopflow", description="Model selection, ensembling and distillation on Airflow"
    )
    from mopflow import __version__

    parser.add_argument("--version", action="version", version=f"mopflow {__version__}")
    parser.add_argument(
        "--profile",
        help="backends profile: embedded (default) or scale-out (infra/profiles/); or set MOPFLOW_PROFILE",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_serve_parser(sub)
    _add_info_parsers(sub)
    _add_registry_parsers(sub)
    _add_plan_spot_parser(sub)
    _add_stack_parsers(sub)
    _add_dags_parsers(sub)
    return parser


def _add_run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run the retraining DAG once on this machine (dag.test)")
    run.add_argument("--config", help="flat YAML/JSON config (default: the packaged demo config)")
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override one config key (repeatable)"
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the config the run would use and its warm-start decision, then stop (exit 2 if invalid)",
    )
    run.add_argument(
        "--data-root",
        action="append",
        metavar="FOLDER",
        help="also let this run read its dataset from FOLDER (or URL prefix), besides MOPFLOW_DATA_ROOTS (repeatable)",
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


def _add_serve_parser(sub: Any) -> None:
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


def _add_info_parsers(sub: Any) -> None:
    """``runs``, ``settings``, ``config-keys`` and ``dashboard``: what this machine has."""
    runs = sub.add_parser("runs", help="list recent `mopflow run` runs with their state and key")
    _add_format_flag(runs)
    runs.set_defaults(func=cmd_runs)
    show = sub.add_parser("settings", help="show the effective settings and their environment variables")
    _add_format_flag(show)
    show.set_defaults(func=cmd_settings)
    keys = sub.add_parser(
        "config-keys",
        help="print the pipeline config keys as a Markdown table (docs/user-guide/configuration.md)",
    )
    _add_format_flag(keys)
    keys.set_defaults(func=cmd_config_keys)
    dash = sub.add_parser("dashboard", help="open optuna-dashboard on the study storage")
    dash.add_argument("--port", type=int, default=8081)
    dash.set_defaults(func=cmd_dashboard)


def _add_registry_parsers(sub: Any) -> None:
    prom = sub.add_parser("promote", help="make a registered model version the champion")
    prom.add_argument("name", help="registered model name, e.g. mopflow-student")
    prom.add_argument("version", help="model version number")
    prom.set_defaults(func=cmd_promote)
    back = sub.add_parser("rollback", help="bring the previous champion back")
    back.add_argument("name", help="registered model name, e.g. mopflow-student")
    back.set_defaults(func=cmd_rollback)


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


def _port_flags() -> dict[str, tuple[str, int]]:
    from mopflow.infra.stack import PORT_ENV

    return PORT_ENV


def _add_stack_parsers(sub: Any) -> None:
    """``up``, ``down``, ``status`` and ``worker-env`` of the local stack."""
    up = sub.add_parser(
        "up", help="start the local stack: Airflow, MLflow, optuna-dashboard, Dask (127.0.0.1 or --host)"
    )
    up.add_argument(
        "--host",
        metavar="ADDR",
        help="address every service binds and advertises, this host's own for workers on other hosts "
        "(env MOPFLOW_STACK_HOST, default 127.0.0.1; not 0.0.0.0)",
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
    _add_format_flag(stat)
    stat.set_defaults(func=cmd_status)
    wenv = sub.add_parser(
        "worker-env",
        help="print the settings an Airflow worker on another host needs to join the stack (<home>/stack/worker.env)",
    )
    _add_format_flag(wenv)
    wenv.set_defaults(func=cmd_worker_env)


def _add_format_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--format", choices=("text", "json"), default="text", help="text for people (default), or json"
    )


def _add_dags_parsers(sub: Any) -> None:
    """``dags install`` and ``dags path``: mopflow's DAGs in an Airflow of the user's own."""
    dags = sub.add_parser("dags", help="mopflow's DAGs in your own Airflow deployment")
    dags_sub = dags.add_subparsers(dest="dags_command", required=True)
    install = dags_sub.add_parser(
        "install", help="write a loader file into an Airflow DAGs folder that imports mopflow's DAGs"
    )
    install.add_argument("folder", metavar="DAGS_FOLDER", help="the Airflow deployment's [core] dags_folder")
    install.add_argument("--force", action="store_true", help="replace a file of the same name")
    install.set_defaults(func=cmd_dags_install)
    path = dags_sub.add_parser("path", help="print the DAGs folder `mopflow run` and `mopflow up` use")
    path.set_defaults(func=cmd_dags_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mopflow`` command."""
    import argcomplete

    parser = build_parser()
    argcomplete.autocomplete(parser)  # answers a shell's completion request and exits
    args = parser.parse_args(argv)
    setup_logging()
    try:
        from mopflow.infra.stack.profile import ProfileError, apply_profile

        try:  # before anything reads settings or imports Airflow
            applied = apply_profile(os.environ, args.profile)
        except ProfileError as exc:
            raise CliError(str(exc)) from exc
        if applied:
            log.info("profile %s: %s", os.environ.get("MOPFLOW_PROFILE"), ", ".join(sorted(applied)))
        require_extras_of(os.environ)  # PostgreSQL, S3, Celery: their extras, before anything starts
        return int(args.func(args))
    # bad input, an Airflow DB not migrated, an extra the set-up needs
    except (CliError, AirflowSetupError, SettingsError, MissingExtraError) as exc:
        print(f"mopflow: {exc}", file=sys.stderr)
        return 2
    except RunEnded as exc:  # stopped (130/143) or failed (2: bad input, 1: otherwise)
        print(f"mopflow: {exc}", file=sys.stderr)
        return exc.code
    except Exception as exc:
        from mopflow.pipeline.config import ConfigError

        if isinstance(exc, ConfigError):
            print(f"mopflow: invalid config: {exc}", file=sys.stderr)
            return 2
        raise
    finally:
        if argv is None:  # the command's own process, about to exit (a caller's keeps its collector)
            # The interpreter's last collection at exit walked a run's whole heap (3.5 s) to
            # free what exiting frees anyway.
            freeze_long_lived()
