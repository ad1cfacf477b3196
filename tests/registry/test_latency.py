"""A student's serving latency: requests timed through the registered pyfunc class."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mopflow.registry.latency import architecture_latency, percentile, time_requests


def test_percentiles_interpolate_like_numpy() -> None:
    import numpy as np

    samples = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    for q in (0, 50, 95, 100):
        assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)


def test_warm_up_requests_are_not_timed() -> None:
    """Five untimed requests, then each timed one by the clock: p50 and p95 of those alone."""
    calls: list[int] = []
    ticks: Iterator[float] = iter([0.0, 0.001, 1.0, 1.003, 2.0, 2.002])  # 1, 3 and 2 ms

    latency = time_requests(calls.append, 7, rows=7, warmup=5, requests=3, clock=lambda: next(ticks))
    assert calls == [7] * 8
    assert latency.p50_ms == pytest.approx(2.0) and latency.p95_ms == pytest.approx(2.9)
    assert latency.to_dict() == {"p50_ms": latency.p50_ms, "p95_ms": latency.p95_ms, "rows": 7, "requests": 3}


def test_an_architecture_is_timed_serving_a_request_of_the_datasets_rows(small_manifest: str) -> None:
    """The request is what a client sends (a table of the feature columns) with as many rows as
    asked; a wider model of the same family takes longer."""
    from mopflow.registry.inputs import serving_request
    from mopflow.training.data import load_manifest
    from mopflow.training.models.builtin import ArchSpec
    from mopflow.training.models.families import DataSpec

    manifest = load_manifest(small_manifest)
    request = serving_request(small_manifest, manifest, {}, 300)  # more rows than the shard has
    assert request.shape == (300, len(manifest["feature_columns"]))
    data = DataSpec.from_manifest(manifest)
    narrow, wide = (
        architecture_latency(
            ArchSpec.of("cnn", {"width": width, "depth": 3}, data),
            manifest["feature_columns"],
            manifest["normalization"],
            request,
            300,
        )
        for width in (4, 128)
    )
    assert 0 < narrow.p50_ms <= narrow.p95_ms and narrow.rows == 300 and narrow.requests == 40
    assert wide.p50_ms > narrow.p50_ms
