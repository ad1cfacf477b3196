"""Commands that show what this machine is set up with: the effective settings, the pipeline's
config keys, and the Optuna dashboard on the study storage."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def cmd_settings(args: argparse.Namespace) -> int:
    """Print the effective settings and the local stack's knobs with their environment variables."""
    from mopflow.base.settings import SETTING_ENV, Settings

    settings = Settings.from_env().describe()
    from mopflow.infra.stack import PORT_ENV, STACK_ENV

    if args.format == "json":
        out = {
            "settings": {
                name: {"env": env, "value": settings[name], "help": help_text}
                for name, (env, help_text) in SETTING_ENV.items()
            },
            "local_stack": {
                **{
                    f"{name}_port": {"env": env, "value": os.environ.get(env) or str(default)}
                    for name, (env, default) in PORT_ENV.items()
                },
                **{
                    name: {"env": env, "value": os.environ.get(env, ""), "help": help_text}
                    for name, (env, help_text) in STACK_ENV.items()
                },
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    for name, (env, help_text) in SETTING_ENV.items():
        print(f"{name:26} {env:28} {settings[name]}\n{'':26} {help_text}")
    print("\nlocal stack (mopflow up):")
    for name, (env, default) in PORT_ENV.items():
        print(f"{name + ' port':26} {env:28} {os.environ.get(env) or default}")
    for name, (env, help_text) in STACK_ENV.items():
        print(f"{name:26} {env:28} {os.environ.get(env, '')}\n{'':26} {help_text}")
    return 0


def cmd_config_keys(args: argparse.Namespace) -> int:
    """Print every pipeline config key with its default and meaning (the table in
    docs/user-guide/configuration.md)."""
    from mopflow.pipeline.config import RETRAIN_DEFAULTS, conf_json_schema, conf_markdown_table

    if args.format == "json":
        keys = {
            key: {
                "default": schema.get("default"),
                "description": schema.get("description", ""),
                "schema": schema,
            }
            for key, schema in conf_json_schema().items()
        }
        print(json.dumps({"keys": keys, "mopflow_retrain_defaults": RETRAIN_DEFAULTS}, indent=2))
        return 0
    print(conf_markdown_table())
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Run optuna-dashboard on the study storage (until it is stopped)."""
    from mopflow.base.extras import require_extra
    from mopflow.base.optuna_storage import journal_path, make_storage, storage_kind
    from mopflow.base.settings import Settings

    require_extra("stack", "mopflow dashboard (optuna-dashboard)")
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
