"""Benchmark of a student chosen for a serving budget: the demo on MNIST-1D, three ways.

What is measured
----------------
Three whole ``mopflow run`` s of the demo (its config, MNIST-1D, the embedded defaults), each in a
fresh ``MOPFLOW_HOME``, one after another:

1. ``default``: the demo as it is; its student is the widest ``rescnn`` of depth 4 within 10% of
   the ensemble's parameters. Its summary gives the kept student's serving latency, timed as a
   server loads the registered model (``mlflow.pyfunc.load_model``, one CPU thread, requests of
   ``student_batch`` rows, default 256: 5 untimed, then 40 timed, p50 and p95).
2. ``budget``: the same with ``student_budget_ms`` set to ``--fraction`` (default 0.5) of the
   default student's p95: the widest ``rescnn`` of depth 4 within the budget (a bisection of
   timings before training).
3. ``search``: the same budget with ``student_trials`` (``--trials``, default 8): a
   two-objective search over the student families, depths and widths; the registered student is
   the most accurate candidate on the Pareto front within the budget.

Per run: the student's test accuracy, parameters, p50 and p95 latency, the budget, the wall
seconds of the run, and for the search every candidate and the front. The runs share the
demo's seed, so their searches and ensembles are the same; only the student differs.

Targets (printed as PASS/FAIL), for each budgeted run: its student's p95, as the summary has
it (timed again after training), within the budget; its test accuracy within 1 point of the
default student's. A budgeted run whose budget no student it may take meets fails at once
(``StudentBudgetError``, naming the budget and the fastest candidate): the table names the
failure and both its targets FAIL.

Output: a plain-text table on stdout and every figure in
``benchmarks/results/student_budget.json``. Latencies are wall-clock on a shared machine: other
processes running at the same time inflate them.

Run it from the repository root::

    .venv/bin/python benchmarks/student_budget.py     # three demo runs: several minutes
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mnist1d_accuracy import run_demo
from studies import harness

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "student_budget.json"
MAX_ACCURACY_LOSS = 0.01  # of the default student's test accuracy


def run_arm(name: str, overrides: Sequence[str], root: Path) -> dict[str, Any]:
    """One ``mopflow run`` with ``overrides``; its student's figures from the run's summary."""
    home = root / name
    home.mkdir(parents=True)
    code, wall_s = run_demo(home, home / "summary.json", home / "run.log", overrides)
    if code != 0 or not (home / "summary.json").exists():
        console = (home / "run.log").read_text(errors="replace")
        failed = re.search(r"^mopflow: run \w+ failed: (.*)$", console, re.MULTILINE)
        if failed is None:
            raise SystemExit(f"{name}: mopflow run failed with exit code {code}\n{console[-3000:]}")
        # a budget no student meets fails the run: a result of the arm, not of the benchmark
        return {
            "arm": name,
            "overrides": list(overrides),
            "error": failed.group(1),
            "wall_s": round(wall_s, 1),
        }
    summary = json.loads((home / "summary.json").read_text())
    student, latency = summary["student"], summary["student"]["latency"]
    return {
        "arm": name,
        "overrides": list(overrides),
        "family": student["arch"]["family"],
        "params": student["arch"]["params"],
        "num_params": int(student["num_params"]),
        "test_acc": float(student["test_acc"]),
        "kept": student["kept"]["student"],
        "p50_ms": float(latency["p50_ms"]),
        "p95_ms": float(latency["p95_ms"]),
        "budget_ms": latency["budget_ms"],
        "ensemble_test_acc": float(summary["ensemble"]["test_acc"]),
        "wall_s": round(wall_s, 1),
        "search": student.get("search"),
    }


def targets(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Each budgeted run against its budget and the default student's accuracy."""
    default = next(r for r in rows if r["arm"] == "default")
    found = {}
    for row in rows:
        if "error" in row:
            found[row["arm"]] = {"meets the budget": "FAIL", "within 1 point of the default": "FAIL"}
            continue
        if row["budget_ms"] is None:
            continue
        loss = default["test_acc"] - row["test_acc"]
        found[row["arm"]] = {
            "meets the budget": "PASS" if row["p95_ms"] <= row["budget_ms"] else "FAIL",
            "within 1 point of the default": "PASS" if loss <= MAX_ACCURACY_LOSS else "FAIL",
        }
    return found


def _params(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k} {v}" for k, v in params.items())


COLUMNS = ("arm", "student", "params", "test_acc", "p50 ms", "p95 ms", "budget ms", "kept", "wall s")


def table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    done = [r for r in rows if "error" not in r]
    cells = [
        [
            r["arm"],
            f"{r['family']} {_params(r['params'])}",
            r["num_params"],
            f"{r['test_acc']:.4f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p95_ms']:.2f}",
            "-" if r["budget_ms"] is None else f"{r['budget_ms']:.2f}",
            r["kept"],
            f"{r['wall_s']:.0f}",
        ]
        for r in done
    ]
    lines = harness.table_lines(COLUMNS, cells)
    lines += [
        f"{r['arm']}: the run failed after {r['wall_s']:.0f} s: {r['error']}" for r in rows if "error" in r
    ]
    for r in done:
        if r["search"]:
            front = {c["number"]: c for c in r["search"]["candidates"]}
            lines.append(f"{r['arm']}: the Pareto front (chosen: candidate {r['search']['chosen']})")
            for number in r["search"]["front"]:
                c = front[number]
                lines.append(
                    f"  #{number} {c['family']} {_params(c['params'])}: "
                    f"val_acc {c['val_acc']:.4f}, p95 {c['latency_p95_ms']:.2f} ms, {c['num_params']} params"
                )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(__doc__, "not offered: every arm is a whole demo run")
    parser.add_argument(
        "--fraction", type=float, default=0.5, help="the budget, a fraction of the default p95"
    )
    parser.add_argument("--trials", type=int, default=8, help="student_trials of the search arm")
    settings = parser.parse_args(argv)
    if settings.quick:
        parser.error("--quick: every arm is a whole demo run; there is no smoke run")
    if not 0 < settings.fraction <= 1 or settings.trials < 1:
        parser.error("--fraction must be in (0, 1] and --trials >= 1")
    out = harness.results_file(settings.out, False, RESULTS_PATH)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mopflow-student-budget-") as folder:
        root = Path(folder)
        rows = [run_arm("default", [], root)]
        if "error" in rows[0]:
            raise SystemExit(f"the default demo run failed: {rows[0]['error']}")
        budget = round(settings.fraction * rows[0]["p95_ms"], 3)
        rows.append(run_arm("budget", [f"student_budget_ms={budget}"], root))
        rows.append(
            run_arm("search", [f"student_budget_ms={budget}", f"student_trials={settings.trials}"], root)
        )
    print("\n".join(table(rows)))
    found = targets(rows)
    for arm, verdict in found.items():
        print(f"{arm}: " + ", ".join(f"{k}: {v}" for k, v in verdict.items()))
    report = {
        "benchmark": "student_budget",
        "date": harness.now(),
        "machine": harness.machine(load_before) | {"cpu": harness.cpu()},
        "settings": {k: v for k, v in vars(settings).items() if k != "out"},
        "targets": {"max_accuracy_loss": MAX_ACCURACY_LOSS, "status": found},
        "rows": rows,
    }
    harness.write_report(out, report, lead="\n", config=report["settings"], seeds=[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
