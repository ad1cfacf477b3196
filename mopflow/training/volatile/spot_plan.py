"""Planning a training run on volatile workers: on-demand, one bid, or two bids, and how many workers.

The cost, time and error of a plan are the paper's expressions (:mod:`mopflow.training.volatile.spot_plan_model`);
this module finds the cheapest plan of each strategy and picks among them. How the optimum is found
(exact on the same expressions, no closed-form approximation):

* on-demand and one bid: for each worker count n, the fewest iterations J(n) that reach the error
  target (closed form); one bid: cost grows with b, so the optimal bid is the smallest one that
  meets the deadline in expectation, ``b* = F^{-1}(J R / deadline)`` (the paper's one-bid result);
  then the cheapest n is picked by enumerating n = 1..n_max.
* two bids: for fixed (n, n_h, J) cost grows with gamma and with F(b_h), so the optimum takes the
  smallest gamma that meets the error target and the smallest F(b_h) that meets the deadline (the
  paper's Fig. 3 argument); J is then searched numerically (a geometric grid refined with a dense scan
  around the best point), for every n <= n_max and split n_h < n.

The printed table and JSON form of a report are :mod:`mopflow.training.volatile.spot_plan_report`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mopflow.training.volatile.prices import SECONDS_PER_HOUR
from mopflow.training.volatile.spot_plan_model import (
    ROUNDOFF_TOL,
    Plan,
    PlanError,
    PlanReport,
    SpotPlanConfig,
    Strategy,
    evaluate,
    feasible,
)

_REFINED_PAIRS = 6  # (n, n_h) pairs whose J is refined after the coarse grid


def _cheapest(plans: list[Plan]) -> Plan | None:
    # Ties go to fewer workers, then fewer iterations: less to provision for the same money.
    return min(plans, key=lambda p: (p.expected_cost, p.workers, p.iterations), default=None)


def best_on_demand(config: SpotPlanConfig) -> Plan | None:
    """The cheapest on-demand plan: n workers for the fewest iterations reaching the target."""
    plans = []
    for n in range(1, config.n_max + 1):
        j = config.convergence.min_iterations(1.0 / n, config.error_target)
        if j is not None:
            plan = evaluate(config, n, j, None)
            if feasible(config, plan):
                plans.append(plan)
    return _cheapest(plans)


def _deadline_bid(config: SpotPlanConfig, iterations: int) -> float | None:
    """The smallest bid whose active fraction meets the deadline for J iterations (None: above the cap)."""
    need = iterations * config.iteration_seconds / config.deadline_seconds
    cap = config.bid_cap
    if need > config.prices.cdf(cap) * (1 + ROUNDOFF_TOL):
        return None
    return min(config.prices.quantile(min(need, 1.0)), cap)


def best_one_bid(config: SpotPlanConfig) -> Plan | None:
    """The cheapest one-bid plan: b* = F^{-1}(J R / deadline) for each n, the cheapest n."""
    plans = []
    for n in range(1, config.n_max + 1):
        j = config.convergence.min_iterations(1.0 / n, config.error_target)
        if j is None:
            continue
        bid = _deadline_bid(config, j)
        if bid is None or config.prices.cdf(bid) <= 0.0:
            continue
        plan = evaluate(config, n, j, bid)
        if feasible(config, plan):
            plans.append(plan)
    return _cheapest(plans)


@dataclass(frozen=True)
class _HighSide:
    iterations: int
    bid: float
    active: float  # F(b_h)
    spend: float  # S(b_h)
    max_inv: float  # largest E[1/y] meeting the error target


def _high_side(config: SpotPlanConfig, iterations: int) -> _HighSide | None:
    bid = _deadline_bid(config, iterations)
    if bid is None:
        return None
    active = config.prices.cdf(bid)
    if active <= 0.0:
        return None
    return _HighSide(
        iterations,
        bid,
        active,
        config.prices.partial_mean(bid),
        config.convergence.max_inv_workers(iterations, config.error_target),
    )


def _two_bid_cost(config: SpotPlanConfig, side: _HighSide, n: int, n_high: int) -> tuple[float, float] | None:
    """(expected cost, low bid) of n_high high-bid and n - n_high low-bid workers, or None."""
    inv_high, inv_all = 1.0 / n_high, 1.0 / n
    if side.max_inv < inv_all * (1 - ROUNDOFF_TOL):
        return None
    gamma = (inv_high - side.max_inv) / (inv_high - inv_all)
    if gamma <= 0.0:  # the high-bid workers alone meet the target: that is a one-bid plan
        return None
    low_bid = config.prices.quantile(min(1.0, gamma * side.active))
    low_bid = min(low_bid, side.bid)
    spend = n_high * side.spend + (n - n_high) * config.prices.partial_mean(low_bid)
    work_hours = side.iterations * config.iteration_seconds / SECONDS_PER_HOUR
    return work_hours * spend / side.active, low_bid


def _iteration_grid(config: SpotPlanConfig, lo: int, hi: int) -> list[int]:
    dense = range(lo, min(hi, lo + 32) + 1)
    geo = np.unique(np.round(np.geomspace(lo, hi, config.iteration_grid)).astype(int))
    return sorted(set(dense) | {int(j) for j in geo})


def best_two_bids(config: SpotPlanConfig) -> Plan | None:
    """The cheapest plan with two bids (n_h workers at b_h, n - n_h >= 1 at b_l < b_h), over n, n_h and J."""
    conv, r = config.convergence, config.iteration_seconds
    top_iterations = math.floor(
        config.deadline_seconds * config.prices.cdf(config.bid_cap) / r * (1 + ROUNDOFF_TOL)
    )
    coarse: list[tuple[float, int, int, int, list[int]]] = []  # (cost, n, n_high, J, grid)
    cache: dict[int, _HighSide | None] = {}

    def side_of(j: int) -> _HighSide | None:
        if j not in cache:
            cache[j] = _high_side(config, j)
        return cache[j]

    def cost_at(j: int, n: int, n_high: int) -> float:
        s = side_of(j)
        c = _two_bid_cost(config, s, n, n_high) if s else None
        return math.inf if c is None else c[0]

    for n in range(2, config.n_max + 1):
        lo = conv.min_iterations(1.0 / n, config.error_target)
        if lo is None or lo > top_iterations:
            continue
        grid = _iteration_grid(config, lo, top_iterations)
        first = side_of(lo)
        if first is None:
            continue
        # The high-bid workers alone cost at least this much each (J >= lo, and both the work and
        # E[p | p <= b_h] grow with J): splits with more of them cannot beat the best found so far.
        floor_per_high = lo * r / SECONDS_PER_HOUR * first.spend / first.active
        for n_high in range(1, n):
            if coarse and n_high * floor_per_high >= min(coarse)[0]:
                break
            cost, j = min((cost_at(j, n, n_high), j) for j in grid)
            if math.isfinite(cost):
                coarse.append((cost, n, n_high, j, grid))
    best: tuple[float, int, int, int] | None = None  # (cost, n, n_high, J)
    # Refine the few best (n, n_h) with a dense scan between the grid neighbours of their best J:
    # the cost is smooth in J, so a near-best pair on the grid is near-best after refinement too.
    for cost, n, n_high, j, grid in sorted(coarse, key=lambda t: t[:4])[:_REFINED_PAIRS]:
        k = grid.index(j)
        left, right = grid[max(0, k - 1)], grid[min(len(grid) - 1, k + 1)]
        step = max(1, (right - left) // 512)
        cost, j = min([(cost, j)] + [(cost_at(jj, n, n_high), jj) for jj in range(left, right + 1, step)])
        if best is None or (cost, n, n_high, j) < best:
            best = (cost, n, n_high, j)
    if best is None:
        return None
    _, n, n_high, j = best
    side = side_of(j)
    assert side is not None
    found = _two_bid_cost(config, side, n, n_high)
    assert found is not None
    plan = evaluate(config, n_high, j, side.bid, n - n_high, found[1])
    return plan if feasible(config, plan) else None


def plan_spot(config: SpotPlanConfig) -> PlanReport:
    """Choose the cheapest of on-demand, one bid and two bids that meets the deadline and error target."""
    options: dict[Strategy, Plan | None] = {
        "on-demand": best_on_demand(config),
        "one-bid": best_one_bid(config),
        "two-bids": best_two_bids(config),
    }
    reasons = {s: _why_not(config, s) for s, p in options.items() if p is None}
    chosen = _cheapest([p for p in options.values() if p is not None])
    if chosen is None:
        floor = config.convergence.floor(1.0 / config.n_max)
        raise PlanError(
            f"no plan reaches error {config.error_target} within {config.deadline_hours} h with at most"
            f" {config.n_max} workers (error floor with {config.n_max} workers: {floor:.4g}); raise the"
            " deadline, n_max or the error target"
        )
    return PlanReport(chosen, options, reasons)


def _why_not(config: SpotPlanConfig, strategy: Strategy) -> str:
    conv = config.convergence
    best_j = conv.min_iterations(1.0 / config.n_max, config.error_target)
    if best_j is None:
        return f"error floor {conv.floor(1.0 / config.n_max):.4g} with {config.n_max} workers is above the target"
    hours = best_j * config.iteration_seconds / SECONDS_PER_HOUR
    if strategy == "on-demand":
        return f"needs {hours:.3g} h even with {config.n_max} workers"
    active = config.prices.cdf(config.bid_cap)
    if strategy == "two-bids" and config.n_max < 2:
        return "needs at least 2 workers"
    if hours / active > config.deadline_hours:
        return f"needs {hours / active:.3g} h in expectation at the bid cap {config.bid_cap:g} (active {active:.1%})"
    return "never cheaper than the high-bid workers alone (gamma = 0)"
