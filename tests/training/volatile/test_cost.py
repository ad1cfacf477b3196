"""Cost model: price distributions, traces, and the accounting of runs on volatile workers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training.volatile.cost import (
    EmpiricalPrices,
    GaussianPrices,
    PriceError,
    PriceTrace,
    TraceExhaustedError,
    UniformPrices,
    account_parallel_units,
    account_run,
    conditional_mean,
    empirical_prices,
    load_price_trace,
    log_run_account,
    on_demand_account,
    parse_price_csv,
    sample_price_trace,
    unit_durations,
)

H = 3600.0


# --------------------------------------------------------------------------- distributions


def test_uniform_cdf_partial_mean_and_quantile() -> None:
    d = UniformPrices(low=0.2, high=1.0)
    assert d.cdf(0.1) == 0.0 and d.cdf(0.6) == pytest.approx(0.5) and d.cdf(2.0) == 1.0
    # integral of p/0.8 over [0.2, 0.6] = (0.36 - 0.04) / 1.6
    assert d.partial_mean(0.6) == pytest.approx(0.2)
    assert conditional_mean(d, 0.6) == pytest.approx(0.4)
    assert d.partial_mean(5.0) == pytest.approx(0.6)  # the mean
    assert d.quantile(0.25) == pytest.approx(0.4)


def test_gaussian_is_truncated_at_zero_and_matches_its_samples() -> None:
    d = GaussianPrices(mean=0.1, std=0.2)  # 31% of the untruncated mass is below 0
    assert d.cdf(0.0) == 0.0 and d.cdf(10.0) == pytest.approx(1.0)
    assert d.cdf(d.quantile(0.3)) == pytest.approx(0.3)
    x = d.sample(np.random.default_rng(1), 40_000)
    assert x.min() >= 0.0
    assert x.mean() == pytest.approx(d.partial_mean(100.0), rel=0.02)
    assert (x <= 0.15).mean() == pytest.approx(d.cdf(0.15), abs=0.01)
    assert conditional_mean(d, 0.15) == pytest.approx(x[x <= 0.15].mean(), rel=0.02)


def test_distributions_refuse_bad_parameters() -> None:
    with pytest.raises(ValueError, match="high > low"):
        UniformPrices(low=1.0, high=0.5)
    with pytest.raises(ValueError, match="std"):
        GaussianPrices(mean=1.0, std=0.0)
    with pytest.raises(PriceError, match="never active"):
        conditional_mean(UniformPrices(low=0.5, high=1.0), 0.4)


def test_empirical_prices_are_time_weighted() -> None:
    trace = PriceTrace((0.0, 10.0, 40.0), (0.3, 0.1, 0.3), end=100.0)
    d = empirical_prices(trace)
    assert d == EmpiricalPrices(prices=(0.1, 0.3), weights=(30.0, 70.0))
    assert d.cdf(0.2) == pytest.approx(0.3)
    assert d.partial_mean(1.0) == pytest.approx(0.1 * 0.3 + 0.3 * 0.7)
    assert d.quantile(0.3) == 0.1 and d.quantile(0.31) == 0.3


# --------------------------------------------------------------------------- traces


def test_csv_trace_with_seconds_and_iso_timestamps(tmp_path: Path) -> None:
    file = tmp_path / "prices.csv"
    file.write_text(
        "timestamp,price\n2026-01-01T00:00:00Z,0.5\n2026-01-01T01:00:00Z,1.2\n\n2026-01-01T01:30:00Z,0.8\n"
    )
    trace = load_price_trace(file)
    assert trace.prices == (0.5, 1.2, 0.8)
    assert [t - trace.start for t in trace.times] == [0.0, 3600.0, 5400.0]
    assert trace.end - trace.times[-1] == pytest.approx(2700.0)  # median spacing of 3600 and 1800
    numeric = parse_price_csv("timestamp,price\n0,1\n60,2\n", end=600.0)
    assert numeric.times == (0.0, 60.0) and numeric.end == 600.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,price\n0,1\n1,2\n", r"line 1: expected the header 'timestamp,price'"),
        ("timestamp,price\n0,1\n60,abc\n", r"line 3: price 'abc' is not a number"),
        ("timestamp,price\n0,1\n60,-0.2\n", r"line 3: price '-0.2' must be a finite number >= 0"),
        ("timestamp,price\n0,1\n60,nan\n", r"line 3: price 'nan'"),
        ("timestamp,price\n0,1\nyesterday,2\n", r"line 3: timestamp 'yesterday' is neither"),
        ("timestamp,price\n0,1\n60,2\n60,3\n", r"line 4: timestamp '60' does not come after"),
        ("timestamp,price\n0,1\n60,2,3\n", r"line 3: expected 2 fields"),
        ("timestamp,price\n0,1\n", r"at least 2 price rows"),
        ("", r"empty price trace"),
    ],
)
def test_bad_csv_rows_are_refused_with_the_line_named(text: str, message: str) -> None:
    with pytest.raises(PriceError, match=message):
        parse_price_csv(text, source="prices.csv")


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PriceError, match="cannot read price trace"):
        load_price_trace(tmp_path / "nope.csv")


def test_sampled_paths_are_seeded() -> None:
    d = UniformPrices(low=0.1, high=0.9)
    a = sample_price_trace(d, 50, 60.0, seed=7)
    assert a == sample_price_trace(d, 50, 60.0, seed=7)
    assert a != sample_price_trace(d, 50, 60.0, seed=8)
    assert a.times[1] - a.times[0] == 60.0 and a.end == 3000.0
    assert all(0.1 <= p <= 0.9 for p in a.prices)


# --------------------------------------------------------------------------- accounting


def test_account_with_a_preemption_mid_unit_and_an_idle_gap() -> None:
    # price 0.5 for 1 h, 1.2 for 30 min, 3.0 for 30 min, then 0.8; bids 1.5 and 1.0
    trace = PriceTrace((0.0, H, 1.5 * H, 2 * H), (0.5, 1.2, 3.0, 0.8), end=3 * H)
    acc = account_run(trace, [1.5, 1.0], [0.5 * H, H, 0.5 * H])
    # unit 1: [0, 0.5h) both; unit 2: [0.5h, 1.5h), worker 1 preempted at 1h (0.5 h of work lost);
    # unit 3 waits out the 3.0 price (idle 0.5 h) and runs [2h, 2.5h) with both.
    assert acc.workers_per_unit == (2, 1, 2)
    assert acc.wall_seconds == pytest.approx(2.5 * H)
    assert acc.idle_seconds == pytest.approx(0.5 * H)
    assert acc.active_seconds == pytest.approx(2.0 * H)
    assert acc.wasted_worker_seconds == pytest.approx(0.5 * H)
    assert acc.useful_worker_seconds == pytest.approx(3.0 * H)
    # worker 0: 0.5*1 + 1.2*0.5 + 0.8*0.5 = 1.5; worker 1: 0.5*1 + 0.8*0.5 = 0.9
    assert acc.worker_costs == pytest.approx((1.5, 0.9))
    assert acc.cost == pytest.approx(2.4)
    assert acc.billed_worker_seconds == pytest.approx(3.5 * H)
    assert acc.failed_attempts == 0


def test_a_unit_whose_workers_are_all_preempted_is_redone() -> None:
    trace = PriceTrace((0.0, 600.0, 1200.0), (1.0, 5.0, 1.0), end=4000.0)
    acc = account_run(trace, [2.0, 2.0], [1000.0])
    assert acc.failed_attempts == 1
    assert acc.wasted_worker_seconds == pytest.approx(1200.0)  # 2 workers x 600 s lost
    assert acc.idle_seconds == pytest.approx(600.0)
    assert acc.wall_seconds == pytest.approx(2200.0)
    assert acc.useful_worker_seconds == pytest.approx(2000.0)
    assert acc.cost == pytest.approx((2 * 600 + 2 * 1000) / H)


def test_a_worker_activated_mid_unit_is_billed_while_it_waits() -> None:
    trace = PriceTrace((0.0, 100.0), (2.0, 1.0), end=1000.0)
    acc = account_run(trace, [3.0, 1.5], [300.0])
    assert acc.workers_per_unit == (1,)
    assert acc.worker_costs == pytest.approx(((2 * 100 + 200) / H, 200 / H))
    metrics = acc.metrics()
    assert metrics["spot_waiting_worker_hours"] == pytest.approx(200 / H)
    assert metrics["spot_wasted_worker_hours"] == 0.0


def test_provisioned_workers_follow_a_schedule() -> None:
    trace = PriceTrace((0.0,), (1.0,), end=10 * H)
    acc = account_run(trace, [1.0, 1.0, 1.0, 1.0], [H, H, H], provisioned=[1, 2, 4])
    assert acc.workers_per_unit == (1, 2, 4)
    assert acc.billed_worker_seconds == pytest.approx(7 * H)
    assert acc.cost == pytest.approx(7.0)


def test_task_parallel_units_each_on_its_own_bid() -> None:
    # unit records as the executors log them (worker, start, end), e.g. MOP sub-epochs
    records = [
        {"worker": "a", "model": 0, "start": 600.0, "end": 1200.0},
        {"worker": "b", "model": 1, "start": 0.0, "end": 1800.0},
        {"worker": "a", "model": 1, "start": 0.0, "end": 600.0},
    ]
    work = unit_durations(records)
    assert work == {"a": [600.0, 600.0], "b": [1800.0]}
    trace = PriceTrace((0.0, 900.0, 1500.0), (1.0, 2.0, 1.0), end=10_000.0)
    acc = account_parallel_units(trace, {"a": 1.5, "b": 1.8}, work)
    # a: unit 2 preempted at 900 (300 s lost), redone 1500-2100; b: preempted at 900 (900 s lost),
    # redone 1500-3300; nobody runs while the price is 2.0, 900-1500.
    assert acc.wall_seconds == pytest.approx(3300.0)
    assert acc.idle_seconds == pytest.approx(600.0)
    assert acc.wasted_worker_seconds == pytest.approx(1200.0)
    assert acc.useful_worker_seconds == pytest.approx(3000.0)
    assert acc.failed_attempts == 2 and acc.units == 3
    assert acc.worker_costs == pytest.approx((1500 / H, 2700 / H))
    with pytest.raises(PriceError, match=r"no bid for worker\(s\) \['b'\]"):
        account_parallel_units(trace, {"a": 1.0}, work)
    with pytest.raises(PriceError, match=r"records\[0\].*expected worker, start and end"):
        unit_durations([{"worker": "a", "start": 0.0}])


def test_on_demand_account_is_workers_times_hours_times_price() -> None:
    acc = on_demand_account(2.0, 3, [H, 0.5 * H])
    assert acc.cost == pytest.approx(2.0 * 3 * 1.5)
    assert acc.idle_seconds == 0.0 and acc.wasted_worker_seconds == 0.0


def test_trace_that_ends_first_or_never_drops_below_the_bids_is_refused() -> None:
    with pytest.raises(TraceExhaustedError, match="stays above every bid"):
        account_run(PriceTrace((0.0, 10.0), (1.0, 9.0), end=100.0), [2.0], [5.0, 5.0, 5.0])
    with pytest.raises(TraceExhaustedError, match="ends at 100"):
        account_run(PriceTrace((0.0,), (1.0,), end=100.0), [2.0], [60.0, 60.0])


def test_bad_bids_and_work_are_named() -> None:
    trace = PriceTrace((0.0,), (1.0,), end=100.0)
    with pytest.raises(PriceError, match=r"bids\[1\]=-1"):
        account_run(trace, [1.0, -1.0], [1.0])
    with pytest.raises(PriceError, match=r"work_seconds\[1\]=0"):
        account_run(trace, [1.0], [1.0, 0.0])
    with pytest.raises(PriceError, match=r"provisioned\[0\]=3"):
        account_run(trace, [1.0], [1.0], provisioned=[3])
    with pytest.raises(PriceError, match="increase strictly"):
        PriceTrace((0.0, 0.0), (1.0, 1.0), end=10.0)


def test_replaying_i_i_d_prices_matches_the_one_bid_expectation() -> None:
    # One-bid analysis: J iterations take J R / F(b) and cost n J R E[p | p <= b] in expectation.
    d = UniformPrices(low=0.0, high=1.0)
    bid, n, iters, r = 0.4, 3, 4000, 10.0
    trace = sample_price_trace(d, 30_000, r, seed=3)
    acc = account_run(trace, [bid] * n, [r] * iters)
    assert acc.wall_seconds == pytest.approx(iters * r / d.cdf(bid), rel=0.05)
    assert acc.cost == pytest.approx(n * iters * r / H * conditional_mean(d, bid), rel=0.03)
    assert acc.wasted_worker_seconds == 0.0  # prices change only between iterations here


# --------------------------------------------------------------------------- tracking


class RecordingTracker:
    """Keeps what is logged (a Tracker for tests; the product uses MlflowTracker)."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}

    def find_run(self, tags: Mapping[str, str]) -> str | None:
        return None

    def start_run(self, name: str, tags: Mapping[str, str], parent_run_id: str | None = None) -> str:
        return "run"

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_metric_history(self, run_id: str, key: str, values: Iterable[tuple[int, float]]) -> None:
        self.history[key] = list(values)

    def log_dict(self, run_id: str, obj: Any, artifact_file: str) -> None: ...

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None: ...

    def end_run(self, run_id: str, status: str = "FINISHED") -> None: ...


