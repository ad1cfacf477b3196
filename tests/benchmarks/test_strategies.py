"""The strategies benchmark: learning curves, gaps to sequential, targets, and a quick run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from studies import ddp_gangs

from tests.benchmarks.loader import BENCHMARKS_DIR, assert_not_written_over, load_benchmark, recorded_results

bench = load_benchmark("strategies")


def test_the_curve_summary_is_taken_per_epoch_over_the_models_that_reached_it() -> None:
    summary = bench.curve_summary({"a": [0.5, 0.7], "b": [0.3, 0.9], "c": [0.4]})
    assert summary["epoch"] == [1, 2] and summary["models"] == [3, 2]
    assert summary["mean"] == pytest.approx([0.4, 0.8])
    assert summary["min"] == [0.3, 0.7] and summary["max"] == [0.5, 0.9]
    assert summary["std"] == pytest.approx([(0.02 / 3) ** 0.5, 0.1])


def test_the_gap_pairs_configurations_that_finished_every_epoch_under_both() -> None:
    sequential = {"a": [0.5, 0.80], "b": [0.5, 0.90], "c": [0.5, 0.70]}
    strategy = {"a": [0.4, 0.78], "b": [0.4, 0.86], "c": [0.6]}  # c failed after one epoch
    gap, models = bench.last_epoch_gap(strategy, sequential, epochs=2)
    assert models == 2 and gap == pytest.approx(-3.0)
    assert bench.last_epoch_gap({"c": [0.6]}, sequential, epochs=2) == (None, 0)


def test_learning_curves_skip_failed_strategies_and_measure_sequential_against_itself() -> None:
    results = {
        "sequential": {"curves": {"a": [0.5, 0.8]}},
        "averaging": {"curves": {"a": [0.4, 0.7]}},
        "ddp": {"error": "timed out after 900s"},
    }
    found = bench.learning_curves(results, epochs=2)
    assert sorted(found) == ["averaging", "sequential"]
    assert found["sequential"]["gap_points"] == 0.0
    assert found["averaging"]["gap_points"] == pytest.approx(-10.0) and found["averaging"]["gap_models"] == 1


@pytest.mark.parametrize(("gap", "lags"), [(-2.0, True), (-0.3, False), (1.0, False)])
def test_model_averaging_is_measured_and_the_line_says_whether_it_lags(gap: float, lags: bool) -> None:
    line = bench.averaging_gap({"gap_points": gap})
    assert line["status"] == "MEASURED" and line["lags"] is lags
    assert ("does NOT lag" in bench.format_target(line)) is not lags
    assert bench.averaging_gap(None)["status"] == "UNDEFINED"


@pytest.mark.parametrize(("gap", "status"), [(0.4, "PASS"), (-0.6, "FAIL")])
def test_mop_must_end_within_half_a_point_of_sequential(gap: float, status: str) -> None:
    figures = {"rows_per_s": 1.0, "footprint_bytes": 1, "idle_fraction": 0.05}
    results = {
        "sequential": {**figures, "gap_points": 0.0},
        "task": dict(figures),
        "mop": {**figures, "gap_points": gap},
    }
    targets = {t["target"]: t for t in bench.evaluate_targets(results)}
    assert targets["MOP accuracy gap to sequential (last epoch)"]["status"] == status
    assert targets["Model averaging gap to sequential (last epoch)"]["status"] == "UNDEFINED"


def test_a_worker_is_busy_while_a_gang_that_includes_it_trains_within_the_sweep() -> None:
    records = [
        {
            "model": "m0",
            "worker": "a,b",
            "start": 5.0,
            "end": 12.0,
        },  # starts before the sweep: clipped to 10..12
        {"model": "m1", "worker": "a,b", "start": 12.0, "end": 20.0},
        {"model": "m2", "worker": "c,d", "start": 10.0, "end": 25.0},  # ends after it: clipped to 10..20
    ]
    busy = ddp_gangs.busy_seconds(records, ["a", "b", "c", "d", "e"], 10.0, 20.0)
    assert busy == {"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.0, "e": 0.0}
    figures = ddp_gangs.idle_figures(records[:2], ["a", "b", "c", "d"], 10.0, 20.0)
    assert figures["worker_idle"] == {"a": 0.0, "b": 0.0, "c": 1.0, "d": 1.0}
    assert figures["worker_idle_max"] == 1.0 and figures["worker_idle_mean"] == 0.5
    assert figures["sweep_s"] == 10.0
    # while trials wait (until m1, the last, starts at 12): c and d had nothing for those 2 s
    assert figures["waiting_s"] == 2.0 and figures["worker_idle_waiting"]["c"] == 1.0
    assert figures["worker_idle_waiting"]["a"] == 0.0 and figures["worker_idle_waiting_max"] == 1.0
    (first, *_) = ddp_gangs.attempts(records, 10.0)
    assert first["gang"] == ["a", "b"] and (first["start_s"], first["end_s"]) == (-5.0, 2.0)


def test_concurrent_trials_pass_at_ten_percent_idle_and_the_gain_is_only_expected() -> None:
    assert ddp_gangs.trials_at_once("ddp_trials") == 2 and ddp_gangs.trials_at_once("ddp_one_at_a_time") == 1
    concurrent = {"worker_idle_waiting_max": 0.08, "worker_idle_mean": 0.05}
    one = {"worker_idle_waiting_max": 1.0, "worker_idle_mean": 0.525}
    lines = {t["target"]: t for t in ddp_gangs.targets(concurrent, one, cpus=2)}
    assert lines["DDP concurrent trials: max worker idle while trials wait"]["status"] == "PASS"
    assert lines["DDP one trial at a time: max worker idle while trials wait"]["status"] == "MEASURED"
    (gain,) = [t for t in lines.values() if t["unit"] == "x"]
    assert gain["status"] == "EXPECTED" and gain["value"] == pytest.approx(0.95 / 0.475)
    assert "not measurable on this 2-core machine" in bench.format_target(gain)
    failing = ddp_gangs.targets({"worker_idle_waiting_max": 0.11, "worker_idle_mean": 0.1}, None)
    assert [t["status"] for t in failing] == ["FAIL", "UNDEFINED", "UNDEFINED"]


def test_a_quick_run_never_writes_over_the_committed_results(tmp_path: Path) -> None:
    assert bench.output_dir(None, quick=False) == bench.RESULTS_DIR
    assert bench.output_dir(tmp_path / "out", quick=True) == tmp_path / "out"
    for given in (None, bench.RESULTS_DIR):
        chosen = bench.output_dir(given, quick=True)
        assert chosen.resolve() != bench.RESULTS_DIR.resolve() and chosen.is_dir()
        chosen.rmdir()


@pytest.mark.slow
def test_the_quick_run_writes_curves_and_gaps_for_every_strategy(tmp_path: Path) -> None:
    recorded = recorded_results(bench.RESULTS_DIR)
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / "strategies.py"), "--quick", "--out", str(tmp_path)],
        cwd=BENCHMARKS_DIR.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "strategies.json").read_text())
    results = report["results"]
    assert list(results) == [
        "sequential",
        "task",
        "mop",
        "ddp",
        "averaging",
        "ddp_trials",
        "ddp_one_at_a_time",
    ]
    epochs, configs = report["settings"]["epochs"], report["settings"]["configs"]
    for name, r in results.items():
        assert "error" not in r, (name, r.get("log_tail"))
        assert len(r["curves"]) == configs and all(len(c) == epochs for c in r["curves"].values()), name
        assert r["curve"]["epoch"] == list(range(1, epochs + 1)), name
        assert r["gap_models"] == configs and isinstance(r["gap_points"], float), name
    assert results["sequential"]["gap_points"] == 0.0
    trials, one = results["ddp_trials"], results["ddp_one_at_a_time"]
    assert (trials["workers"], trials["trials_at_once"], one["trials_at_once"]) == (4, 2, 1)
    assert trials["worker_idle_max"] < 1.0  # both trials at once: every worker held a rank
    assert one["worker_idle_mean"] >= 0.5  # one gang of 2 of the 4 workers at a time
    assert sorted(a["model"] for a in one["attempts"]) == sorted(one["curves"])
    targets = {t["target"]: t for t in report["targets"]}
    assert targets["DDP concurrent trials: max worker idle while trials wait"]["status"] in ("PASS", "FAIL")
    assert targets["DDP one trial at a time: max worker idle while trials wait"]["status"] == "MEASURED"
    assert targets["MOP accuracy gap to sequential (last epoch)"]["status"] in ("PASS", "FAIL")
    assert targets["Model averaging gap to sequential (last epoch)"]["status"] == "MEASURED"
    assert (tmp_path / report["curves_png"]).stat().st_size > 10_000
    assert_not_written_over(recorded, tmp_path, bench.RESULTS_DIR)
