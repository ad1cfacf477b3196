"""The small-units benchmark's per-unit figures (``benchmarks/studies/unit_costs.py``) and its
command line (``benchmarks/small_units.py``); its quick run is in ``test_quick.py``."""

from __future__ import annotations

from typing import Any

import pytest
from studies import unit_costs

from tests.benchmarks.loader import load_benchmark


def _record(start: float, end: float, loop: float, val: float = 0.0, **parts: float) -> dict[str, Any]:
    return {"start": start, "end": end, "loop_s": loop, "val_s": val, **parts}


def test_a_units_fixed_cost_is_its_span_less_its_passes() -> None:
    records = [
        _record(0.0, 0.030, 0.015, 0.001, setup_s=0.004, fit_s=0.022, pack_s=0.002),  # 14 ms fixed
        _record(0.030, 0.050, 0.016, setup_s=0.001, fit_s=0.018, pack_s=0.001),  # 4 ms fixed
        _record(0.050, 0.076, 0.015, 0.001, setup_s=0.002, fit_s=0.020, pack_s=0.001),  # 10 ms fixed
    ]
    found = unit_costs.unit_figures(records)
    assert found["units"] == 3
    assert found["busy_s"] == pytest.approx(0.048)
    assert found["pass_ms"] == pytest.approx(16.0)
    assert found["fixed_ms_median"] == pytest.approx(10.0)
    assert found["fixed_ms_mean"] == pytest.approx(28.0 / 3)
    # the parts: before the pass, around its loop in the pass, the state packed
    assert found["setup_ms"] == pytest.approx(7.0 / 3)
    assert found["fit_ms"] == pytest.approx(14.0 / 3)
    assert found["pack_ms"] == pytest.approx(4.0 / 3)


def test_records_without_timings_are_no_units() -> None:
    assert unit_costs.unit_figures([{"model": "m", "epoch": 0}]) == {"units": 0}


def test_the_dask_tasks_time_outside_the_records_is_per_unit() -> None:
    records = [_record(0.0, 0.030, 0.015), _record(0.030, 0.050, 0.016), _record(1.0, 1.020, 0.015)]
    stream = [("task-m0-e0-2-1", 0.052), ("task-m1-e0-1-2", 0.021), ("evaluate_state-abc", 5.0)]
    found = unit_costs.dask_figures(stream, unit_costs.TASK_PREFIX["task"], records)
    assert found["dask_tasks"] == 2  # the executor's unit tasks only
    assert found["unrecorded_ms"] == pytest.approx((0.073 - 0.070) * 1e3 / 3)
    assert unit_costs.dask_figures([], "mop-", records) == {"dask_tasks": 0}


def test_a_workers_idle_in_a_round_is_its_gaps_over_the_rounds_span() -> None:
    def unit(worker: str, rnd: int, start: float, end: float) -> dict[str, Any]:
        return {"worker": worker, "round": rnd, "start": start, "end": end}

    records = [
        unit("w0", 0, 0.0, 1.0), unit("w0", 0, 1.0, 2.0), unit("w1", 0, 0.0, 3.0),  # round 0 spans 3 s
        unit("w0", 1, 2.5, 3.5),  # w0 waited 0.5 s after round 0: a unit started ahead filled the rest
        unit("w1", 1, 4.0, 5.0),  # w1 waited 1 s
        unit("w0", 2, 6.0, 7.0), unit("w1", 2, 6.0, 7.0),  # round 1 spans 2.5 s; the last round is left out
    ]  # fmt: skip
    shares = unit_costs.round_idle_shares(records)
    assert shares == pytest.approx([0.5 / 3, 2.5 / 2.5, 1.0 / 3, 1.0 / 2.5])
    found = unit_costs.round_idle_figures(records)
    assert found["round_idle_max"] == pytest.approx(1.0)
    assert found["round_idle_median"] == pytest.approx((1.0 / 3 + 1.0 / 2.5) / 2)
    assert unit_costs.round_idle_figures(records[:3]) == {}  # one round: nothing waits behind it


def test_a_stream_entry_counts_its_compute_spans_only() -> None:
    entry = {
        "key": "mop-m0-e0-p0-1",
        "startstops": [
            {"action": "transfer", "start": 0.0, "stop": 0.5},
            {"action": "compute", "start": 1.0, "stop": 1.25},
        ],
    }
    assert unit_costs.compute_seconds(entry) == pytest.approx(0.25)


def test_the_arms_train_the_same_trials_and_quick_writes_elsewhere() -> None:
    bench = load_benchmark("small_units")
    settings, out = bench.parse_args(["--quick"])
    assert (settings.trials, settings.epochs, settings.repeats, settings.warmup) == (4, 2, 1, False)
    assert settings.arms == ["task", "task-chain", "mop", "mop-no-lookahead", "plain"]
    assert out.parent != bench.RESULTS_PATH.parent  # a quick run never writes into benchmarks/results/
    settings, out = bench.parse_args([])
    assert out == bench.RESULTS_PATH and settings.warmup
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "task,ddp"])


def test_targets_judge_the_mopflow_arms_only() -> None:
    bench = load_benchmark("small_units")
    rows = [
        {"arm": "mop", "fixed_ms_median": 1.5, "coordinator_cpu_ms": 2.5, "utilisation": 0.8},
        {"arm": "plain", "utilisation": 0.9},
    ]
    assert bench.targets(rows) == {
        "mop": {"fixed_ms_median": "PASS", "coordinator_cpu_ms": "FAIL", "utilisation": "PASS"}
    }
