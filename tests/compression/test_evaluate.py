"""The evaluation report's accuracy is computed in bounded batches; its latency in bounded time."""

from __future__ import annotations

import time

import numpy as np
import torch

from mopflow.compression.evaluate import LATENCY_MIN_REPEATS, accuracy_of, latency_ms
from mopflow.training.models.metrics import top1_accuracy


def test_accuracy_is_measured_batch_by_batch_and_adds_up() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 5)).astype(np.float32)
    y = rng.integers(0, 5, size=1000)
    seen: list[int] = []

    def forward(batch: torch.Tensor) -> torch.Tensor:
        seen.append(len(batch))
        return batch  # the feature with the highest value is the "class"

    assert accuracy_of(forward, x, y, batch_rows=128) == top1_accuracy(x, y)
    assert max(seen) == 128 and sum(seen) == 1000  # never the whole split in one forward
    assert accuracy_of(forward, x[:0], y[:0]) == 0.0


def test_latency_times_slow_passes_within_its_budget_and_fast_ones_to_the_count() -> None:
    calls: list[int] = []

    def slow(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        time.sleep(0.05)
        return x

    assert latency_ms(slow, 4, 8, repeats=30, budget_s=0.1) >= 50.0
    assert len(calls) == 3 + LATENCY_MIN_REPEATS  # warm-ups, then the fewest timed passes
    assert set(calls) == {8}
    calls.clear()
    latency_ms(slow, 4, 1, repeats=4, budget_s=None)
    assert len(calls) == 3 + 4  # no budget: exactly the repeats asked for
    calls.clear()
    latency_ms(lambda x: calls.append(1) or x, 4, 1, repeats=30)
    assert len(calls) == 3 + 30  # fast passes: every repeat fits the default budget
