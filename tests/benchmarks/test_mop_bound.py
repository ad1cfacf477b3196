"""The MOP bound benchmark: the replayed schedule's utilisation for known unit lengths."""

from __future__ import annotations

import pytest

from tests.benchmarks.loader import load_benchmark

bench = load_benchmark("mop_bound")


@pytest.mark.parametrize("round_epochs", [1, 3])
def test_models_of_one_size_keep_every_worker_busy(round_epochs: int) -> None:
    assert bench.replay({f"m{i}": 0.1 for i in range(4)}, 2, round_epochs) == pytest.approx(1.0)


def test_one_slow_model_among_small_ones_idles_the_workers_it_hops_between() -> None:
    one_slow = {"slow": 0.3, "a": 0.03, "b": 0.04, "c": 0.035}
    bound = bench.replay(one_slow, 2, round_epochs=1)
    # an epoch lasts at least the slow model's two units in a row (0.6 s) for 2 x 0.405
    # worker-seconds of units; the small ones cannot fill that either: each may take the
    # worker the slow model is not on once, then must hop to it
    assert 0.55 < bound < 2 * 0.405 / (2 * 0.6)


def test_more_models_fill_the_waits_of_a_mix_of_sizes() -> None:
    four, eight = (bench.cell("search", models, 1, 2, draws=20, schedule="fixed") for models in (4, 8))
    assert four < eight <= 1.0