def test_log_run_account_logs_cost_times_and_active_workers() -> None:
    trace = PriceTrace((0.0, H, 1.5 * H, 2 * H), (0.5, 1.2, 3.0, 0.8), end=3 * H)
    acc = account_run(trace, [1.5, 1.0], [0.5 * H, H, 0.5 * H])
    tracker = RecordingTracker()
    log_run_account(tracker, "run", acc, bids=[1.5, 1.0])
    assert tracker.metrics["spot_cost"] == pytest.approx(2.4)
    assert tracker.metrics["spot_idle_hours"] == pytest.approx(0.5)
    assert tracker.metrics["spot_wasted_worker_hours"] == pytest.approx(0.5)
    assert tracker.params == {"spot_bids": "1.5,1", "spot_workers": 2}
    assert tracker.history["spot_active_workers"] == [(0, 2.0), (1, 1.0), (2, 2.0)]


@pytest.mark.slow
def test_log_run_account_to_a_real_mlflow(tmp_path: Path) -> None:
    from infra.tracking import MlflowTracker

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "cost", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("spot", {"stage": "cost"})
    trace = PriceTrace((0.0, 600.0, 1200.0), (1.0, 5.0, 1.0), end=4000.0)
    log_run_account(tracker, run_id, account_run(trace, [2.0, 2.0], [1000.0]), bids=[2.0, 2.0])
    data = tracker.client.get_run(run_id).data
    assert data.metrics["spot_cost"] == pytest.approx(3200 / H)
    assert data.metrics["spot_failed_attempts"] == 1.0
    assert data.params["spot_bids"] == "2,2"
