"""Spot price distributions: CDF, partial mean, quantile and sampling."""

from __future__ import annotations

import numpy as np
import pytest

from mopflow.training.volatile.prices import GaussianPrices, PriceError, UniformPrices, conditional_mean


def test_uniform_cdf_partial_mean_and_quantile() -> None:
    d = UniformPrices(low=0.2, high=1.0)
    assert d.cdf(0.1) == 0.0 and d.cdf(0.6) == pytest.approx(0.5) and d.cdf(2.0) == 1.0
    # integral of p/0.8 over [0.2, 0.6] = (0.36 - 0.04) / 1.6
    assert d.partial_mean(0.6) == pytest.approx(0.2)
    assert conditional_mean(d, 0.6) == pytest.approx(0.4)
    assert d.partial_mean(5.0) == pytest.approx(0.6)  # the mean
    assert d.quantile(0.25) == pytest.approx(0.4)


def test_gaussian_is_truncated_at_zero_and_matches_its_samples() -> None:
    d = GaussianPrices(mean=0.1, std=0.2)  # 31% of the untruncated mass is below 0
    assert d.cdf(0.0) == 0.0 and d.cdf(10.0) == pytest.approx(1.0)
    assert d.cdf(d.quantile(0.3)) == pytest.approx(0.3)
    x = d.sample(np.random.default_rng(1), 40_000)
    assert x.min() >= 0.0
    assert x.mean() == pytest.approx(d.partial_mean(100.0), rel=0.02)
    assert (x <= 0.15).mean() == pytest.approx(d.cdf(0.15), abs=0.01)
    assert conditional_mean(d, 0.15) == pytest.approx(x[x <= 0.15].mean(), rel=0.02)


def test_distributions_refuse_bad_parameters() -> None:
    with pytest.raises(ValueError, match="high > low"):
        UniformPrices(low=1.0, high=0.5)
    with pytest.raises(ValueError, match="std"):
        GaussianPrices(mean=1.0, std=0.0)
    with pytest.raises(PriceError, match="never active"):
        conditional_mean(UniformPrices(low=0.5, high=1.0), 0.4)
