"""Benchmark of the default demo on MNIST-1D: ensemble and student test accuracy, and its wall time.

What is measured
----------------
The default pipeline, exactly as ``make demo`` runs it: ``mopflow run --summary-json FILE`` (the
packaged ``infra/configs/demo.yaml`` and the default search space
``training/spaces/default.json``, the embedded defaults: SQLite for Airflow and MLflow, an
Optuna journal file, a 2-worker Dask ``LocalCluster``), started as a subprocess of this script
with ``MOPFLOW_HOME`` set to a fresh temporary directory, so that nothing from an earlier run
(generated shards, registered models, a champion to beat) is reused: every stage (shard, search,
ensemble, distill, register) runs from scratch, Airflow's metadata database is created as on a
first ``make demo``. The data is the published MNIST-1D split (5000 samples, seed 42: 4000
train, of which about 10% are held out for validation, and 1000 test).

Figures (from the summary JSON the run writes; accuracies on the 1000 test rows)
-------------------------------------------------------------------------------
* ``ensemble_test_acc``: the top-k ensemble (probability average of the best COMPLETE trials).
* ``student_test_acc``: the student the run registers (fp32), planned by ``plan_student`` within
  ``student_max_param_ratio`` x the ensemble's parameters: the distilled student, or its
  hard-label twin when that one has the better validation accuracy (which one: ``kept``).
* ``param_ratio``: student parameters / ensemble parameters.
* ``wall_s``: wall time of the whole ``mopflow run`` subprocess (start-up, Airflow's database
  migration, every stage, the summary), measured here with ``time.monotonic``.
* For information: the best trial, the trial counts (COMPLETE / PRUNED / FAIL), the hard-label
  student (same architecture, real rows only), the INT8 student, the student's architecture, and
  the seconds of each stage (from the run's log timestamps).

Targets (each printed as PASS/FAIL)
-----------------------------------
ensemble >= 0.98, student >= 0.97, wall <= 600 s (the demo's 10 minutes on 2 cores), student
parameters <= 10% of the ensemble's.

Output: a plain-text table on stdout, the target lines, and every figure in
``benchmarks/results/mnist1d_accuracy.json`` (with the CPU count, load averages, the config run
and the date; ``--out`` names another folder or file, and a ``--quick`` run writes there or into a temporary folder).
The exit status is 0 when every target passes (a ``--quick`` run: when it completes). The wall time is measured on a possibly shared machine: other processes running
at the same time slow the run down; the JSON records the load averages before and after.

Run it from the repository root::

    .venv/bin/python benchmarks/mnist1d_accuracy.py             # the default demo (~5-7 minutes on 2 cores)
    .venv/bin/python benchmarks/mnist1d_accuracy.py --quick --out /tmp/bench   # smoke test: every stage, tiny
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studies import harness  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "mnist1d_accuracy.json"
DEFAULT_CONFIG = REPO_ROOT / "infra" / "configs" / "demo.yaml"
DEFAULT_SPACE = REPO_ROOT / "training" / "spaces" / "default.json"
ENSEMBLE_TARGET = 0.98
STUDENT_TARGET = 0.97
WALL_TARGET_S = 600.0
MAX_PARAM_RATIO = 0.10
STAGES = ("shard", "search", "ensemble", "distill", "register")
# --quick: the pipeline at its smallest (every stage runs; the figures mean nothing)
QUICK = [
    "num_samples=1000",
    "n_shards=2",
    "n_trials=2",
    "epochs=1",
    "min_resource=1",
    "top_k=2",
    "distill_epochs=1",
]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def mopflow_command() -> list[str]:
    """The ``mopflow`` script of the interpreter running this (the venv's), else the module."""
    script = Path(sys.executable).with_name("mopflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mopflow.infra.cli"]


def stage_seconds(log_text: str) -> dict[str, float]:
    """Seconds of each stage, from its Airflow task's start to its end line in the run's log
    (``[DAG TEST] starting task_id=...`` / ``end task task_id=...``); a stage without both is absent."""
    stamp = re.compile(
        r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z?.*?\[DAG TEST\] (?:starting|end task) task_id=(\w+)",
        re.MULTILINE,
    )
    spans: dict[str, list[float]] = {}
    for match in stamp.finditer(log_text):
        task = match.group(2)
        if task in STAGES:
            t = datetime.fromisoformat(match.group(1)).timestamp()
            span = spans.setdefault(task, [t, t])
            span[0], span[1] = min(span[0], t), max(span[1], t)
    return {task: round(spans[task][1] - spans[task][0], 1) for task in STAGES if task in spans}


def full_log(console_text: str) -> str:
    """The run's full log, read from the file ``mopflow run`` names on its console (``full log:
    PATH``); the console text itself when it names none."""
    named = re.search(r"full log: (\S+)", console_text)
    path = Path(named.group(1)) if named else None
    return path.read_text(errors="replace") if path is not None and path.exists() else console_text


def run_demo(home: Path, summary_path: Path, log_path: Path, overrides: Sequence[str]) -> tuple[int, float]:
    """Run ``mopflow run`` (the demo's command) under ``MOPFLOW_HOME=home``; its output goes to
    ``log_path``. Returns the exit code and the wall seconds."""
    command = [*mopflow_command(), "run", "--summary-json", str(summary_path)]
    for item in overrides:
        command += ["--set", item]
    # the embedded defaults: no MOPFLOW_*, Airflow or MLflow setting of this shell reaches the run
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_"))}
    env["MOPFLOW_HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # as `make demo`
    print("running:", " ".join(command), f"(MOPFLOW_HOME={home})", flush=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        code = subprocess.run(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    return code, time.monotonic() - started


def format_table(row: dict[str, Any]) -> str:
    params = f"{row['student_params']}/{row['ensemble_params']} = {row['param_ratio']:.3f}"
    columns = ["ensemble_test_acc", "student_test_acc", "student/ensemble params", "wall_s"]
    cells = [
        [f"{row['ensemble_test_acc']:.4f}", f"{row['student_test_acc']:.4f}", params, f"{row['wall_s']:.1f}"]
    ]
    return "\n".join(harness.table_lines(columns, cells))


def run(
    out: Path | None, overrides: Sequence[str], keep: bool, quick: bool = False, home: Path | None = None
) -> int:
    started_at = datetime.now(UTC)
    keep = keep or home is not None
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="mopflow-mnist1d-bench-"))
    home.mkdir(parents=True, exist_ok=True)
    summary_path, log_path = home / "summary.json", home / "run.log"
    load_before = os.getloadavg()
    try:
        code, wall_s = run_demo(home, summary_path, log_path, overrides)
        load_after = os.getloadavg()
        log_text = log_path.read_text(errors="replace")
        if code != 0 or not summary_path.exists():
            print(log_text[-4000:])
            print(f"mopflow run failed with exit code {code} after {wall_s:.1f} s")
            return 1
        summary = json.loads(summary_path.read_text())
        ensemble, student = summary["ensemble"], summary["student"]
        row = {
            "ensemble_test_acc": float(ensemble["test_acc"]),
            "student_test_acc": float(student["test_acc"]),
            "ensemble_params": int(ensemble["num_params"]),
            "student_params": int(student["num_params"]),
            "param_ratio": float(student["param_ratio"]),
            "wall_s": wall_s,
        }
        targets = {
            "ensemble_test_acc": {
                "value": row["ensemble_test_acc"],
                "target": f">= {ENSEMBLE_TARGET}",
                "status": verdict(row["ensemble_test_acc"] >= ENSEMBLE_TARGET),
            },
            "student_test_acc": {
                "value": row["student_test_acc"],
                "target": f">= {STUDENT_TARGET}",
                "status": verdict(row["student_test_acc"] >= STUDENT_TARGET),
            },
            "wall_s": {
                "value": wall_s,
                "target": f"<= {WALL_TARGET_S:.0f}",
                "status": verdict(wall_s <= WALL_TARGET_S),
            },
            "param_ratio": {
                "value": row["param_ratio"],
                "target": f"<= {MAX_PARAM_RATIO}",
                "status": verdict(row["param_ratio"] <= MAX_PARAM_RATIO),
            },
        }
        stages = stage_seconds(full_log(log_text))
        best = summary["best_trial"]
        arch = student["arch"]
        lines = [
            f"ensemble test acc = {row['ensemble_test_acc']:.4f} (target >= {ENSEMBLE_TARGET})  "
            f"{targets['ensemble_test_acc']['status']}",
            f"student test acc = {row['student_test_acc']:.4f} (target >= {STUDENT_TARGET})  "
            f"{targets['student_test_acc']['status']}",
            f"wall = {wall_s:.1f} s (target <= {WALL_TARGET_S:.0f} s)  {targets['wall_s']['status']}",
            f"student params = {row['student_params']} / {row['ensemble_params']} = "
            f"{100 * row['param_ratio']:.1f}% (target <= {100 * MAX_PARAM_RATIO:.0f}%)  "
            f"{targets['param_ratio']['status']}",
            f"info: trials {summary['trials']}; ensemble members {ensemble['members']}; best trial "
            f"#{best['number']} val {best['val_acc']:.4f} test {best['test_acc']:.4f} "
            f"({best['params'].get('family')})",
            f"info: student {arch['family']} {arch['params']}, the {(student.get('kept') or {}).get('model', 'student')}"
            f" kept; hard-label student "
            f"{student.get('hard_label_test_acc') or float('nan'):.4f}; int8 student "
            f"{student.get('int8_test_acc') or float('nan'):.4f}",
            "info: stage seconds " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()),
            f"info: load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min)",
        ]
        header = (
            f"MNIST-1D default demo (mopflow run, {DEFAULT_CONFIG.relative_to(REPO_ROOT)}"
            f"{' with ' + ', '.join(overrides) if overrides else ''}): "
            f"{'' if any(o.startswith('num_samples=') for o in overrides) else 'test n=1000, '}"
            f"{os.cpu_count()} CPUs"
        )
        print(header)
        print(format_table(row))
        print()
        for line in lines:
            print(line)

        report = {
            "benchmark": "mnist1d_accuracy",
            "date": started_at.isoformat(timespec="seconds"),
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_before": list(load_before),
                "loadavg_after": list(load_after),
            },
            "settings": {
                "command": "mopflow run --summary-json FILE (fresh MOPFLOW_HOME)",
                "overrides": list(overrides),
                "config": DEFAULT_CONFIG.read_text(),
                "search_space": json.loads(DEFAULT_SPACE.read_text()),
            },
            "result": row,
            "targets": targets,
            "info": {
                "trials": summary["trials"],
                "best_trial": best,
                "ensemble": ensemble,
                "student": student,
                "stage_seconds": stages,
            },
            "printed": [header, format_table(row), *lines],
        }
        config = {
            "config": str(DEFAULT_CONFIG.relative_to(REPO_ROOT)),
            "overrides": list(overrides),
            "quick": quick,
        }
        harness.write_report(out, report, lead="\n", config=config)
        # a smoke test's figures are not the demo's: it passes by completing
        return 0 if quick or all(t["status"] == "PASS" for t in targets.values()) else 1
    finally:
        if keep:
            print(f"kept the run's MOPFLOW_HOME at {home} (log: {log_path})")
        else:
            shutil.rmtree(home, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(__doc__, " ".join(QUICK) + " (before any --set)")
    parser.add_argument("--keep", action="store_true", help="keep the run's MOPFLOW_HOME and log")
    harness.add_pipeline_options(parser)
    args = parser.parse_args(argv)
    overrides = [*QUICK, *args.overrides] if args.quick else args.overrides
    return run(results_file(args.out, args.quick), overrides, args.keep, args.quick, args.home)


def results_file(out: Path | None, quick: bool) -> Path:
    """Where the JSON goes (:func:`studies.harness.results_file`)."""
    return harness.results_file(out, quick, RESULTS_PATH)


if __name__ == "__main__":
    sys.exit(main())
