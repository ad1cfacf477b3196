"""Accounting runs on volatile workers: synchronous work, task-parallel units, real billed intervals."""

from __future__ import annotations

import pytest

from mopflow.training.volatile.cost import (
    account_intervals,
    account_parallel_units,
    account_run,
    on_demand_account,
    unit_durations,
)
from mopflow.training.volatile.price_trace import PriceTrace, sample_price_trace
from mopflow.training.volatile.prices import PriceError, TraceExhaustedError, UniformPrices, conditional_mean

H = 3600.0


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


def test_account_of_real_intervals() -> None:
    """Billed at the price while running, whatever the bid; idle when no worker runs."""
    trace = PriceTrace((0.0, 3600.0), (1.0, 2.0), 7200.0)
    account = account_intervals(
        trace,
        {"0": [(0.0, 1800.0), (5400.0, 7200.0)], "1": [(0.0, 3600.0)]},
        0.0,
        7200.0,
        useful_seconds=3000.0,
        wasted_seconds=60.0,
        units=3,
        interrupted=1,
    )
    assert account.worker_costs == pytest.approx((0.5 + 1.0, 1.0))
    assert account.idle_seconds == pytest.approx(1800.0)  # 3600-5400: nobody runs
    assert account.billed_worker_seconds == pytest.approx(7200.0)
    metrics = account.metrics()
    assert metrics["spot_wasted_worker_hours"] == pytest.approx(60 / 3600)
    assert metrics["spot_failed_attempts"] == 1.0
    with pytest.raises(PriceError, match="outside the run"):
        account_intervals(trace, {"0": [(0.0, 9000.0)]}, 0.0, 7200.0)
