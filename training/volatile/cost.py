"""Cost model for volatile (spot) workers: prices, bids, and the accounting of a run.

A worker with bid ``b`` is active (running and billed at the current price) while the price is
``<= b``; above its bid it is preempted and costs nothing. Prices are per worker-hour and come from
a recorded trace (CSV ``timestamp,price``) or a distribution (uniform, Gaussian truncated at 0, or
the time-weighted empirical distribution of a trace), as in Zhang, Wang, Joshi, Joe-Wong,
"Machine Learning on Volatile Instances" (INFOCOM 2020).

Everything here is pure except :func:`load_price_trace` (reads a file) and :func:`log_run_account`
(writes through an injected :class:`~infra.tracking.Tracker`).
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from statistics import NormalDist
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from infra.tracking import Tracker

SECONDS_PER_HOUR = 3600.0
_STD_NORMAL = NormalDist()


class PriceError(ValueError):
    """Bad price input (trace file, distribution, bids or work record)."""


class TraceExhaustedError(PriceError):
    """The price trace ends before the work is done."""


# --------------------------------------------------------------------------- distributions


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


# --------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class PriceTrace:
    """Piecewise-constant prices: ``prices[i]`` holds on ``[times[i], times[i+1])``, the last until ``end``.

    Times are seconds (any origin); prices are per worker-hour.
    """

    times: tuple[float, ...]
    prices: tuple[float, ...]
    end: float

    def __post_init__(self) -> None:
        if not self.times or len(self.times) != len(self.prices):
            raise PriceError(
                f"a price trace needs as many prices as times (>= 1), got {len(self.times)} times"
                f" and {len(self.prices)} prices"
            )
        for i, (a, b) in enumerate(zip(self.times, self.times[1:], strict=False)):
            if not b > a:
                raise PriceError(f"trace times must increase strictly: times[{i + 1}]={b} after {a}")
        for i, p in enumerate(self.prices):
            if not math.isfinite(p) or p < 0:
                raise PriceError(f"trace prices must be finite and >= 0: prices[{i}]={p}")
        if not self.end > self.times[-1]:
            raise PriceError(f"trace end {self.end} must come after its last time {self.times[-1]}")

    @property
    def start(self) -> float:
        """The first time with a price."""
        return self.times[0]

    def index_at(self, t: float) -> int:
        """Index of the segment holding time t (t in [start, end))."""
        if not self.start <= t < self.end:
            raise TraceExhaustedError(f"time {t} is outside the price trace [{self.start}, {self.end})")
        return bisect.bisect_right(self.times, t) - 1

    def segment_end(self, i: int) -> float:
        """End of segment i."""
        return self.times[i + 1] if i + 1 < len(self.times) else self.end


def _parse_timestamp(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return stamp.timestamp()


def parse_price_csv(text: str, source: str = "<csv>", end: float | None = None) -> PriceTrace:
    """A :class:`PriceTrace` from CSV text with header ``timestamp,price``.

    Timestamps are seconds (numbers) or ISO-8601 date-times, strictly increasing; prices are finite
    and >= 0 per worker-hour. Each price holds until the next row; the last row's price holds until
    ``end`` (default: its timestamp plus the median spacing of the rows). Every bad row is refused with
    its line number and value.
    """
    rows = list(csv.reader(io.StringIO(text)))
    rows_with_lines = [(n, r) for n, r in enumerate(rows, start=1) if r and any(c.strip() for c in r)]
    if not rows_with_lines:
        raise PriceError(f"{source}: empty price trace; expected a header 'timestamp,price' and rows")
    header_line, header = rows_with_lines[0]
    if [c.strip().lower() for c in header] != ["timestamp", "price"]:
        raise PriceError(
            f"{source} line {header_line}: expected the header 'timestamp,price', got {header!r}"
        )
    times: list[float] = []
    prices: list[float] = []
    for line, row in rows_with_lines[1:]:
        if len(row) != 2:
            raise PriceError(f"{source} line {line}: expected 2 fields (timestamp,price), got {row!r}")
        stamp_text, price_text = row[0].strip(), row[1].strip()
        try:
            stamp = _parse_timestamp(stamp_text)
        except ValueError:
            raise PriceError(
                f"{source} line {line}: timestamp {stamp_text!r} is neither seconds nor an ISO-8601 date-time"
            ) from None
        try:
            price = float(price_text)
        except ValueError:
            raise PriceError(f"{source} line {line}: price {price_text!r} is not a number") from None
        if not math.isfinite(stamp):
            raise PriceError(f"{source} line {line}: timestamp {stamp_text!r} is not finite")
        if not math.isfinite(price) or price < 0:
            raise PriceError(f"{source} line {line}: price {price_text!r} must be a finite number >= 0")
        if times and stamp <= times[-1]:
            raise PriceError(
                f"{source} line {line}: timestamp {stamp_text!r} does not come after the previous row's"
                " (timestamps must increase strictly)"
            )
        times.append(stamp)
        prices.append(price)
    if end is None:
        if len(times) < 2:
            raise PriceError(f"{source}: need at least 2 price rows (or an explicit end), got {len(times)}")
        end = times[-1] + float(np.median(np.diff(times)))
    return PriceTrace(tuple(times), tuple(prices), float(end))


def load_price_trace(path: str | Path, end: float | None = None) -> PriceTrace:
    """Read a ``timestamp,price`` CSV file (see :func:`parse_price_csv`)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise PriceError(f"cannot read price trace {file}: {exc}") from exc
    return parse_price_csv(text, source=str(file), end=end)


