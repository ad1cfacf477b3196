"""Planning a training run on volatile workers: on-demand, one bid, or two bids, and how many workers.

The analysis follows Zhang, Wang, Joshi, Joe-Wong, "Machine Learning on Volatile Instances:
Convergence, Runtime, and Cost Tradeoffs" (INFOCOM 2020):

* Error (full-sync SGD, y_j active workers at iteration j, step size alpha):
  ``E[G(w_{J+1}) - G*] <= beta^J A + B (1 - beta^J) / (1 - beta) * E[1/y]`` with
  ``beta = 1 - alpha c mu``, ``B = alpha^2 L M / 2``, ``A = E[G(w_1) - G*]``.
* Prices are i.i.d. per iteration slot with CDF F. With one bid b for all n workers, every iteration
  runs with y = n workers and the run is active a fraction F(b) of the time:
  ``E[time] = J R / F(b)``, ``E[cost] = n J R E[p | p <= b]``.
* With two bids (n_h workers bid b_h, n_l workers bid b_l <= b_h) an iteration runs when p <= b_h,
  with all n = n_h + n_l workers when p <= b_l (probability gamma = F(b_l)/F(b_h)) and with n_h otherwise:
  ``E[1/y] = gamma/n + (1-gamma)/n_h``, ``E[time] = J R / F(b_h)``,
  ``E[cost] = J R (n_h S(b_h) + n_l S(b_l)) / F(b_h)`` with ``S(b) = E[p; p <= b]``.

How the optimum is found (exact on the same expressions, no closed-form approximation):

* on-demand and one bid: for each worker count n, the fewest iterations J(n) that reach the error
  target (closed form); one bid: cost grows with b, so the optimal bid is the smallest one that
  meets the deadline in expectation, ``b* = F^{-1}(J R / deadline)`` (the paper's one-bid result);
  then the cheapest n is picked by enumerating n = 1..n_max.
* two bids: for fixed (n, n_h, J) cost grows with gamma and with F(b_h), so the optimum takes the
  smallest gamma that meets the error target and the smallest F(b_h) that meets the deadline (the
  paper's Fig. 3 argument); J is then searched numerically (a geometric grid refined with a dense scan
  around the best point), for every n <= n_max and split n_h < n.

Bids are capped at ``max_bid`` (default: the on-demand price, as clouds do); a plan is feasible when
its expected completion time is within the deadline and its error bound within the target.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.volatile.cost import SECONDS_PER_HOUR, PriceDistribution

Strategy = Literal["on-demand", "one-bid", "two-bids"]
STRATEGIES: tuple[Strategy, ...] = ("on-demand", "one-bid", "two-bids")
_TOL = 1e-9  # relative slack for float round-off in the deadline and error checks
_REFINED_PAIRS = 6  # (n, n_h) pairs whose J is refined after the coarse grid


class PlanError(ValueError):
    """No plan can meet the deadline and the error target."""


class ConvergenceModel(BaseModel):
    """The constants of the paper's error bound (its notation); defaults describe a generic task.

    With the defaults, beta = 0.999 and the error floor B/(1-beta)/n is 0.1/n: one worker can never
    reach an error of 0.05, sixteen need about 3,100 iterations.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_size: float = Field(0.05, gt=0.0, allow_inf_nan=False, description="alpha")
    c: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="gradient-direction constant c")
    mu: float = Field(0.02, gt=0.0, allow_inf_nan=False, description="strong convexity mu")
    lipschitz: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="smoothness L")
    noise: float = Field(0.08, gt=0.0, allow_inf_nan=False, description="gradient variance bound M")
    initial_gap: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="A = E[G(w_1) - G*]")

    @model_validator(mode="after")
    def _contracts(self) -> ConvergenceModel:
        rate = self.step_size * self.c * self.mu
        if not 0.0 < rate < 1.0:
            raise ValueError(f"alpha*c*mu must lie in (0, 1) for the bound to contract, got {rate}")
        return self

    @property
    def beta(self) -> float:
        """Contraction per iteration, 1 - alpha c mu."""
        return 1.0 - self.step_size * self.c * self.mu

    @property
    def noise_term(self) -> float:
        """B = alpha^2 L M / 2."""
        return self.step_size**2 * self.lipschitz * self.noise / 2.0

    def error(self, iterations: int, inv_workers: float) -> float:
        """The error bound after J iterations with E[1/y_j] = ``inv_workers``."""
        bj = self.beta**iterations
        return bj * self.initial_gap + self.noise_term * (1.0 - bj) / (1.0 - self.beta) * inv_workers

    def floor(self, inv_workers: float) -> float:
        """The bound's limit as J grows: B E[1/y] / (1 - beta)."""
        return self.noise_term / (1.0 - self.beta) * inv_workers

    def min_iterations(self, inv_workers: float, target: float) -> int | None:
        """The fewest iterations J >= 1 whose bound is <= target (None if the floor is above it)."""
        floor = self.floor(inv_workers)
        if floor >= target:
            return None
        if self.initial_gap <= target:
            return 1
        # beta^J (A - floor) <= target - floor
        j = math.ceil(math.log((target - floor) / (self.initial_gap - floor)) / math.log(self.beta) - 1e-12)
        while j > 1 and self.error(j - 1, inv_workers) <= target:
            j -= 1
        while self.error(j, inv_workers) > target:
            j += 1
        return max(1, j)

    def max_inv_workers(self, iterations: int, target: float) -> float:
        """The largest E[1/y] whose bound after J iterations is <= target (negative: impossible)."""
        bj = self.beta**iterations
        return (target - bj * self.initial_gap) * (1.0 - self.beta) / (self.noise_term * (1.0 - bj))


