"""MUNGE (Bucilua, Caruana, Niculescu-Mizil 2006): synthetic points near the data for distillation.

For each example e with nearest neighbour e', every attribute is, with probability ``swap_prob``,
replaced by a draw from N(e'_a, |e_a - e'_a| / spread). The teacher labels the new points.

The neighbours come from k-d trees over the standardised features (projected on their main
components when wide), one per class when the labels are given (the neighbour is then of the same
class) and per random block of at most ``TREE_ROWS`` rows: memory and work stay linear in the
rows, where a full distance matrix is N² of both.
The synthetic rows are produced in chunks of ``chunk_rows`` examples (:func:`munge_chunks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec

import numpy as np
from scipy.spatial import cKDTree

QUERY_CHUNK = 65_536  # rows per tree query: bounds the query's working memory
TREE_DIMS = 12  # k-d trees are fast in few dimensions: wider data is projected on its main components
PCA_SAMPLE = 20_000  # rows the projection is fitted on (bounded memory whatever the data's size)
TREE_ROWS = 16_384  # rows per tree: a larger group is split at random into blocks of at most this

P = ParamSpec("P")


def tree_coordinates(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """Standardised features, projected on their ``TREE_DIMS`` principal components when wider
    (fitted on a sample of at most ``PCA_SAMPLE`` rows): the space the neighbours are found in.
    The projection keeps the directions the data varies along, so the neighbours found there are
    near neighbours in the full space too (approximate, where the narrow case is exact)."""
    mean, std = x.mean(axis=0, dtype=np.float64), x.std(axis=0, dtype=np.float64) + 1e-8
    z = ((x - mean) / std).astype(np.float32)
    if z.shape[1] <= TREE_DIMS:
        return z
    rng = np.random.default_rng(seed)
    sample = z[rng.choice(len(z), size=min(len(z), PCA_SAMPLE), replace=False)]
    _, _, components = np.linalg.svd(sample - sample.mean(axis=0), full_matrices=False)
    return np.asarray(z @ components[:TREE_DIMS].T, dtype=np.float32)


def nearest_neighbours(x: np.ndarray, labels: np.ndarray | None = None) -> np.ndarray:
    """Index of each row's nearest other row (Euclidean on :func:`tree_coordinates`); with
    ``labels``, the nearest other row of the same label (a label with one row is its own)."""
    if len(x) < 2:
        raise ValueError("MUNGE needs at least 2 examples")
    z = tree_coordinates(x)
    groups = (
        [np.arange(len(x))] if labels is None else [np.flatnonzero(labels == v) for v in np.unique(labels)]
    )
    out = np.arange(len(x), dtype=np.int64)
    for members in (block for group in groups for block in _blocks(group)):
        if len(members) < 2:
            continue
        tree = cKDTree(z[members])
        for start in range(0, len(members), QUERY_CHUNK):
            own = np.arange(start, min(start + QUERY_CHUNK, len(members)))
            _, found = tree.query(z[members[own]], k=2)
            # the row itself comes first, unless an identical row does: then that one is the neighbour
            out[members[own]] = members[np.where(found[:, 0] == own, found[:, 1], found[:, 0])]
    return out


def _blocks(members: np.ndarray) -> list[np.ndarray]:
    """``members`` in random blocks of at most ``TREE_ROWS`` (seeded): the work per tree is bounded,
    so the whole search is linear in the rows; each neighbour is the nearest within its block."""
    if len(members) <= TREE_ROWS:
        return [members]
    shuffled = np.random.default_rng(len(members)).permutation(members)
    return [np.sort(block) for block in np.array_split(shuffled, -(-len(members) // TREE_ROWS))]


def munge_chunks(
    x: np.ndarray,
    multiplier: int,
    swap_prob: float = 0.5,
    spread: float = 1.0,
    seed: int = 0,
    labels: np.ndarray | None = None,
    chunk_rows: int = 65_536,
) -> Iterator[np.ndarray]:
    """The synthetic points (float32), ``multiplier`` per example, one chunk of examples at a time
    (at most ``chunk_rows * multiplier`` rows each); deterministic for a seed and chunk size."""
    if multiplier <= 0:
        return
    if not 0.0 < swap_prob <= 1.0 or spread <= 0:
        raise ValueError(f"swap_prob={swap_prob} must be in (0, 1] and spread={spread} > 0")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be at least 1")
    neighbour_of = nearest_neighbours(x, labels)
    rng = np.random.default_rng(seed)
    for start in range(0, len(x), chunk_rows):
        own = x[start : start + chunk_rows].astype(np.float64)
        neighbour = x[neighbour_of[start : start + chunk_rows]].astype(np.float64)
        scale = np.abs(own - neighbour) / spread
        points = []
        for _ in range(multiplier):
            swap = rng.random(own.shape) < swap_prob
            points.append(np.where(swap, rng.normal(neighbour, scale), own))
        yield np.concatenate(points).astype(np.float32)


def _collected(
    chunks: Callable[Concatenate[np.ndarray, P], Iterator[np.ndarray]],
) -> Callable[Concatenate[np.ndarray, P], np.ndarray]:
    """``chunks`` with its chunks concatenated into one array (an empty one of the data's width
    when there are none): the same parameters, one home for them."""

    def collect(x: np.ndarray, /, *args: P.args, **kwargs: P.kwargs) -> np.ndarray:
        parts = list(chunks(x, *args, **kwargs))
        return np.concatenate(parts) if parts else np.empty((0, x.shape[1]), dtype=np.float32)

    return collect


munge = _collected(munge_chunks)
"""``multiplier`` synthetic points per example (float32) in one array, deterministic for a seed:
:func:`munge_chunks` (the same parameters), its chunks concatenated."""
