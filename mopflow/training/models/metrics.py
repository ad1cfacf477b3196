"""The one definition of top-1 accuracy used by training, ensembling, distillation and the registry gate."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def top1_correct(scores: Any, labels: Any) -> int:
    """How many rows' highest score is the label (``scores`` and ``labels`` as for :func:`top1_accuracy`);
    counts add up over shards where accuracies do not."""
    if isinstance(scores, torch.Tensor):
        predicted = scores.detach().argmax(dim=1).cpu().numpy()
    else:
        predicted = np.asarray(scores).argmax(axis=1)
    truth = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if predicted.shape[0] != truth.shape[0]:
        raise ValueError(f"scores hold {predicted.shape[0]} rows but labels hold {truth.shape[0]}")
    return int((predicted == truth).sum())


def top1_accuracy(scores: Any, labels: Any) -> float:
    """Fraction of rows whose highest score is the label.

    ``scores`` is (rows, classes) of logits or probabilities and ``labels`` holds class indices; either may be a
    NumPy array, a pandas frame/series or a torch tensor. An empty batch has accuracy 0.0, not NaN.
    """
    correct = top1_correct(scores, labels)  # checks that the row counts agree
    rows = len(labels)
    return correct / rows if rows else 0.0