class SpotPlanConfig(BaseModel):
    """Inputs of :func:`plan_spot`. Prices are per worker-hour; times in hours unless named seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prices: PriceDistribution
    deadline_hours: float = Field(gt=0.0, allow_inf_nan=False)
    error_target: float = Field(gt=0.0, allow_inf_nan=False)
    n_max: int = Field(16, ge=1, le=256, description="most workers (the two-bid search grows with it)")
    on_demand_price: float = Field(gt=0.0, allow_inf_nan=False)
    iteration_seconds: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="R: one iteration's time")
    max_bid: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="default: on-demand price")
    convergence: ConvergenceModel = ConvergenceModel()
    iteration_grid: int = Field(160, ge=8, le=10_000, description="grid points over J for two bids")

    @property
    def bid_cap(self) -> float:
        """The highest bid allowed."""
        return self.on_demand_price if self.max_bid is None else self.max_bid

    @property
    def deadline_seconds(self) -> float:
        """The deadline in seconds."""
        return self.deadline_hours * SECONDS_PER_HOUR


@dataclass(frozen=True)
class Plan:
    """One strategy's expected outcome (money in the price unit, times in hours)."""

    strategy: Strategy
    high_bid_workers: int
    low_bid_workers: int
    high_bid: float | None  # None: on-demand
    low_bid: float | None  # None: no low-bid workers
    iterations: int
    expected_cost: float
    expected_hours: float
    expected_idle_hours: float
    expected_error: float
    active_fraction: float  # F(b_h): fraction of time the run makes progress
    full_fraction: float  # gamma = F(b_l)/F(b_h): fraction of iterations with every worker

    @property
    def workers(self) -> int:
        """All provisioned workers."""
        return self.high_bid_workers + self.low_bid_workers


@dataclass(frozen=True)
class PlanReport:
    """The chosen plan and the best plan of each strategy (None with a reason when infeasible)."""

    chosen: Plan
    options: dict[Strategy, Plan | None]
    reasons: dict[Strategy, str]


