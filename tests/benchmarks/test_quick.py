"""Every benchmark's ``--quick`` run, end to end, as a subprocess: it completes, its JSON goes to a
temporary folder (``--out``) with the benchmark's figures in it, and the recorded results in
``benchmarks/results/`` stay as they were. The figures of a quick run mean nothing; what is
checked is what holds at any size (the shapes of the report, the invariants of the method)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.loader import BENCHMARKS_DIR, assert_not_written_over, load_benchmark, recorded_results
from tests.conftest import PORT_RANGE_ENV

RESULTS_DIR = BENCHMARKS_DIR / "results"
HEAD = subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=BENCHMARKS_DIR, capture_output=True, text=True, check=True
).stdout.strip()
STAGES = ["shard", "search", "ensemble", "distill", "register"]

Report = dict[str, Any]


def _fraction(value: Any) -> bool:
    return isinstance(value, float) and 0.0 <= value <= 1.0


def check_distill(report: Report, out: Path) -> None:
    assert report["settings"]["quick"] and report["settings"]["members"] == 2
    assert [m["state"] for m in report["members"]] == ["COMPLETE", "COMPLETE"]
    assert set(report["targets"]) == {"recovered_gain", "param_ratio", "student_speedup_b256", "int8"}
    student = report["student"]
    assert student["params"] <= student["budget"] <= 0.1 * report["ensemble"]["params"]
    assert report["targets"]["param_ratio"]["status"] == "PASS"  # the plan sizes it to the budget
    assert student["arch"]["family"] == "cnn" and set(student["arch"]["params"]) == {"width", "depth"}
    assert [row["model"] for row in report["rows"]][3:] == [
        "student (distilled)",
        "student (hard labels)",
        "student int8",
    ]
    for row in report["rows"]:
        assert _fraction(row["test_acc"]) and row["latency_ms_b1"] > 0 and row["latency_ms_b256"] > 0
    seed = student["per_seed"][0]
    assert all(_fraction(seed[k]) for k in ("distilled_test_acc", "hard_label_test_acc", "int8_test_acc"))


def check_overhead(report: Report, out: Path) -> None:
    summary = report["summary"]
    steps = math.ceil(report["settings"]["rows"] / report["settings"]["batch_size"])
    assert {loop: s["steps"] for loop, s in summary.items()} == dict.fromkeys(
        ("lightning", "plain", "plain_checks"), steps
    )  # every loop trains on the same batches
    assert all(s["per_step_ms_median"] > 0 for s in summary.values())
    assert report["ratio"] > 0 and report["target"]["status"] in {"PASS", "FAIL"}
    assert report["settings"]["arch"]["params"] == {"width": 16, "depth": 3}


def check_volatile(report: Report, out: Path) -> None:
    static, growing = report["a"]["rows"]
    assert (static["schedule"], growing["schedule"]) == ("static", "exponential")
    assert growing["worker_iterations"] < static["worker_iterations"]
    assert _fraction(static["final_accuracy"]) and _fraction(growing["final_accuracy"])
    rows = {row["strategy"]: row for row in report["b"]["rows"]}
    assert list(rows) == ["on-demand", "one-bid", "two-bids"]
    # one bid for every worker: they all train or none does, so it learns as on-demand does, and
    # pays spot prices below its bid (below on-demand) for the same updates
    assert report["b"]["one_bid_trains_as_on_demand"] is True
    assert 0 < rows["one-bid"]["cost"] < rows["on-demand"]["cost"]
    assert all(run["idle_hours"] == 0.0 for run in rows["on-demand"]["runs"])  # never outbid
    assert (out / "volatile_cost_accuracy.png").stat().st_size > 0


def check_shard(report: Report, out: Path) -> None:
    assert [row["config"] for row in report["table"]] == [
        "baseline",
        "dask-1-worker",
        "dask-2-workers",
        "dask-2-workers",
    ]
    # the single-process baseline writes the stage's very shards and manifest figures
    assert report["shards_identical_to_baseline"] is True
    assert report["manifest_figures_equal_to_baseline"] is True
    assert report["rows_as_requested"] is True
    assert report["targets"]["speedup_2_workers"]["value"] > 0
    assert report["targets"]["driver_memory_ratio"]["value"] > 0


def check_search(report: Report, out: Path) -> None:
    assert not report["partial"]
    assert sorted((r["strategy"], r["arm"], r["seed"]) for r in report["rows"]) == [
        ("plain", "plain-random", 0),
        ("plain", "plain-random", 1),
        ("task", "random", 0),
        ("task", "random", 1),
        ("task", "tpe+asha", 0),
        ("task", "tpe+asha", 1),
    ]
    for row in report["rows"]:
        assert 0 < row["epochs_to_target"] <= row["epochs_trained"] and sum(row["trials"].values()) >= 1
        assert 0 < row["utilisation"] <= 1  # inside training and validation passes
        assert {"outside_share", "before", "clean"} <= set(row["load"])  # what else the machine ran
        assert row["cpu"]["model"] and row["cpu"]["torch_capability"]  # which host's kernels
    found = [(e["strategy"], e["arm"], e["runs"]) for e in report["summary"]]
    assert found == [("task", "random", 2), ("task", "tpe+asha", 2), ("plain", "plain-random", 2)]
    assert set(report["verdict"]["task"]) == {"utilisation", "random_vs_plain_random", "best_vs_plain_best"}


def check_mnist1d_accuracy(report: Report, out: Path) -> None:
    result = report["result"]
    assert _fraction(result["ensemble_test_acc"]) and _fraction(result["student_test_acc"])
    assert result["student_params"] < result["ensemble_params"]
    assert report["targets"]["param_ratio"]["status"] == "PASS"  # the student is planned to the budget
    assert list(report["info"]["stage_seconds"]) == STAGES  # read from the run's own log
    assert report["info"]["trials"]["COMPLETE"] >= 2


def check_images(report: Report, out: Path) -> None:
    assert list(report["accuracy"]) == ["ensemble", "best trial", "hard-label student", "distilled student"]
    assert all(_fraction(acc) for acc in report["accuracy"].values())
    assert report["student_arch"]["family"] == "cnn2d" and report["student_arch"]["input_shape"] == [
        3,
        16,
        16,
    ]
    assert report["targets"]["param_ratio"]["status"] == "PASS"
    assert report["kept"]["model"] in {"student", "hard-label student"}
    assert report["targets"]["recovered_gain"]["status"] in {"PASS", "FAIL", "UNDEFINED"}


def check_scale(report: Report, out: Path) -> None:
    small, large = report["runs"]
    assert (small["rows"], large["rows"]) == (1000, 2000)
    assert (small["conf"]["n_shards"], large["conf"]["n_shards"]) == (2, 4)  # the shards grow with the data
    for run in (small, large):
        assert run["wall_s"] > 0 and run["task_peak_mb"] > 0 and run["worker_peak_mb"] > 0
        assert list(run["stage_peak_mb"]) == STAGES  # each stage's log line
    assert set(report["ratios"]) == set(report["verdict"]) == {"task_memory", "worker_memory", "wall"}


def check_mop_schedule(report: Report, out: Path) -> None:
    (mix,) = report["summary"]
    fixed = report["summary"][mix]["fixed"]
    assert fixed["reproduced"] is True and fixed["follows_plan"] is True  # the plan, on every repeat
    assert report["summary"][mix]["fixed_over_greedy"] > 0 and 0 <= fixed["idle"] < 1
    assert {r["schedule"] for r in report["runs"][mix]} == {"fixed", "greedy"}
    assert report["verdict"].startswith("fixed/greedy throughput")


def check_mop_bound(report: Report, out: Path) -> None:
    cells = [(r["mix"], r["models"], r["round_epochs"]) for r in report["rows"]]
    assert cells == [
        (mix, n, e) for mix in ("uniform", "one-slow", "search") for n in (4, 6) for e in (1, 3, 10)
    ]
    for row in report["rows"]:
        columns = ("fixed", "greedy", "no_rounds_cycle", "no_rounds_any_order")
        assert all(_fraction(row[c]) for c in columns)
        if row["mix"] == "uniform":  # units of one length: every worker busy throughout
            assert {row[c] for c in columns} == {1.0}


def check_roundtrip(report: Report, out: Path) -> None:
    cells = [(r["state_bytes"], r["mode"]) for r in report["rows"]]
    assert cells == [(size, mode) for size in (1, 65536) for mode in ("by_value", "dependency", "direct")]
    for row in report["rows"]:
        assert row["units"] == 20 and row["wall_ms"] > 0 and row["workers_cpu_ms"] > 0
        # the main thread is one of the process's threads: its CPU is part of the process's
        assert 0 < row["coordinator_main_thread_cpu_ms"] <= row["coordinator_cpu_ms"]
    floor = report["rows"][0]  # the ratios' baseline: the smallest state passed by value
    assert floor["wall_ratio"] == floor["coordinator_cpu_ratio"] == 1.0


def check_small_units(report: Report, out: Path) -> None:
    rows = {r["arm"]: r for r in report["rows"]}
    assert list(rows) == ["task", "task-chain", "mop", "mop-no-lookahead", "plain"]
    settings = report["settings"]
    epochs = settings["trials"] * settings["epochs"]
    # the same work in every arm: every trial trains every epoch (none stops before its last)
    assert all(r["epochs_trained"] == epochs for r in rows.values())
    mop_units = 2 * epochs  # a model's pass over each of 2 partitions an epoch
    assert [rows[a]["units"] for a in rows] == [epochs, epochs, mop_units, mop_units, epochs]
    # task: a Dask task per trial, with a decision after each epoch (a chain the pruner may stop on
    # its worker) or without; mop: none, its units are calls to each worker's resident trainer
    assert [rows[a]["dask_tasks"] for a in ("task", "task-chain", "mop", "mop-no-lookahead")] == [
        settings["trials"],
        settings["trials"],
        0,
        0,
    ]
    for arm in ("mop", "mop-no-lookahead"):  # a worker's idle per round, a share of the round
        row = rows[arm]
        assert 0 <= row["round_idle_median"] <= row["round_idle_p90"] <= row["round_idle_max"]
    assert rows["plain"]["wall_ratio"] == 1.0 and 0 < rows["plain"]["utilisation"] <= 1
    for arm in ("task", "task-chain", "mop", "mop-no-lookahead"):
        row = rows[arm]
        assert 0 < row["utilisation"] <= 1 and row["pass_ms"] > 0
        assert row["fixed_ms_median"] > 0 and row["fixed_ms_mean"] > 0
        # the parts are inside the fixed cost; the Dask tasks hold the records' spans
        assert row["setup_ms"] + row["fit_ms"] + row["pack_ms"] <= row["fixed_ms_mean"] + 0.01
        if row["dask_tasks"]:  # what the unit tasks spent outside the records' spans
            assert row["unrecorded_ms"] > -0.1
        assert 0 < row["coordinator_main_thread_cpu_ms"] <= row["coordinator_cpu_ms"]
        assert row["workers_cpu_ms"] > 0
        assert set(report["targets"]["status"][arm]) == {
            "fixed_ms_median",
            "coordinator_cpu_ms",
            "utilisation",
        }


QUICK: dict[str, Callable[[Report, Path], None]] = {
    "distill": check_distill,
    "mop_bound": check_mop_bound,
    "mop_schedule": check_mop_schedule,
    "overhead": check_overhead,
    "roundtrip": check_roundtrip,
    "scale": check_scale,  # two whole `mopflow run`s, of 1,000 and 2,000 rows
    "search": check_search,
    "shard": check_shard,
    "small_units": check_small_units,
    "volatile": check_volatile,
}
# The quick runs of the two demo benchmarks are the pipeline runs of tests/dags/test_end_to_end*.py
# (checked there with check_mnist1d_accuracy and check_images).
IN_END_TO_END = {"images", "mnist1d_accuracy"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(QUICK))
def test_the_quick_run_writes_its_figures_to_out(name: str, tmp_path: Path) -> None:
    _quick_run(name, tmp_path, QUICK[name])


def _quick_run(name: str, tmp_path: Path, check: Callable[[Report, Path], None]) -> None:
    recorded = recorded_results()
    # nothing of this process's settings (MLflow exports its URIs when used in-process) leaks in
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_")) or k == PORT_RANGE_ENV
    }
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / f"{name}.py"), "--quick", "--out", str(tmp_path)],
        cwd=BENCHMARKS_DIR.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert report["benchmark"] == name
    assert report["commit"].removesuffix("+dirty") == HEAD  # the commit the figures come from
    check(report, tmp_path)
    assert_not_written_over(recorded, tmp_path)


def test_the_quick_runs_are_of_benchmarks_that_exist() -> None:
    assert set(QUICK) | IN_END_TO_END <= {p.stem for p in BENCHMARKS_DIR.glob("*.py")}


@pytest.mark.parametrize(
    "script", sorted(p for p in BENCHMARKS_DIR.glob("*.py") if p.stem not in QUICK), ids=lambda p: p.name
)
def test_a_benchmark_run_elsewhere_imports(script: Path) -> None:
    module = load_benchmark(script)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
