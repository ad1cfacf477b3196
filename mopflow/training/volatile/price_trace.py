"""Spot price traces: piecewise-constant prices over time, read, sampled, repeated and summarised.

A trace comes from a recorded CSV (``timestamp,price``; :func:`parse_price_csv`, from a local file
with :func:`load_price_trace` or any fsspec URL with :func:`read_price_trace`) or is sampled from a
price distribution (:func:`sample_price_trace`). :func:`empirical_prices` turns a trace back into a
distribution for planning; :func:`repeat_trace` and :func:`price_at` let a replay run past its end.

Everything here is pure except the two readers.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from mopflow.training.volatile.prices import (
    EmpiricalPrices,
    PriceDistribution,
    PriceError,
    TraceExhaustedError,
)

MAX_REPEATS = 100_000  # segments of an unrolled trace, so a tiny trace at a huge speed fails clearly


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


def read_price_trace(location: str, storage_options: Mapping[str, Any] | None = None) -> PriceTrace:
    """A ``timestamp,price`` CSV from a local path or an fsspec URL (``s3://...``)."""
    from mopflow.base import storage

    try:
        data = storage.read_bytes(location, storage_options)
    except (OSError, ValueError) as exc:
        raise PriceError(f"cannot read price trace {location}: {exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PriceError(f"price trace {location} is not UTF-8 text: {exc}") from exc
    return parse_price_csv(text, source=location)


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


def repeat_trace(trace: PriceTrace, until: float) -> PriceTrace:
    """The trace, repeated end to end from its start, covering at least ``[start, until)``."""
    if until <= trace.end:
        return trace
    length = trace.end - trace.start
    repeats = math.ceil((until - trace.start) / length)
    if repeats * len(trace.times) > MAX_REPEATS:
        raise PriceError(
            f"replaying {until - trace.start:.0f} trace seconds repeats a {length:.0f}-second trace "
            f"{repeats} times; use a longer trace or a lower speed"
        )
    times = tuple(t + k * length for k in range(repeats) for t in trace.times)
    return PriceTrace(times, trace.prices * repeats, trace.start + repeats * length)


def price_at(trace: PriceTrace, t: float) -> tuple[float, float]:
    """The price at trace time ``t`` (repeating past the end) and the trace seconds until it changes."""
    length = trace.end - trace.start
    offset = (t - trace.start) % length if t >= trace.start else 0.0
    i = trace.index_at(trace.start + offset)
    return trace.prices[i], trace.segment_end(i) - (trace.start + offset)
