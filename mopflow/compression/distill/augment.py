"""A transfer set for images and sequences: mixup of randomly shifted training examples.

MUNGE (``mopflow.compression.distill.munge``) perturbs a table's attributes one by one, which means nothing for
pixels or time steps. For images and sequences the synthetic points are instead made the way
those models are augmented: each example is shifted by a few pixels (steps) and mixed with a
random partner (mixup, Zhang et al. 2018); the ensemble then labels them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def random_shift(
    x: np.ndarray, shape: Sequence[int], modality: str, max_shift: int, rng: np.random.Generator
) -> np.ndarray:
    """Flat rows shifted by up to ``max_shift`` pixels in height and width (images) or steps
    (sequences); zeros come in at the edge. Tables are returned as they are."""
    if modality == "table" or max_shift == 0:
        return x
    n = len(x)
    if modality == "image":
        c, h, w = (int(s) for s in shape)
        images = x.reshape(n, c, h, w)
        dy = rng.integers(-max_shift, max_shift + 1, n)
        dx = rng.integers(-max_shift, max_shift + 1, n)
        rows = np.arange(h)[None, :] - dy[:, None]
        cols = np.arange(w)[None, :] - dx[:, None]
        valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
        gathered = images[
            np.arange(n)[:, None, None, None],
            np.arange(c)[None, :, None, None],
            rows.clip(0, h - 1)[:, None, :, None],
            cols.clip(0, w - 1)[:, None, None, :],
        ]
        return (gathered * valid[:, None]).reshape(n, -1).astype(x.dtype, copy=False)
    steps = int(shape[0])
    seqs = x.reshape(n, steps, -1)
    shift = rng.integers(-max_shift, max_shift + 1, n)
    index = np.arange(steps)[None, :] - shift[:, None]
    valid = (index >= 0) & (index < steps)
    gathered = seqs[np.arange(n)[:, None], index.clip(0, steps - 1)]
    return (gathered * valid[:, :, None]).reshape(n, -1).astype(x.dtype, copy=False)


def mixup_points(
    x: np.ndarray,
    shape: Sequence[int],
    modality: str,
    multiplier: int,
    alpha: float,
    max_shift: int,
    seed: int,
) -> np.ndarray:
    """``multiplier`` synthetic points per example: the example and a random partner, each
    shifted, mixed as ``lam * a + (1 - lam) * b`` with ``lam ~ Beta(alpha, alpha)`` folded to
    ``>= 0.5`` (so each point stays closest to its own example)."""
    if multiplier < 0 or alpha <= 0 or max_shift < 0:
        raise ValueError(
            f"multiplier={multiplier} and max_shift={max_shift} must be >= 0 and alpha={alpha} > 0"
        )
    rng = np.random.default_rng(seed)
    n = len(x)
    out = []
    for _ in range(multiplier):
        own = random_shift(x, shape, modality, max_shift, rng)
        partner = random_shift(x[rng.integers(0, n, n)], shape, modality, max_shift, rng)
        lam = rng.beta(alpha, alpha, (n, 1))
        lam = np.maximum(lam, 1.0 - lam).astype(np.float32)
        out.append(lam * own + (1.0 - lam) * partner)
    if not out:
        return np.empty((0, x.shape[1]), dtype=np.float32)
    return np.concatenate(out).astype(np.float32, copy=False)
