"""Sources of image and sequence data: the generated image dataset and NumPy arrays (image
folders and parquet tensor columns: ``mopflow.training.data.sources.images``).

Each source turns into the partitions the shard stage handles (a label, a content hash and a
split per row): tables as flat feature columns, images and sequences as one example column
(``mopflow.training.data.examples``); the example's shape and the modality go to the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mopflow.base import storage
from mopflow.base.hosts import storage_options_here
from mopflow.training.data.examples import (
    content_hash,
    example_stats,
    examples_frame,
    stat_columns,
    tensor_blobs,
)
from mopflow.training.data.manifest import LABEL_COLUMN, SPLITS
from mopflow.training.data.partitions import prepare_table_partition
from mopflow.training.data.rules import (
    HASH_COLUMN,
    SPLIT_COLUMN,
    SplitRule,
    assign_splits,
    feature_columns,
    mark_nonfinite,
)

NPY_FILES = ("x.npy", "y.npy")
SHAPES_CLASSES = ("disk", "ring", "square", "frame", "triangle", "diamond", "cross", "bar")
SHAPES_SIZE = 16
SHAPES_CHANNELS = 3


class SourceError(ValueError):
    """A source's item is unusable; the message names it (a path, a size, a label)."""


# ---------------------------------------------------------------------------------------------
# The generated image dataset


def shapes_data_spec() -> tuple[tuple[int, int, int], int]:
    """(input shape, number of classes) of the generated ``shapes`` dataset."""
    return (SHAPES_CHANNELS, SHAPES_SIZE, SHAPES_SIZE), len(SHAPES_CLASSES)