def evaluate(
    config: SpotPlanConfig,
    high_bid_workers: int,
    iterations: int,
    high_bid: float | None,
    low_bid_workers: int = 0,
    low_bid: float | None = None,
) -> Plan:
    """Expected cost, completion time and error of a given plan (``high_bid=None``: on-demand)."""
    conv, r = config.convergence, config.iteration_seconds
    work_hours = iterations * r / SECONDS_PER_HOUR
    if high_bid is None:
        inv = 1.0 / high_bid_workers
        return Plan(
            "on-demand",
            high_bid_workers,
            0,
            None,
            None,
            iterations,
            high_bid_workers * work_hours * config.on_demand_price,
            work_hours,
            0.0,
            conv.error(iterations, inv),
            1.0,
            1.0,
        )
    dist = config.prices
    u = dist.cdf(high_bid)
    if u <= 0.0:
        raise PlanError(f"bid {high_bid} is never active (F(b) = 0)")
    spend = high_bid_workers * dist.partial_mean(high_bid)
    gamma = 1.0
    if low_bid_workers:
        if low_bid is None or low_bid > high_bid:
            raise PlanError(f"the low bid {low_bid} must be given and <= the high bid {high_bid}")
        gamma = dist.cdf(low_bid) / u
        spend += low_bid_workers * dist.partial_mean(low_bid)
    n = high_bid_workers + low_bid_workers
    inv = gamma / n + (1.0 - gamma) / high_bid_workers
    hours = work_hours / u
    return Plan(
        "two-bids" if low_bid_workers else "one-bid",
        high_bid_workers,
        low_bid_workers,
        high_bid,
        low_bid if low_bid_workers else None,
        iterations,
        work_hours * spend / u,
        hours,
        hours - work_hours,
        conv.error(iterations, inv),
        u,
        gamma,
    )


def feasible(config: SpotPlanConfig, plan: Plan) -> bool:
    """Whether a plan meets the deadline and the error target (in expectation), bids within the cap."""
    bids_ok = all(b is None or b <= config.bid_cap * (1 + _TOL) for b in (plan.high_bid, plan.low_bid))
    return (
        bids_ok
        and plan.expected_hours <= config.deadline_hours * (1 + _TOL)
        and plan.expected_error <= config.error_target * (1 + _TOL)
    )


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


def theorem7_workers_iterations(
    conv: ConvergenceModel, target: float, max_iterations: int | None = None
) -> tuple[int, int]:
    """The paper's closed form (Theorem 7) for the (n, J) minimising n J, i.e. cost at a fixed price.

    J~ solves ``A x (J ln(1/beta) + 1 - x) / (1 + x (J ln(1/beta) - 1)) = target`` with x = beta^J
    (the stationary point of ``J (1 - x) / (target - A x)``); J* is the better of floor/ceil of J~,
    capped at ``max_iterations`` (the deadline); ``n* = ceil(B (1 - x) / ((1 - beta)(target - A x)))``,
    here with x = beta^(J*) rather than beta^(J~) so that (n*, J*) itself meets the target.
    A cross-check of the enumeration in :func:`best_on_demand`, which is exact over integers.
    """
    beta, a, b = conv.beta, conv.initial_gap, conv.noise_term
    if target >= a:
        return 1, 1
    l = math.log(1.0 / beta)  # noqa: E741  (the paper's ln(1/beta))

    def lhs(j: float) -> float:
        x = beta**j
        return a * x * (j * l + 1.0 - x) / (1.0 + x * (j * l - 1.0))

    lo, hi = 1e-9, 1.0
    while lhs(hi) > target:  # lhs falls from A towards 0 as J grows
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if lhs(mid) > target else (lo, mid)
    j_tilde = hi

    def workers(j: float) -> float:
        x = beta**j
        return b * (1.0 - x) / ((1.0 - beta) * (target - a * x))

    candidates = [j for j in (math.floor(j_tilde), math.ceil(j_tilde)) if j >= 1 and a * beta**j < target]
    j_star = min(candidates, key=lambda j: j * workers(j))
    if max_iterations is not None:
        j_star = min(j_star, max_iterations)
    if a * beta**j_star >= target:
        raise PlanError(f"{j_star} iterations cannot reach error {target} with any number of workers")
    return math.ceil(workers(j_star) - 1e-12), j_star


def _deadline_bid(config: SpotPlanConfig, iterations: int) -> float | None:
    """The smallest bid whose active fraction meets the deadline for J iterations (None: above the cap)."""
    need = iterations * config.iteration_seconds / config.deadline_seconds
    cap = config.bid_cap
    if need > config.prices.cdf(cap) * (1 + _TOL):
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
    if side.max_inv < inv_all * (1 - _TOL):
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
    top_iterations = math.floor(config.deadline_seconds * config.prices.cdf(config.bid_cap) / r * (1 + _TOL))
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


