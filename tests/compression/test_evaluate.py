"""The evaluation report's accuracy is computed in bounded batches."""

from __future__ import annotations

import numpy as np
import torch

from mopflow.compression.evaluate import accuracy_of
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