def generate_shapes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (flat rows, values in [0, 1]) of coloured shapes on noisy backgrounds, one
    class per kind of shape, placed, sized and coloured at random (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    size, channels = SHAPES_SIZE, SHAPES_CHANNELS
    y = rng.integers(0, len(SHAPES_CLASSES), n)
    cx = rng.uniform(5.0, size - 5.0, (n, 1, 1))
    cy = rng.uniform(5.0, size - 5.0, (n, 1, 1))
    r = rng.uniform(3.0, 5.0, (n, 1, 1))
    rows, cols = np.mgrid[0:size, 0:size].astype(np.float64)
    dx, dy = cols[None] - cx, rows[None] - cy
    dist = np.hypot(dx, dy)
    adx, ady = np.abs(dx), np.abs(dy)
    masks = np.stack(
        [
            dist <= r,
            (dist <= r) & (dist >= r - 1.6),
            np.maximum(adx, ady) <= 0.8 * r,
            (np.maximum(adx, ady) <= 0.8 * r) & (np.maximum(adx, ady) >= 0.8 * r - 1.2),
            (ady <= r) & (adx <= (dy + r) / 2.0),
            adx + ady <= r,
            ((adx <= 1.0) & (ady <= r)) | ((ady <= 1.0) & (adx <= r)),
            (ady <= 1.2) & (adx <= r),
        ],
        axis=1,
    )[np.arange(n), y]
    colour = rng.uniform(0.45, 1.0, (n, channels, 1, 1))
    background = rng.uniform(0.0, 0.35, (n, channels, 1, 1))
    noise = rng.normal(0.0, 0.25, (n, channels, size, size))
    images = np.where(masks[:, None], colour, background) + noise
    return np.clip(images, 0.0, 1.0).reshape(n, -1).astype(np.float32), y.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# NumPy arrays: a folder with x.npy (n, ...) and y.npy (n,)


def is_npy_folder(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url`` is a folder holding ``x.npy`` and ``y.npy``."""
    fs, path = storage.filesystem(url, storage_options)
    return fs.isdir(path) and all(fs.exists(f"{path.rstrip('/')}/{name}") for name in NPY_FILES)


@dataclass(frozen=True)
class NpyHeader:
    """Shape, dtype and data offset of a ``.npy`` file (read from its header only)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int
    fortran: bool


def npy_header(url: str, storage_options: Mapping[str, Any] | None) -> NpyHeader:
    """The header of a ``.npy`` file; a file that is not one is refused naming it."""
    from numpy.lib import format as npformat

    fs, path = storage.filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        try:
            version = npformat.read_magic(f)
            reader = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
            shape, fortran, dtype = reader(f)
        except ValueError as exc:
            raise SourceError(f"{url!r} is not a .npy file: {exc}") from exc
        return NpyHeader(tuple(int(n) for n in shape), np.dtype(dtype), int(f.tell()), bool(fortran))


def check_npy_pair(x: NpyHeader, y: NpyHeader, url: str) -> tuple[tuple[int, ...], str]:
    """(example shape, modality) of an ``x.npy``/``y.npy`` pair: 2-D x is a table, 3-D a
    sequence (steps, features), 4-D images (channels, height, width)."""
    modality = {2: "table", 3: "sequence", 4: "image"}.get(len(x.shape))
    if modality is None:
        raise SourceError(
            f"{url}/x.npy has shape {list(x.shape)}; expected (n, features), (n, steps, features) "
            "or (n, channels, height, width)"
        )
    if x.dtype.kind not in "fiub" or x.fortran or x.dtype.hasobject:
        raise SourceError(
            f"{url}/x.npy holds {x.dtype} (fortran order: {x.fortran}); expected C-order numbers"
        )
    if len(y.shape) != 1 or y.shape[0] != x.shape[0]:
        raise SourceError(
            f"{url}/y.npy has shape {list(y.shape)}; expected ({x.shape[0]},), a label per example"
        )
    if y.dtype.kind not in "iu":
        raise SourceError(f"{url}/y.npy holds {y.dtype}; expected integer class ids")
    return x.shape[1:], modality


def read_npy_rows(
    url: str, header: NpyHeader, start: int, stop: int, storage_options: Mapping[str, Any] | None
) -> np.ndarray:
    """Rows ``start:stop`` of a ``.npy`` file, read by byte range (runs on a worker)."""
    fs, path = storage.filesystem(url, storage_options)
    row = int(np.prod(header.shape[1:], dtype=np.int64)) if len(header.shape) > 1 else 1
    itemsize = header.dtype.itemsize
    with fs.open(path, "rb") as f:
        f.seek(header.offset + start * row * itemsize)
        data = f.read((stop - start) * row * itemsize)
    flat = np.frombuffer(data, dtype=header.dtype)
    return flat.reshape(stop - start, row) if len(header.shape) > 1 else flat


# ---------------------------------------------------------------------------------------------
# Normalisation


def channel_normalization(
    mean: Sequence[float], std: Sequence[float], shape: Sequence[int]
) -> tuple[list[float], list[float]]:
    """Per-channel mean/std of images from the per-feature ones (equal counts per feature),
    returned per channel (each channel's pixels share its statistics)."""
    channels = int(shape[0])
    m = np.asarray(mean, dtype=np.float64).reshape(channels, -1)
    s = np.asarray(std, dtype=np.float64).reshape(channels, -1)
    channel_mean = m.mean(axis=1)
    second = (s**2 + m**2).mean(axis=1)
    channel_std = np.sqrt(np.maximum(second - channel_mean**2, 0.0))
    return channel_mean.tolist(), channel_std.tolist()


def expand_channels(values: Sequence[float], shape: Sequence[int]) -> list[float]:
    """Per-channel values repeated over each channel's pixels (the flat rows' layout)."""
    per_channel = int(np.prod(shape[1:]))
    return np.repeat(np.asarray(values, dtype=np.float64), per_channel).tolist()


def arrays_frame(x: np.ndarray, y: np.ndarray, columns: Sequence[str], label: str) -> pd.DataFrame:
    """Flat rows and labels as a frame (feature columns, then the label)."""
    frame = pd.DataFrame(np.ascontiguousarray(x, dtype=np.float32), columns=list(columns), copy=False)
    frame[label] = np.asarray(y)
    return frame


# ---------------------------------------------------------------------------------------------
# Partitions (run on the Dask workers): the rows the shard stage splits and writes


@dataclass(frozen=True)
class SplitSettings:
    """How a partition's rows get their split (by content hash) and what to do with NaN/inf."""

    val_fraction: float
    test_fraction: float
    seed: int
    nan_policy: str


def prepared_partition(x: np.ndarray, y: np.ndarray, split: SplitSettings) -> pd.DataFrame:
    """Flat rows and labels as a partition: typed, split by content hash, NaN/inf marked."""
    columns = feature_columns(x.shape[1])
    frame = arrays_frame(x, y, columns, LABEL_COLUMN)
    return prepare_table_partition(
        frame, columns, LABEL_COLUMN, split.val_fraction, split.test_fraction, split.seed, split.nan_policy
    )


def prepared_examples(
    blobs: Sequence[bytes], stats: np.ndarray, y: np.ndarray, split: SplitSettings
) -> pd.DataFrame:
    """Examples (encoded images or tensors, as bytes), their statistics and labels as a
    partition: split by a hash of each example's bytes and label, NaN/inf marked."""
    labels = np.asarray(y)
    frame = examples_frame(blobs, stats, labels)
    u = content_hash(blobs, labels, f"split-{split.seed}")
    rule = SplitRule(
        SPLITS, ("test", "validation"), (split.test_fraction, split.test_fraction + split.val_fraction)
    )
    frame[HASH_COLUMN] = u
    frame[SPLIT_COLUMN] = assign_splits(u, np.empty(0), rule, None)
    return mark_nonfinite(frame, stat_columns(stats.shape[1] // 2), split.nan_policy)


def tensor_examples(x: np.ndarray, y: np.ndarray, modality: str, split: SplitSettings) -> pd.DataFrame:
    """Tensors ``(n, *shape)`` (kept in their dtype) and labels as a partition of examples."""
    return prepared_examples(tensor_blobs(x), example_stats(x, modality), y, split)


def shapes_partition(rows: int, seed: int, split: SplitSettings) -> pd.DataFrame:
    """``rows`` generated images (generator seed ``seed``), split by content hash."""
    x, y = generate_shapes(rows, seed)
    shape, _ = shapes_data_spec()
    return tensor_examples(x.reshape(len(x), *shape), y, "image", split)


def npy_partition(
    folder: str,
    headers: tuple[NpyHeader, NpyHeader],
    start: int,
    stop: int,
    split: SplitSettings,
    storage_options: Mapping[str, Any] | None,
) -> pd.DataFrame:
    """Rows ``start:stop`` of an ``x.npy``/``y.npy`` pair, split by content hash."""
    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    x = read_npy_rows(storage.join(folder, "x.npy"), headers[0], start, stop, storage_options)
    y = read_npy_rows(storage.join(folder, "y.npy"), headers[1], start, stop, storage_options).astype(
        np.int64
    )
    if len(headers[0].shape) == 2:  # a table: its columns
        return prepared_partition(x.astype(np.float32), y, split)
    modality = "sequence" if len(headers[0].shape) == 3 else "image"
    return tensor_examples(x.reshape(len(x), *headers[0].shape[1:]), y, modality, split)