def sample_price_trace(
    dist: PriceDistribution, slots: int, slot_seconds: float, seed: int, start: float = 0.0
) -> PriceTrace:
    """A price path of ``slots`` i.i.d. prices, each holding ``slot_seconds`` (seeded, reproducible)."""
    if slots < 1:
        raise PriceError(f"slots must be >= 1, got {slots}")
    if not slot_seconds > 0:
        raise PriceError(f"slot_seconds must be > 0, got {slot_seconds}")
    prices = dist.sample(np.random.default_rng(seed), slots)
    times = tuple(start + i * slot_seconds for i in range(slots))
    return PriceTrace(times, tuple(float(p) for p in prices), start + slots * slot_seconds)


def empirical_prices(trace: PriceTrace) -> EmpiricalPrices:
    """The time-weighted distribution of a trace's prices (for planning from history)."""
    weights: dict[float, float] = {}
    for i, p in enumerate(trace.prices):
        weights[p] = weights.get(p, 0.0) + trace.segment_end(i) - trace.times[i]
    keys = sorted(weights)
    return EmpiricalPrices(prices=tuple(keys), weights=tuple(weights[k] for k in keys))


# --------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class RunAccount:
    """What a run on volatile workers cost and where its time went (seconds; money per the trace's unit)."""

    cost: float
    worker_costs: tuple[float, ...]
    wall_seconds: float
    active_seconds: float  # at least one provisioned worker active
    idle_seconds: float  # no provisioned worker active: the run waits
    billed_worker_seconds: float
    useful_worker_seconds: float  # work that went into completed units
    wasted_worker_seconds: float  # work lost to preemption
    units: int
    failed_attempts: int  # unit attempts lost because every worker was preempted
    workers_per_unit: tuple[int, ...]  # active workers that completed each unit (y_j)

    def metrics(self, prefix: str = "spot_") -> dict[str, float]:
        """Flat metrics (hours for times) for tracking."""
        h = SECONDS_PER_HOUR
        mean_workers = (
            sum(self.workers_per_unit) / len(self.workers_per_unit) if self.workers_per_unit else 0.0
        )
        values = {
            "cost": self.cost,
            "wall_hours": self.wall_seconds / h,
            "active_hours": self.active_seconds / h,
            "idle_hours": self.idle_seconds / h,
            "billed_worker_hours": self.billed_worker_seconds / h,
            "useful_worker_hours": self.useful_worker_seconds / h,
            "wasted_worker_hours": self.wasted_worker_seconds / h,
            "waiting_worker_hours": max(
                0.0, self.billed_worker_seconds - self.useful_worker_seconds - self.wasted_worker_seconds
            )
            / h,
            "units": float(self.units),
            "failed_attempts": float(self.failed_attempts),
            "mean_active_workers": mean_workers,
        }
        return {prefix + k: float(v) for k, v in values.items()}


@dataclass(frozen=True)
class _Bill:
    worker_costs: tuple[float, ...]
    billed_worker_seconds: float
    idle_seconds: float


def bill_interval(trace: PriceTrace, bids: Sequence[float], start: float, stop: float) -> _Bill:
    """Cost of ``bids``' workers over ``[start, stop)``: each pays the price while it is <= its bid."""
    costs = [0.0] * len(bids)
    billed = idle = 0.0
    t = start
    while t < stop:
        i = trace.index_at(t)
        seg_stop = min(trace.segment_end(i), stop)
        length, price = seg_stop - t, trace.prices[i]
        active = 0
        for w, b in enumerate(bids):
            if price <= b:
                costs[w] += price * length / SECONDS_PER_HOUR
                active += 1
        billed += active * length
        if active == 0:
            idle += length
        t = seg_stop
    return _Bill(tuple(costs), billed, idle)