def with_strategy(report: PlanReport, strategy: Strategy) -> PlanReport:
    """The same report with another (feasible) strategy chosen, e.g. to force on-demand."""
    plan = report.options.get(strategy)
    if plan is None:
        raise PlanError(f"strategy {strategy} is infeasible: {report.reasons.get(strategy, '?')}")
    return replace(report, chosen=plan)


def format_report(config: SpotPlanConfig, report: PlanReport) -> str:
    """The table that ``mopflow plan-spot`` prints."""
    lines = [
        f"prices: {describe_prices(config)}; on-demand {config.on_demand_price:g}/worker-hour; bid cap {config.bid_cap:g}",
        f"target: error <= {config.error_target:g} within {config.deadline_hours:g} h; n_max {config.n_max};"
        f" {config.iteration_seconds:g} s/iteration; beta {config.convergence.beta:.6g},"
        f" B {config.convergence.noise_term:.4g}, A {config.convergence.initial_gap:g}",
        "",
        f"{'strategy':10} {'workers':>11} {'bids (high/low)':>17} {'iterations':>10} {'E[hours]':>9}"
        f" {'E[idle h]':>9} {'E[cost]':>10} {'E[error]':>9} {'active':>7}",
    ]
    for strategy in STRATEGIES:
        plan = report.options[strategy]
        if plan is None:
            lines.append(f"{strategy:10} infeasible: {report.reasons.get(strategy, '')}")
            continue
        workers = f"{plan.high_bid_workers}" + (f"+{plan.low_bid_workers}" if plan.low_bid_workers else "")
        bids = "-" if plan.high_bid is None else f"{plan.high_bid:.4g}"
        if plan.low_bid is not None:
            bids += f"/{plan.low_bid:.4g}"
        lines.append(
            f"{strategy:10} {workers:>11} {bids:>17} {plan.iterations:>10} {plan.expected_hours:>9.3f}"
            f" {plan.expected_idle_hours:>9.3f} {plan.expected_cost:>10.4f} {plan.expected_error:>9.4f}"
            f" {plan.active_fraction:>7.1%}"
        )
    c = report.chosen
    lines.append("")
    if c.high_bid is None:
        what = f"{c.workers} on-demand workers"
    elif c.low_bid is None:
        what = f"{c.workers} spot workers bidding {c.high_bid:.4g}"
    else:
        what = f"{c.high_bid_workers} spot workers bidding {c.high_bid:.4g} and {c.low_bid_workers} bidding {c.low_bid:.4g}"
    od = report.options["on-demand"]
    saving = f" ({1 - c.expected_cost / od.expected_cost:.0%} below on-demand)" if od and c is not od else ""
    lines.append(
        f"plan: {c.strategy} - {what} for {c.iterations} iterations; expected cost {c.expected_cost:.4f}"
        f"{saving}, expected completion {c.expected_hours:.3f} h"
    )
    return "\n".join(lines)


def describe_prices(config: SpotPlanConfig) -> str:
    """One line naming the price distribution."""
    p = config.prices
    if p.kind == "uniform":
        return f"uniform on [{p.low:g}, {p.high:g}]"
    if p.kind == "gaussian":
        return f"Gaussian mean {p.mean:g}, std {p.std:g} (truncated at 0)"
    return f"empirical, {len(p.prices)} distinct prices in [{p.prices[0]:g}, {p.prices[-1]:g}]"


def report_as_dict(config: SpotPlanConfig, report: PlanReport) -> dict[str, object]:
    """The report as plain data (JSON output of ``mopflow plan-spot --json``)."""

    def plan_dict(plan: Plan | None) -> dict[str, object] | None:
        return None if plan is None else {**asdict(plan), "workers": plan.workers}

    return {
        "config": config.model_dump(mode="json"),
        "chosen": plan_dict(report.chosen),
        "options": {s: plan_dict(p) for s, p in report.options.items()},
        "reasons": dict(report.reasons),
    }
