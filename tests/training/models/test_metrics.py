from __future__ import annotations

import numpy as np
import pytest
import torch

from mopflow.training.models.metrics import top1_accuracy


def test_numpy_and_torch_scores_give_the_same_accuracy() -> None:
    scores = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 1, 0])
    assert top1_accuracy(scores, labels) == 0.5
    assert top1_accuracy(torch.tensor(scores), torch.tensor(labels)) == 0.5


def test_an_empty_batch_has_accuracy_zero() -> None:
    assert top1_accuracy(np.zeros((0, 3)), np.zeros(0, dtype=int)) == 0.0


def test_mismatched_rows_are_refused_naming_both_counts() -> None:
    with pytest.raises(ValueError, match="3 rows but labels hold 2"):
        top1_accuracy(np.zeros((3, 2)), np.zeros(2, dtype=int))