def _first_active(trace: PriceTrace, top_bid: float, t: float) -> float:
    """The first time >= t at which the price is <= the highest bid."""
    i = trace.index_at(t)
    while trace.prices[i] > top_bid:
        i += 1
        if i >= len(trace.prices):
            raise TraceExhaustedError(
                f"the price stays above every bid (highest {top_bid}) until the trace ends at {trace.end}"
            )
    return max(t, trace.times[i])


@dataclass(frozen=True)
class _Attempt:
    finished: bool
    stop: float
    survivors: int
    wasted: float


def _attempt(trace: PriceTrace, bids: Sequence[float], t: float, seconds: float) -> _Attempt:
    """One try at a unit of ``seconds`` started at t by the workers active then.

    A worker preempted mid-unit loses its partial work; the unit completes with the survivors
    (synchronous SGD with y_j active workers), or fails when every worker is preempted.
    """
    price = trace.prices[trace.index_at(t)]
    alive = [b for b in bids if price <= b]
    finish = t + seconds
    wasted = 0.0
    i = trace.index_at(t)
    while trace.segment_end(i) < finish:
        change = trace.segment_end(i)
        if change >= trace.end:
            raise TraceExhaustedError(
                f"the price trace ends at {trace.end} before a unit started at {t} finishes"
            )
        i += 1
        dropped = [b for b in alive if trace.prices[i] > b]
        wasted += len(dropped) * (change - t)
        alive = [b for b in alive if trace.prices[i] <= b]
        if not alive:
            return _Attempt(False, change, 0, wasted)
    if finish > trace.end:
        raise TraceExhaustedError(
            f"the price trace ends at {trace.end} before a unit started at {t} finishes"
        )
    return _Attempt(True, finish, len(alive), wasted)


def account_run(
    trace: PriceTrace,
    bids: Sequence[float],
    work_seconds: Sequence[float],
    provisioned: Sequence[int] | None = None,
    start: float | None = None,
) -> RunAccount:
    """Replay a record of work on volatile workers against a price trace and account it.

    ``work_seconds[j]`` is how long unit j (an iteration, sub-epoch or trial) takes once started;
    ``bids[w]`` is worker w's bid; ``provisioned[j]`` (default: all) is how many workers (the first
    ones) are provisioned for unit j, as a worker schedule n_j gives. A unit starts when at least one
    provisioned worker is active (waiting is idle time), runs with the workers active at its start,
    and loses the partial work of any worker preempted before it ends; it is retried if all are.
    Workers are billed whenever they are provisioned and the price is <= their bid.
    """
    if not bids:
        raise PriceError("bids: need at least one worker's bid")
    for w, b in enumerate(bids):
        if not b >= 0 or math.isnan(b):
            raise PriceError(f"bids[{w}]={b}: a bid must be a number >= 0")
    for j, d in enumerate(work_seconds):
        if not d > 0 or not math.isfinite(d):
            raise PriceError(f"work_seconds[{j}]={d}: a unit's duration must be finite and > 0")
    counts = list(provisioned) if provisioned is not None else [len(bids)] * len(work_seconds)
    if len(counts) != len(work_seconds):
        raise PriceError(f"provisioned has {len(counts)} entries for {len(work_seconds)} units")
    for j, n in enumerate(counts):
        if not 1 <= n <= len(bids):
            raise PriceError(f"provisioned[{j}]={n}: expected 1..{len(bids)} (the number of bids)")
    t0 = trace.start if start is None else float(start)
    t = t0
    costs = [0.0] * len(bids)
    billed = idle = useful = wasted = 0.0
    failed = 0
    used: list[int] = []
    for seconds, n in zip(work_seconds, counts, strict=True):
        unit_bids = list(bids[:n])
        unit_start = t
        while True:
            t = _first_active(trace, max(unit_bids), t)
            attempt = _attempt(trace, unit_bids, t, seconds)
            wasted += attempt.wasted
            t = attempt.stop
            if attempt.finished:
                useful += attempt.survivors * seconds
                used.append(attempt.survivors)
                break
            failed += 1
        bill = bill_interval(trace, unit_bids, unit_start, t)
        for w, c in enumerate(bill.worker_costs):
            costs[w] += c
        billed += bill.billed_worker_seconds
        idle += bill.idle_seconds
    wall = t - t0
    return RunAccount(
        cost=sum(costs),
        worker_costs=tuple(costs),
        wall_seconds=wall,
        active_seconds=wall - idle,
        idle_seconds=idle,
        billed_worker_seconds=billed,
        useful_worker_seconds=useful,
        wasted_worker_seconds=wasted,
        units=len(used),
        failed_attempts=failed,
        workers_per_unit=tuple(used),
    )


