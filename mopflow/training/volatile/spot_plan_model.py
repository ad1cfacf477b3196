"""The terms of a spot plan: the error bound, the planner's inputs, and a plan's expected outcome.

The expressions are those of Zhang, Wang, Joshi, Joe-Wong, "Machine Learning on Volatile Instances:
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

Bids are capped at ``max_bid`` (default: the on-demand price, as clouds do); a plan is feasible when
its expected completion time is within the deadline and its error bound within the target. The
search for the cheapest plan is :mod:`mopflow.training.volatile.spot_plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mopflow.training.volatile.prices import SECONDS_PER_HOUR, PriceDistribution

Strategy = Literal["on-demand", "one-bid", "two-bids"]
STRATEGIES: tuple[Strategy, ...] = ("on-demand", "one-bid", "two-bids")
ROUNDOFF_TOL = 1e-9  # relative slack for float round-off in the deadline and error checks


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
    bids_ok = all(
        b is None or b <= config.bid_cap * (1 + ROUNDOFF_TOL) for b in (plan.high_bid, plan.low_bid)
    )
    return (
        bids_ok
        and plan.expected_hours <= config.deadline_hours * (1 + ROUNDOFF_TOL)
        and plan.expected_error <= config.error_target * (1 + ROUNDOFF_TOL)
    )
