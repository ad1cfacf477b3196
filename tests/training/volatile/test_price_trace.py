"""Price traces: CSV parsing and reading, seeded sampling, the empirical distribution, repetition."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopflow.training.volatile.price_trace import (
    PriceTrace,
    empirical_prices,
    load_price_trace,
    parse_price_csv,
    price_at,
    read_price_trace,
    repeat_trace,
    sample_price_trace,
)
from mopflow.training.volatile.prices import EmpiricalPrices, PriceError, UniformPrices


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


def test_trace_is_read_from_an_fsspec_url(tmp_path: Path) -> None:
    (tmp_path / "p.csv").write_text("timestamp,price\n0,0.3\n60,0.8\n")
    trace = read_price_trace(f"file://{tmp_path / 'p.csv'}")
    assert trace.times == (0.0, 60.0) and trace.prices == (0.3, 0.8)
    with pytest.raises(PriceError, match="cannot read price trace memory://nowhere/p.csv"):
        read_price_trace("memory://nowhere/p.csv")


def test_sampled_paths_are_seeded() -> None:
    d = UniformPrices(low=0.1, high=0.9)
    a = sample_price_trace(d, 50, 60.0, seed=7)
    assert a == sample_price_trace(d, 50, 60.0, seed=7)
    assert a != sample_price_trace(d, 50, 60.0, seed=8)
    assert a.times[1] - a.times[0] == 60.0 and a.end == 3000.0
    assert all(0.1 <= p <= 0.9 for p in a.prices)


def test_empirical_prices_are_time_weighted() -> None:
    trace = PriceTrace((0.0, 10.0, 40.0), (0.3, 0.1, 0.3), end=100.0)
    d = empirical_prices(trace)
    assert d == EmpiricalPrices(prices=(0.1, 0.3), weights=(30.0, 70.0))
    assert d.cdf(0.2) == pytest.approx(0.3)
    assert d.partial_mean(1.0) == pytest.approx(0.1 * 0.3 + 0.3 * 0.7)
    assert d.quantile(0.3) == 0.1 and d.quantile(0.31) == 0.3


def test_repeated_trace_and_prices_past_its_end() -> None:
    trace = PriceTrace((0.0, 10.0), (1.0, 3.0), 30.0)
    assert price_at(trace, 5.0) == (1.0, 5.0)
    assert price_at(trace, 35.0) == (1.0, 5.0)  # the trace repeats from its start
    assert price_at(trace, 52.0) == (3.0, 8.0)
    longer = repeat_trace(trace, 61.0)
    assert longer.times == (0.0, 10.0, 30.0, 40.0, 60.0, 70.0) and longer.end == 90.0
    with pytest.raises(PriceError, match="lower speed"):
        repeat_trace(trace, 1e9)
