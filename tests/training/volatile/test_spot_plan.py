"""Spot planning: the choices must follow from the paper's cost, runtime and error expressions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mopflow.infra.cli import main
from mopflow.training.volatile.cost import account_run
from mopflow.training.volatile.price_trace import empirical_prices, sample_price_trace
from mopflow.training.volatile.prices import GaussianPrices, UniformPrices
from mopflow.training.volatile.spot_plan import plan_spot
from mopflow.training.volatile.spot_plan_model import (
    Plan,
    PlanError,
    SpotPlanConfig,
    evaluate,
    feasible,
)
from tests.training.volatile.helpers import UNIFORM, plan_config

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- on-demand


# --------------------------------------------------------------------------- choices


def test_tight_deadline_only_on_demand_can_make_it() -> None:
    # 3 workers need ~4,059 iterations (1.13 h); bids are capped at the on-demand price 1.0,
    # active 82% of the time at most, so no spot plan finishes within 0.9 h in expectation.
    report = plan_spot(plan_config(deadline_hours=0.9))
    assert report.chosen.strategy == "on-demand"
    assert report.options["one-bid"] is None and report.options["two-bids"] is None
    assert "needs" in report.reasons["one-bid"]
    assert report.chosen.expected_hours <= 0.9


def test_deadline_decides_the_bid_and_looser_deadlines_are_cheaper() -> None:
    deadlines = (1.2, 2.0, 5.0, 20.0)
    reports = [plan_spot(plan_config(deadline_hours=d)) for d in deadlines]
    on_demand = reports[0].options["on-demand"]
    assert on_demand is not None
    bids = [r.chosen.high_bid for r in reports]
    costs = [r.chosen.expected_cost for r in reports]
    assert all(r.chosen.strategy != "on-demand" for r in reports)
    assert all(b is not None for b in bids)
    assert bids == sorted(bids, reverse=True) and len(set(bids)) == len(bids)  # type: ignore[type-var]
    assert costs == sorted(costs, reverse=True)
    # near the deadline the high bid sits near the cap; with a loose one it bids near the floor price
    assert bids[0] is not None and bids[0] > 0.9
    assert bids[-1] is not None and bids[-1] < 0.2 < conditional_mean_price()
    assert costs[-1] < 0.2 * on_demand.expected_cost
    for r, d in zip(reports, deadlines, strict=True):
        # the paper's one-bid optimum: the deadline binds (the smallest bid that meets it)
        one = r.options["one-bid"]
        assert one is not None and one.expected_hours == pytest.approx(d, rel=1e-6)


def conditional_mean_price() -> float:
    return (UNIFORM.low + UNIFORM.high) / 2


@pytest.mark.parametrize(
    "prices",
    [
        UniformPrices(low=0.1, high=1.2),
        UniformPrices(low=0.0, high=0.8),
        GaussianPrices(mean=0.5, std=0.2),
        GaussianPrices(mean=0.3, std=0.3),
    ],
)
@pytest.mark.parametrize("deadline", [1.5, 4.0, 12.0])
def test_two_bids_never_cost_more_than_the_best_single_bid(prices: object, deadline: float) -> None:
    report = plan_spot(plan_config(prices=prices, deadline_hours=deadline, error_target=0.03))
    one, two = report.options["one-bid"], report.options["two-bids"]
    assert one is not None and one.workers >= 2  # a second bid is possible
    assert two is not None and two.low_bid is not None and two.high_bid is not None
    assert two.expected_cost <= one.expected_cost * (1 + 1e-9)
    assert two.low_bid <= two.high_bid and two.low_bid_workers >= 1
    assert report.chosen.expected_cost == min(
        p.expected_cost for p in report.options.values() if p is not None
    )


def test_every_option_meets_the_deadline_and_error_target() -> None:
    for kw in ({"deadline_hours": 1.3}, {"deadline_hours": 6.0, "n_max": 5}, {"error_target": 0.02}):
        c = plan_config(**kw)
        for plan in plan_spot(c).options.values():
            if plan is None:
                continue
            again = evaluate(
                c, plan.high_bid_workers, plan.iterations, plan.high_bid, plan.low_bid_workers, plan.low_bid
            )
            assert again == plan and feasible(c, plan)
            assert plan.expected_error <= c.error_target * (1 + 1e-9)
            assert plan.expected_hours <= c.deadline_hours * (1 + 1e-9)


def _random_candidates(c: SpotPlanConfig, rng: np.random.Generator, count: int) -> list[Plan]:
    out = []
    for _ in range(count):
        n = int(rng.integers(1, c.n_max + 1))
        n_high = int(rng.integers(1, n + 1))
        j = int(rng.integers(1500, 12_000))
        b_high = float(rng.uniform(0.12, c.bid_cap))
        b_low = float(rng.uniform(0.1, b_high))
        out.append(evaluate(c, n_high, j, b_high, n - n_high, b_low if n > n_high else None))
    return out


def test_planner_beats_a_random_search_over_the_same_expressions() -> None:
    c = plan_config(n_max=6, deadline_hours=4.0, error_target=0.06)
    report = plan_spot(c)
    rng = np.random.default_rng(0)
    found = [p for p in _random_candidates(c, rng, 5_000) if feasible(c, p)]
    assert len(found) > 20
    best_random = min(p.expected_cost for p in found)
    assert report.chosen.expected_cost <= best_random * (1 + 1e-9)


def test_two_bid_plan_is_optimal_against_an_exhaustive_scan_over_iterations() -> None:
    # Independent scan with uniform prices in closed form: for every split and every J, the bids the
    # deadline (F(b_h) = J R / deadline) and the error target (smallest gamma) allow, then the cost.
    lo, hi = 0.1, 1.2
    c = plan_config(prices=UniformPrices(low=lo, high=hi), n_max=6, deadline_hours=4.0, error_target=0.06)
    conv, theta = c.convergence, c.deadline_hours * 3600
    best = np.inf
    for n in range(2, c.n_max + 1):
        for n_high in range(1, n):
            j = np.arange(1, 20_000)
            u = j * c.iteration_seconds / theta
            b_high = lo + u * (hi - lo)
            bj = conv.beta**j
            m = (c.error_target - bj * conv.initial_gap) * (1 - conv.beta) / (conv.noise_term * (1 - bj))
            gamma = (1 / n_high - m) / (1 / n_high - 1 / n)
            b_low = lo + gamma * u * (hi - lo)
            s = lambda b: (b**2 - lo**2) / (2 * (hi - lo))  # noqa: E731
            cost = j * c.iteration_seconds / 3600 * (n_high * s(b_high) + (n - n_high) * s(b_low)) / u
            ok = (b_high <= c.bid_cap) & (gamma > 0) & (gamma <= 1)
            if ok.any():
                best = min(best, float(cost[ok].min()))
    two = plan_spot(c).options["two-bids"]
    assert two is not None
    assert two.expected_cost == pytest.approx(best, rel=1e-6)
    # and the paper's Fig. 3: at the optimum both the error target and the deadline bind
    assert two.expected_error == pytest.approx(c.error_target, rel=1e-6)
    assert two.expected_hours == pytest.approx(c.deadline_hours, rel=1e-6)


def test_replaying_the_two_bid_plan_on_sampled_prices_matches_its_expectation() -> None:
    c = plan_config(prices=UniformPrices(low=0.0, high=1.0), deadline_hours=3.0, iteration_seconds=1.0)
    plan = plan_spot(c).options["two-bids"]
    assert plan is not None and plan.high_bid is not None and plan.low_bid is not None
    bids = [plan.high_bid] * plan.high_bid_workers + [plan.low_bid] * plan.low_bid_workers
    trace = sample_price_trace(c.prices, int(plan.iterations / plan.active_fraction * 1.3), 1.0, seed=11)
    acc = account_run(trace, bids, [1.0] * plan.iterations)
    assert acc.cost == pytest.approx(plan.expected_cost, rel=0.03)
    assert acc.wall_seconds / 3600 == pytest.approx(plan.expected_hours, rel=0.03)
    inv_y = np.mean([1 / y for y in acc.workers_per_unit])
    expected_inv = plan.full_fraction / plan.workers + (1 - plan.full_fraction) / plan.high_bid_workers
    assert inv_y == pytest.approx(expected_inv, rel=0.03)


def test_trace_prices_plan_on_their_empirical_distribution() -> None:
    trace = sample_price_trace(GaussianPrices(mean=0.4, std=0.15), 5000, 60.0, seed=2)
    report = plan_spot(plan_config(prices=empirical_prices(trace), deadline_hours=4.0))
    plan = report.chosen
    assert plan.strategy in ("one-bid", "two-bids")
    assert plan.high_bid is not None and plan.high_bid in trace.prices  # bids sit on recorded prices


def test_impossible_target_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match="error floor with 4 workers: 0.025"):
        plan_spot(plan_config(n_max=4, error_target=0.02))


# --------------------------------------------------------------------------- CLI


def test_cli_plan_spot_prints_the_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    argv = [
        "plan-spot",
        "--low",
        "0.1",
        "--high",
        "1.2",
        "--on-demand-price",
        "1.0",
        "--deadline-hours",
        "3",
        "--error-target",
        "0.05",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected = plan_spot(plan_config())
    assert f"plan: {expected.chosen.strategy}" in out
    assert f"expected cost {expected.chosen.expected_cost:.4f}" in out
    assert f"expected completion {expected.chosen.expected_hours:.3f} h" in out
    for strategy in ("on-demand", "one-bid", "two-bids"):
        assert strategy in out
    data = json.loads(out_json.read_text())
    assert data["chosen"]["expected_cost"] == pytest.approx(expected.chosen.expected_cost)


def test_cli_plan_spot_from_a_trace_and_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "prices.csv"
    rng = np.random.default_rng(5)
    rows = "\n".join(f"{60 * i},{p:.4f}" for i, p in enumerate(rng.uniform(0.1, 0.9, 600)))
    trace.write_text("timestamp,price\n" + rows + "\n")
    args = ["plan-spot", "--on-demand-price", "1", "--deadline-hours", "5", "--error-target", "0.05"]
    assert main([*args, "--trace", str(trace)]) == 0
    assert "prices: empirical, " in capsys.readouterr().out
    trace.write_text("timestamp,price\n0,0.5\n60,-1\n")
    assert main([*args, "--trace", str(trace)]) == 2
    assert "line 3: price '-1'" in capsys.readouterr().err
    assert main([*args, "--distribution", "gaussian", "--mean", "0.4"]) == 2
    assert "needs --mean and --std" in capsys.readouterr().err
    assert (
        main([*args, "--low", "0.1", "--high", "1", "--convergence", "mu=2", "--convergence", "step_size=1"])
        == 2
    )
    assert "alpha*c*mu" in capsys.readouterr().err


def test_cli_plan_spot_as_a_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", "plan-spot", "--distribution", "gaussian", "--mean", "0.5",
         "--std", "0.2", "--on-demand-price", "1", "--deadline-hours", "0.5", "--error-target", "0.05"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "no plan reaches error 0.05 within 0.5 h" in proc.stderr
