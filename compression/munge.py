"""MUNGE (Bucilua, Caruana, Niculescu-Mizil 2006): synthetic points near the data for distillation.

For each example e with nearest neighbour e', every attribute is, with probability ``swap_prob``,
replaced by a draw from N(e'_a, |e_a - e'_a| / spread). The teacher labels the new points.
"""

from __future__ import annotations

import numpy as np
import torch


def nearest_neighbours(x: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """Index of each row's nearest other row (Euclidean on standardised features), in chunks."""
    if len(x) < 2:
        raise ValueError("MUNGE needs at least 2 examples")
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-8
    z = torch.from_numpy(((x - mean) / std).astype(np.float32))
    out = np.empty(len(x), dtype=np.int64)
    for start in range(0, len(z), chunk):
        d = torch.cdist(z[start : start + chunk], z)
        rows = torch.arange(d.shape[0])
        d[rows, rows + start] = float("inf")  # not its own neighbour
        out[start : start + chunk] = d.argmin(dim=1).numpy()
    return out


def munge(
    x: np.ndarray, multiplier: int, swap_prob: float = 0.5, spread: float = 1.0, seed: int = 0
) -> np.ndarray:
    """``multiplier`` synthetic points per example (float32), deterministic for a seed."""
    if multiplier <= 0:
        return np.empty((0, x.shape[1]), dtype=np.float32)
    if not 0.0 < swap_prob <= 1.0 or spread <= 0:
        raise ValueError(f"swap_prob={swap_prob} must be in (0, 1] and spread={spread} > 0")
    rng = np.random.default_rng(seed)
    x64 = x.astype(np.float64)
    neighbour = x64[nearest_neighbours(x)]
    scale = np.abs(x64 - neighbour) / spread
    points = []
    for _ in range(multiplier):
        swap = rng.random(x.shape) < swap_prob
        draws = rng.normal(neighbour, scale)
        points.append(np.where(swap, draws, x64))
    return np.concatenate(points).astype(np.float32)
