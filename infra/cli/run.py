"""``mopflow run`` and ``mopflow runs``: the config a run starts from (a file and ``--set``
overrides), the summary it prints, and the list of runs on this machine."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mopflow.infra.cli.errors import CliError
from mopflow.infra.cli.pipeline import run_pipeline

DEFAULT_CONFIG = Path(__file__).parents[1] / "configs" / "demo.yaml"


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
    """Run the retraining DAG once on this machine (or resume a run) and print its summary."""
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


def cmd_runs(args: argparse.Namespace) -> int:
    """List the runs `mopflow run` started on this machine, newest first."""
    from mopflow.infra.base.settings import Settings
    from mopflow.infra.cli import local_runs

    print(local_runs.format_runs(local_runs.load_records(Settings.from_env().home)))
    return 0
