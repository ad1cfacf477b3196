"""A separable problem and a plain training loop, for the compression tests that need a model
that has learned something."""

from __future__ import annotations

import numpy as np
import torch


def separable_blobs(n: int, seed: int, width: int = 40, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows (float32) around ``classes`` well-apart centres, and their labels."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 3, size=(classes, width))
    y = rng.integers(0, classes, size=n)
    return (centers[y] + rng.normal(size=(n, width))).astype(np.float32), y


def fit(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, steps: int, lr: float = 0.01) -> None:
    """``steps`` full-batch Adam steps of cross-entropy on (``x``, ``y``)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
