"""The registered models' commands: serve the champion over HTTP, promote a version to champion,
roll the champion back."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from mopflow.infra.cli.errors import CliError


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve models:/<model>@champion (MLflow's scoring protocol), reloading when the alias moves."""
    from mopflow.base.settings import Settings
    from mopflow.infra.stack.serve import NoChampion, serve

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


def _registry_client() -> Any:
    import mlflow  # noqa: F401  (configures its loggers at INFO when first imported)

    from mopflow.base.settings import Settings
    from mopflow.base.tracking import MlflowTracker

    # a registry command prints what it changed; MLflow's database set-up lines are not that
    logging.getLogger("mlflow").setLevel(logging.WARNING)

    settings = Settings.from_env()
    return MlflowTracker(
        settings.tracking_uri, settings.experiment_name, settings.mlflow_artifact_location
    ).client


def _print_registry_change(change: Any, *args: Any) -> int:
    """Run one registry change (promote, rollback) and print what it did; its refusal is a CliError."""
    from mopflow.registry.model_registry import RegistryError

    try:
        print(change(_registry_client(), *args))
    except RegistryError as exc:
        raise CliError(str(exc)) from exc
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Make a registered model version the champion."""
    from mopflow.registry.model_registry import promote

    return _print_registry_change(promote, args.name, str(args.version))


def cmd_rollback(args: argparse.Namespace) -> int:
    """Bring the previous champion back."""
    from mopflow.registry.model_registry import rollback

    return _print_registry_change(rollback, args.name)
