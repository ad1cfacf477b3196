"""``mopflow run`` and ``mopflow runs``: the config a run starts from (a file and ``--set``
overrides), the summary it prints, and the list of runs on this machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mopflow.infra.cli.errors import CliError
from mopflow.infra.cli.pipeline import run_pipeline
from mopflow.infra.cli.run_plan import plan_run


def _arch_params(arch: dict[str, Any]) -> str:
    """A model's family params as ``name=value`` pairs (the width/depth form of older summaries too)."""
    params = arch.get("params") or {k: arch[k] for k in ("width", "depth") if k in arch}
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()))


def _latency_lines(latency: Mapping[str, Any]) -> list[str]:
    """The student's serving latency (summaries before it was measured have none)."""
    if latency.get("p95_ms") is None:
        return []
    budget = latency.get("budget_ms")
    return [
        f"                   serves {latency['rows']} rows in p50 {latency['p50_ms']:.2f} ms, p95 "
        f"{latency['p95_ms']:.2f} ms on one CPU thread"
        + ("" if budget is None else f" (student_budget_ms {budget:g})")
    ]


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
        *(
            [
                f"                   the {stu['kept']['student'].replace('_', '-')} student: {stu['kept']['reason']}"
            ]
            if stu.get("kept")
            else []
        ),
        *_latency_lines(stu.get("latency") or {}),
        *(
            [
                f"                   chosen by a student search: candidate {stu['search']['chosen']} of "
                f"{len(stu['search']['candidates'])}, on a Pareto front of {len(stu['search']['front'])}"
            ]
            if stu.get("search")
            else []
        ),
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
    """Run the retraining DAG once on this machine (or resume a run) and print its summary; with
    ``--dry-run`` print the config it would run and stop."""
    if args.resume is not None and (args.config or args.set or args.dry_run):
        raise CliError("--resume continues a run with its own config; drop --config, --set and --dry-run")
    if args.resume is not None:
        summary = run_pipeline({}, args.resume, verbose=args.verbose)
    else:
        plan = plan_run(args.config, args.set or [], args.data_root or [], os.environ)
        for line in plan.describe():
            print(line)
        if args.dry_run:
            print(yaml.safe_dump(plan.config.to_conf(), sort_keys=True, default_flow_style=False).rstrip())
            return 0
        summary = run_pipeline(plan.conf, None, verbose=args.verbose, data_roots=plan.data_roots)
    print(format_summary(summary))
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
        print(f"summary JSON     : {args.summary_json}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """List the runs `mopflow run` started on this machine, newest first."""
    from mopflow.base.settings import Settings
    from mopflow.infra.cli import local_runs

    records = local_runs.load_records(Settings.from_env().home)
    if args.format == "json":
        print(json.dumps([dataclasses.asdict(record) for record in records], indent=2, default=str))
    else:
        print(local_runs.format_runs(records))
    return 0
