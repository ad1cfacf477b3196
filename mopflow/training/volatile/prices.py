"""Spot price distributions: uniform, Gaussian truncated at 0, or a trace's empirical distribution.

A worker with bid ``b`` is active (running and billed at the current price) while the price is
``<= b``; above its bid it is preempted and costs nothing. A distribution gives the quantities the
planner needs for a bid ``b``: ``F(b)`` (the fraction of time it is active), ``E[p; p <= b]`` and
the quantile (the bid that is active a given fraction of the time), as in Zhang, Wang, Joshi,
Joe-Wong, "Machine Learning on Volatile Instances" (INFOCOM 2020). Prices are per worker-hour.

Also the errors every price input raises (:class:`PriceError`, :class:`TraceExhaustedError`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from statistics import NormalDist
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

SECONDS_PER_HOUR = 3600.0
_STD_NORMAL = NormalDist()


class PriceError(ValueError):
    """Bad price input (trace file, distribution, bids or work record)."""


class TraceExhaustedError(PriceError):
    """The price trace ends before the work is done."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UniformPrices(_Frozen):
    """Spot price uniform on ``[low, high]`` (per worker-hour)."""

    kind: Literal["uniform"] = "uniform"
    low: float = Field(ge=0.0, allow_inf_nan=False)
    high: float = Field(gt=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> UniformPrices:
        if self.high <= self.low:
            raise ValueError(f"uniform prices need high > low, got low={self.low}, high={self.high}")
        return self

    def cdf(self, b: float) -> float:
        """F(b): the probability that the price is <= b (the fraction of time a bid b is active)."""
        return min(1.0, max(0.0, (b - self.low) / (self.high - self.low)))

    def partial_mean(self, b: float) -> float:
        """E[p; p <= b] = the integral of p dF(p) over [0, b]."""
        top = min(max(b, self.low), self.high)
        return (top * top - self.low * self.low) / (2.0 * (self.high - self.low))

    def quantile(self, u: float) -> float:
        """The smallest bid b with F(b) >= u."""
        return self.low + _unit(u) * (self.high - self.low)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` i.i.d. prices."""
        return rng.uniform(self.low, self.high, size)


class GaussianPrices(_Frozen):
    """Spot price N(mean, std^2) truncated to [0, inf) (prices are never negative)."""

    kind: Literal["gaussian"] = "gaussian"
    mean: float = Field(allow_inf_nan=False)
    std: float = Field(gt=0.0, allow_inf_nan=False)

    def _z(self, b: float) -> float:
        return (b - self.mean) / self.std

    def _mass_below_zero(self) -> float:
        return _STD_NORMAL.cdf(self._z(0.0))

    def cdf(self, b: float) -> float:
        """F(b) of the truncated Gaussian."""
        if b <= 0.0:
            return 0.0
        lo = self._mass_below_zero()
        return min(1.0, max(0.0, (_STD_NORMAL.cdf(self._z(b)) - lo) / (1.0 - lo)))

    def partial_mean(self, b: float) -> float:
        """E[p; p <= b]: mean*(Phi(z_b)-Phi(z_0)) + std*(phi(z_0)-phi(z_b)), over the kept mass."""
        if b <= 0.0:
            return 0.0
        z0, zb = self._z(0.0), self._z(b)
        mass = _STD_NORMAL.cdf(zb) - _STD_NORMAL.cdf(z0)
        value = self.mean * mass + self.std * (_STD_NORMAL.pdf(z0) - _STD_NORMAL.pdf(zb))
        return max(0.0, value / (1.0 - self._mass_below_zero()))

    def quantile(self, u: float) -> float:
        """The bid b with F(b) = u (inf for u = 1: the Gaussian has no top)."""
        u = _unit(u)
        if u >= 1.0:
            return math.inf
        lo = self._mass_below_zero()
        p = lo + u * (1.0 - lo)
        if p <= 0.0:
            return 0.0
        return max(0.0, self.mean + self.std * _STD_NORMAL.inv_cdf(p))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` i.i.d. prices by inverting the CDF (exact, whatever the truncated mass)."""
        return np.array([self.quantile(float(u)) for u in rng.uniform(0.0, 1.0, size)])


class EmpiricalPrices(_Frozen):
    """A discrete price distribution: ``prices`` with ``weights`` (e.g. time spent at each price)."""

    kind: Literal["empirical"] = "empirical"
    prices: tuple[float, ...]
    weights: tuple[float, ...]
    _cum_weight: list[float] = PrivateAttr(default_factory=list)
    _cum_value: list[float] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _valid(self) -> EmpiricalPrices:
        if not self.prices or len(self.prices) != len(self.weights):
            raise ValueError(
                f"empirical prices need as many weights as prices (>= 1), got {len(self.prices)} prices"
                f" and {len(self.weights)} weights"
            )
        if any(not math.isfinite(p) or p < 0 for p in self.prices):
            raise ValueError(f"empirical prices must be finite and >= 0, got {self.prices}")
        if any(not math.isfinite(w) or w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("empirical weights must be finite, >= 0 and not all 0")
        if list(self.prices) != sorted(self.prices):
            raise ValueError("empirical prices must be sorted ascending (use empirical_prices())")
        return self

    def model_post_init(self, __context: object) -> None:
        # Cumulative sums once: planning calls cdf/partial_mean/quantile many times.
        total = sum(self.weights)
        self._cum_weight = list(itertools.accumulate(w / total for w in self.weights))
        self._cum_value = list(
            itertools.accumulate(p * w / total for p, w in zip(self.prices, self.weights, strict=True))
        )

    def cdf(self, b: float) -> float:
        """Weight fraction of prices <= b."""
        i = bisect.bisect_right(self.prices, b)
        return 0.0 if i == 0 else min(1.0, self._cum_weight[i - 1])

    def partial_mean(self, b: float) -> float:
        """E[p; p <= b]."""
        i = bisect.bisect_right(self.prices, b)
        return 0.0 if i == 0 else self._cum_value[i - 1]

    def quantile(self, u: float) -> float:
        """The smallest recorded price b with F(b) >= u."""
        u = _unit(u)
        i = bisect.bisect_left(self._cum_weight, u - 1e-12)
        return self.prices[min(i, len(self.prices) - 1)]

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` i.i.d. draws with the recorded weights."""
        w = np.asarray(self.weights, dtype=float)
        return rng.choice(np.asarray(self.prices, dtype=float), size=size, p=w / w.sum())


PriceDistribution = Annotated[UniformPrices | GaussianPrices | EmpiricalPrices, Field(discriminator="kind")]


def _unit(u: float) -> float:
    if not 0.0 <= u <= 1.0 or math.isnan(u):
        raise PriceError(f"a probability must lie in [0, 1], got {u}")
    return u


def conditional_mean(dist: PriceDistribution, b: float) -> float:
    """E[p | p <= b]: the mean price paid by a worker with bid b while it is active."""
    mass = dist.cdf(b)
    if mass <= 0.0:
        raise PriceError(f"bid {b} is never active under {dist.kind} prices (F(b) = 0)")
    return dist.partial_mean(b) / mass
