"""The one definition of top-1 accuracy used by training, ensembling, distillation and the registry gate."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def top1_accuracy(scores: Any, labels: Any) -> float:
    """Fraction of rows whose highest score is the label.

    ``scores`` is (rows, classes) of logits or probabilities and ``labels`` holds class indices; either may be a
    NumPy array, a pandas frame/series or a torch tensor. An empty batch has accuracy 0.0, not NaN.
    """
    if isinstance(scores, torch.Tensor):
        predicted = scores.detach().argmax(dim=1).cpu().numpy()
    else:
        predicted = np.asarray(scores).argmax(axis=1)
    truth = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if predicted.shape[0] != truth.shape[0]:
        raise ValueError(f"scores hold {predicted.shape[0]} rows but labels hold {truth.shape[0]}")
    if not predicted.shape[0]:
        return 0.0
    return float((predicted == truth).mean())
