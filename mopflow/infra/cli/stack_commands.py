"""``mopflow up``, ``down``, ``status`` and ``worker-env``: the local stack (:mod:`mopflow.infra.stack`)
from the command line, its errors printed as the CLI's."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from mopflow.infra.cli.errors import CliError


def _stack_call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a stack function, turning its errors into CLI errors (printed, exit code 2)."""
    from mopflow.base.settings import SettingsError
    from mopflow.infra.stack import StackError

    try:
        return fn(*args)
    except (StackError, SettingsError) as exc:
        raise CliError(str(exc)) from exc


def _stack_home() -> str:
    from mopflow.base.settings import Settings

    return Settings.from_env().home


def cmd_up(args: argparse.Namespace) -> int:
    """Start the local stack with the ports and knobs of the flags and the environment."""
    from mopflow.base.settings import Settings
    from mopflow.infra import stack
    from mopflow.infra.stack.config import stack_host

    def start() -> object:
        settings = Settings.from_env()
        requested = {name: getattr(args, f"{name}_port") for name in stack.PORT_ENV}
        workers = args.dask_workers or settings.dask_workers
        host = stack_host(os.environ, args.host)  # free ports are those free on the stack's address

        def choose_config() -> Any:
            config = stack.config_from_env(
                os.environ,
                requested,
                args.free_ports,
                workers,
                lambda: stack.free_port(host),
                mlflow_auth=args.auth,
                host=args.host,
            )
            if args.timeout is not None:
                config = config.model_copy(update={"timeout_s": args.timeout})
            return config

        return stack.up_choosing_ports(settings, choose_config, os.environ)

    from mopflow.infra.cli.airflow_integration import check_plugin_loads, checked_dags_folder

    checked_dags_folder(os.environ)  # before any service starts: one line naming what is wrong
    check_plugin_loads({**os.environ, "AIRFLOW_HOME": Settings.from_env().airflow_home})
    _stack_call(start)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the local stack (``--grace``, else ``MOPFLOW_STACK_GRACE_S``, between SIGTERM and SIGKILL)."""
    from mopflow.infra import stack

    def stop() -> object:
        grace = args.grace
        if grace is None:  # the address is no concern of `down`: it stops what the state records
            config = stack.config_from_env(os.environ, {}, True, 1, stack.free_port, host=stack.DEFAULT_HOST)
            grace = config.grace_s
        return stack.down(_stack_home(), grace)

    _stack_call(stop)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Show the local stack's services; exit code 0 when every one is healthy."""
    from mopflow.infra import stack

    healthy = _stack_call(stack.status, _stack_home(), print, args.format == "json")
    return 0 if healthy else 1


def cmd_worker_env(args: argparse.Namespace) -> int:
    """Print the settings an Airflow worker on another host needs to join the stack (the file
    ``mopflow up`` wrote, or its variables as one JSON object)."""
    from mopflow.infra.stack.worker_env import read_worker_env

    text, env = _stack_call(read_worker_env, _stack_home())
    print(json.dumps(env, indent=2) if args.format == "json" else text.rstrip("\n"))
    return 0