def unit_durations(records: Sequence[Mapping[str, object]]) -> dict[str, list[float]]:
    """Per worker, the durations of its units in start order, from executor unit records.

    A record has ``worker``, ``start`` and ``end`` (seconds), as the MOP/task executors log them
    (``mop/units-epoch-*.json`` in MLflow).
    """
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for i, r in enumerate(records):
        try:
            worker, start, end = str(r["worker"]), float(r["start"]), float(r["end"])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise PriceError(f"records[{i}]={dict(r)!r}: expected worker, start and end (seconds)") from exc
        if not end > start:
            raise PriceError(f"records[{i}]: end {end} must come after start {start}")
        by_worker.setdefault(worker, []).append((start, end - start))
    return {w: [d for _, d in sorted(units)] for w, units in sorted(by_worker.items())}


def _idle_while_running(trace: PriceTrace, workers: Sequence[tuple[float, float]], t0: float) -> float:
    """Time in [t0, last end) when no worker still running (bid, end) is active."""
    stops = sorted({end for _, end in workers})
    idle, t = 0.0, t0
    while stops and t < stops[-1]:
        i = trace.index_at(t)
        piece_end = min([trace.segment_end(i)] + [e for e in stops if e > t])
        price = trace.prices[i]
        if not any(price <= bid and t < end for bid, end in workers):
            idle += piece_end - t
        t = piece_end
    return idle


def account_parallel_units(
    trace: PriceTrace,
    bids: Mapping[str, float],
    work: Mapping[str, Sequence[float]],
    start: float | None = None,
) -> RunAccount:
    """Account task-parallel work (MOP units, trials): each worker runs its own units on its own bid.

    ``work[w]`` is worker w's unit durations (see :func:`unit_durations`); a preempted worker loses
    its current unit's progress and redoes the unit when the price is back under its bid. The run ends
    when the last worker is done; idle time is time when no worker still running is active.
    """
    missing = sorted(set(work) - set(bids))
    if missing:
        raise PriceError(f"no bid for worker(s) {missing}; bids are given for {sorted(bids)}")
    if not work:
        raise PriceError("work: need at least one worker's units")
    t0 = trace.start if start is None else float(start)
    names = sorted(work)
    accounts = [account_run(trace, [bids[w]], work[w], start=t0) for w in names]
    wall = max(a.wall_seconds for a in accounts)
    idle = _idle_while_running(
        trace, [(bids[w], t0 + a.wall_seconds) for w, a in zip(names, accounts, strict=True)], t0
    )
    return RunAccount(
        cost=sum(a.cost for a in accounts),
        worker_costs=tuple(a.cost for a in accounts),
        wall_seconds=wall,
        active_seconds=wall - idle,
        idle_seconds=idle,
        billed_worker_seconds=sum(a.billed_worker_seconds for a in accounts),
        useful_worker_seconds=sum(a.useful_worker_seconds for a in accounts),
        wasted_worker_seconds=sum(a.wasted_worker_seconds for a in accounts),
        units=sum(a.units for a in accounts),
        failed_attempts=sum(a.failed_attempts for a in accounts),
        workers_per_unit=tuple(y for a in accounts for y in a.workers_per_unit),
    )


def on_demand_account(price: float, workers: int, work_seconds: Sequence[float]) -> RunAccount:
    """The same work on ``workers`` on-demand workers at a fixed ``price``: never preempted, never idle."""
    if not price >= 0 or not math.isfinite(price):
        raise PriceError(f"on-demand price must be finite and >= 0, got {price}")
    if workers < 1:
        raise PriceError(f"workers must be >= 1, got {workers}")
    total = float(sum(work_seconds))
    trace = PriceTrace((0.0,), (price,), total + 1.0)
    return account_run(trace, [price] * workers, work_seconds)


def log_run_account(
    tracker: Tracker,
    run_id: str,
    account: RunAccount,
    bids: Sequence[float] | None = None,
    prefix: str = "spot_",
    extra_params: Mapping[str, object] | None = None,
) -> dict[str, float]:
    """Log a run's cost account to the tracker (MLflow in production); returns the metrics logged."""
    metrics = account.metrics(prefix)
    params: dict[str, object] = dict(extra_params or {})
    if bids is not None:
        params[prefix + "bids"] = ",".join(f"{b:g}" for b in bids)
        params[prefix + "workers"] = len(bids)
    if params:
        tracker.log_params(run_id, params)
    tracker.log_metrics(run_id, metrics)
    if account.workers_per_unit:
        tracker.log_metric_history(
            run_id, prefix + "active_workers", list(enumerate(float(y) for y in account.workers_per_unit))
        )
    return metrics
