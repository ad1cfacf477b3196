"""Data sharding on Dask: generate or read a dataset, split it, write parquet shards + manifest.

Output is content-addressed: the folder name is a hash of the source and the shard config,
so a rerun with the same input reuses the shards (the manifest is written last, so its
presence means the shards are complete).
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from infra import storage
from training.config import DataConfig

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
# Part of every content address: bump it when the bytes written for the same input change
# (2: features plain-encoded; partitions grouped by split, which reorders stratified shards).
SHARD_FORMAT_VERSION = 2
LABEL_COLUMN = "label"
SPLITS = ("train", "validation", "test")
# Parquet writer options of every shard: dictionary encoding for the label only. On continuous
# float features pyarrow first builds a dictionary, finds it too large and falls back to plain
# pages: writing took ten times as long and the files came out half again as large.
# row groups of 32,768 rows: the blocks a partition over the memory budget streams (training.streaming)
PARQUET_WRITE_OPTIONS: dict[str, Any] = {"use_dictionary": [LABEL_COLUMN], "row_group_size": 32_768}


class ShardIntegrityError(RuntimeError):
    """A shard is missing, corrupt or has the wrong schema. Never retried: rerunning cannot fix it."""


@dataclass(frozen=True)
class ShardResult:
    """Where the sharded dataset is, and whether an existing one was reused."""

    manifest_uri: str
    manifest_hash: str
    reused: bool


# ---------------------------------------------------------------------------------------------
# Pure helpers

SPLIT_COLUMN = "_split"
HASH_COLUMN = "_u"  # the row's hash in [0, 1): kept until the shards are written (stratified splits)
DROPPED = "_dropped"  # rows with NaN/inf features under nan_policy="drop"
INVALID = "_invalid"  # the same rows under nan_policy="fail" (reported, never written)
PARTITION_SEED_STRIDE = 1_000_003


class DataValidationError(ValueError):
    """The source cannot be sharded as configured; the message names the column, value or count."""


def row_unit_interval(frame: pd.DataFrame, salt: str) -> np.ndarray:
    """A number in [0, 1) per row from a hash of its content: a row keeps its split when rows are appended."""
    key = hashlib.sha256(salt.encode()).hexdigest()[:16]
    hashed = pd.util.hash_pandas_object(frame, index=False, hash_key=key).to_numpy(dtype=np.uint64)
    return hashed.astype(np.float64) / 2.0**64


def feature_columns(n_features: int) -> list[str]:
    """Column names of the generated datasets' features."""
    return [f"x{i:03d}" for i in range(n_features)]


def shard_key(source: Mapping[str, Any], cfg: DataConfig) -> str:
    """Content address of a sharded dataset: the source fingerprint plus the shard config."""
    fields = {"n_shards", "val_fraction", "test_fraction", "nan_policy"}
    # stratify joins the key only when set, so unstratified datasets keep their addresses
    shard_cfg = cfg.model_dump(include=fields | ({"stratify"} if cfg.stratify else set()))
    address = {
        "source": dict(source),
        "shards": shard_cfg,
        "v": MANIFEST_VERSION,
        "format": SHARD_FORMAT_VERSION,
    }
    return storage.canonical_hash(address)[:16]


def even_chunks(n_rows: int, n_chunks: int) -> list[tuple[int, int]]:
    """Split ``range(n_rows)`` into ``n_chunks`` contiguous ranges whose sizes differ by at most one."""
    if n_chunks > n_rows:
        raise DataValidationError(f"cannot cut {n_rows} rows into {n_chunks} shards: more shards than rows")
    base, extra = divmod(n_rows, n_chunks)
    bounds, start = [], 0
    for i in range(n_chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def plan_shards(partition_rows: Sequence[int], n_shards: int) -> list[list[tuple[int, int, int]]]:
    """For each shard, the (partition, start, stop) slices it takes, cutting the rows of all
    partitions (in order) into ``n_shards`` near-equal contiguous pieces."""
    offsets = np.concatenate([[0], np.cumsum(partition_rows)]).astype(int)
    plan: list[list[tuple[int, int, int]]] = []
    for start, stop in even_chunks(int(offsets[-1]), n_shards):
        slices = []
        for p in range(len(partition_rows)):
            lo, hi = max(start, offsets[p]), min(stop, offsets[p + 1])
            if lo < hi:
                slices.append((p, int(lo - offsets[p]), int(hi - offsets[p])))
        plan.append(slices)
    return plan


def balance_writers(
    shard_rows: Sequence[int], local_rows: Sequence[Mapping[str, int]], workers: Sequence[str]
) -> list[str]:
    """The worker that writes each shard, so that every worker writes about as many rows and as
    few rows as possible travel between workers.

    Longest shard first, each onto the worker that holds most of its rows, unless that worker
    would then write more than an even share of all rows (plus half the shard); then onto the
    worker with the fewest rows to write so far (ties: the worker holding more of the shard's
    rows, then the order of ``workers``). Writing a shard costs about its row count and all
    shards become ready together (after the last partition), so the cap keeps every worker busy
    to the end; placing by locality alone can leave one worker writing alone while the other
    idles, and placing by load alone moves rows that need not move.
    """
    if not workers:
        raise ValueError("balance_writers needs at least one worker")
    if len(local_rows) != len(shard_rows):
        raise ValueError(f"{len(shard_rows)} shards but {len(local_rows)} row placements")
    share = sum(shard_rows) / len(workers)
    load = dict.fromkeys(workers, 0)
    chosen = [""] * len(shard_rows)
    for i in sorted(range(len(shard_rows)), key=lambda i: (-shard_rows[i], i)):
        rows, local = shard_rows[i], local_rows[i]
        home = max(workers, key=lambda w: (local.get(w, 0), -load[w]))
        if local.get(home, 0) > 0 and load[home] + rows <= share + rows / 2:
            worker = home
        else:
            worker = min(workers, key=lambda w: (load[w], -local.get(w, 0)))
        chosen[i] = worker
        load[worker] += rows
    return chosen


def combine_stats(parts: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """Feature mean/std from per-shard sums and sums of squares (one pass over the data)."""
    count = sum(int(p["rows"]) for p in parts)
    total = np.sum([np.asarray(p["sum"]) for p in parts], axis=0)
    total_sq = np.sum([np.asarray(p["sumsq"]) for p in parts], axis=0)
    mean = total / count
    var = np.maximum(total_sq / count - mean**2, 0.0)
    return mean.tolist(), np.sqrt(var).tolist()


def feature_sums(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column sums and sums of squares of a 2-D array, accumulated in float64 (no float64 copy
    of a float32 array is made: numpy casts it in small buffers).

    The array is made column-major first (a copy only if it is not): the last bits of the sums
    depend on the memory layout, and the manifest must not depend on where a shard's rows came from.
    """
    values = np.asfortranarray(values)
    return (
        values.sum(axis=0, dtype=np.float64),
        np.einsum("ij,ij->j", values, values, dtype=np.float64),
    )


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    """Hash of a manifest's content (everything but its timestamps and its own hash)."""
    return storage.canonical_hash(
        {k: v for k, v in manifest.items() if k not in {"created_at", "manifest_hash"}}
    )


@dataclass(frozen=True)
class SplitRule:
    """How the rows of a pool are cut by their hash ``u``: the first ``len(cuts)`` splits take the
    rows with ``u`` below the cumulative fractions in ``cuts``, the rest goes to ``rest``.

    MNIST-1D: the pool is the package's train rows, cut into validation | train (its test rows are
    the published test split). A user table: every finite row, cut into test | validation | train.
    """

    pool: tuple[str, ...]
    names: tuple[str, ...]
    cuts: tuple[float, ...]
    rest: str = "train"


def split_rule(cfg: DataConfig) -> SplitRule:
    """The split rule of a config's source."""
    if cfg.dataset == "mnist1d":
        return SplitRule(("train", "validation"), ("validation",), (cfg.val_fraction,))
    return SplitRule(
        SPLITS, ("test", "validation"), (cfg.test_fraction, cfg.test_fraction + cfg.val_fraction)
    )


def assign_splits(
    u: np.ndarray, labels: np.ndarray, rule: SplitRule, thresholds: Mapping[int, Sequence[float]] | None
) -> np.ndarray:
    """Split names for pool rows from their hashes: global cuts, or per-class thresholds (stratified)."""
    out = np.full(len(u), rule.rest, dtype=object)
    if thresholds is None:
        limits = np.broadcast_to(np.asarray(rule.cuts, dtype=np.float64), (len(u), len(rule.cuts)))
    else:
        limits = np.ones((len(u), len(rule.cuts)), dtype=np.float64)
        for label, cuts in thresholds.items():
            limits[labels == label] = cuts
    # walk the cuts from the last: a row ends with the first cut its hash falls under
    for j in range(len(rule.cuts) - 1, -1, -1):
        out[u < limits[:, j]] = rule.names[j]
    return out


HASH_BINS = 1024


def class_hash_histogram(frame: pd.DataFrame, rule: SplitRule) -> dict[int, np.ndarray]:
    """Per class, how many pool rows have their hash in each of ``HASH_BINS`` equal bins of [0, 1)."""
    pool = frame[frame[SPLIT_COLUMN].isin(rule.pool)]
    bins = np.minimum((pool[HASH_COLUMN].to_numpy() * HASH_BINS).astype(np.int64), HASH_BINS - 1)
    labels = pool[LABEL_COLUMN].to_numpy(dtype=np.int64)
    return {int(c): np.bincount(bins[labels == c], minlength=HASH_BINS) for c in np.unique(labels)}


def class_hash_values(
    frame: pd.DataFrame, rule: SplitRule, wanted: Mapping[int, Sequence[int]]
) -> dict[tuple[int, int], np.ndarray]:
    """The hashes of the pool rows of class ``c`` in bin ``b``, for each wanted (c, b)."""
    pool = frame[frame[SPLIT_COLUMN].isin(rule.pool)]
    u = pool[HASH_COLUMN].to_numpy()
    bins = np.minimum((u * HASH_BINS).astype(np.int64), HASH_BINS - 1)
    labels = pool[LABEL_COLUMN].to_numpy(dtype=np.int64)
    return {
        (int(c), int(b)): np.sort(u[(labels == c) & (bins == b)])
        for c, wanted_bins in wanted.items()
        for b in wanted_bins
    }


def threshold_positions(
    histograms: Mapping[int, np.ndarray], rule: SplitRule
) -> dict[int, list[tuple[int, int]]]:
    """Per class and cut, the bin holding the threshold row and the row's rank inside that bin.

    A cut at cumulative fraction F of a class of n pool rows puts exactly k = round(F * n) of
    them below the threshold: the threshold is the (k+1)-th smallest hash of the class
    (rank -1 means k = n: every row is below, the threshold is 1).
    """
    positions: dict[int, list[tuple[int, int]]] = {}
    for label, counts in histograms.items():
        cum = np.cumsum(counts)
        n = int(cum[-1])
        found = []
        for fraction in rule.cuts:
            k = int(round(fraction * n))
            if k >= n:
                found.append((-1, -1))
                continue
            b = int(np.searchsorted(cum, k, side="right"))  # first bin with cum > k
            found.append((b, k - (int(cum[b - 1]) if b else 0)))
        positions[label] = found
    return positions


def stratified_thresholds(
    positions: Mapping[int, Sequence[tuple[int, int]]], values: Mapping[tuple[int, int], np.ndarray]
) -> dict[int, list[float]]:
    """Per class, the hash threshold of each cut, from the sorted hashes of the wanted bins."""
    return {
        label: [1.0 if b < 0 else float(values[(label, b)][rank]) for b, rank in found]
        for label, found in positions.items()
    }


def check_columns(dtypes: Mapping[str, Any], label: str, features: Sequence[str] | None) -> list[str]:
    """Validate a table's columns before reading any rows; return the feature columns."""
    columns = list(dtypes)
    if label not in dtypes:
        raise DataValidationError(f"label column {label!r} is missing; the source has columns {columns[:20]}")
    if features is None:
        chosen = [c for c in columns if c != label and pd.api.types.is_numeric_dtype(dtypes[c])]
        if not chosen:
            raise DataValidationError(
                f"the source has no numeric feature columns besides the label {label!r}"
            )
        return chosen
    missing = [c for c in features if c not in dtypes]
    if missing:
        raise DataValidationError(
            f"feature column(s) {missing} are missing; the source has columns {columns[:20]}"
        )
    bad = {c: str(dtypes[c]) for c in features if not pd.api.types.is_numeric_dtype(dtypes[c])}
    if bad:
        raise DataValidationError(f"feature column(s) must be numeric: {bad}")
    if label in features:
        raise DataValidationError(f"label column {label!r} is also listed as a feature")
    return list(features)


def mark_nonfinite(frame: pd.DataFrame, features: Sequence[str], policy: str) -> pd.DataFrame:
    """Flag rows with NaN/inf features (``_dropped`` or ``_invalid`` in the split column)."""
    values = frame[list(features)].to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values).all(axis=1)
    if bad.any():
        frame.loc[bad, SPLIT_COLUMN] = DROPPED if policy == "drop" else INVALID
    return frame


def validate_stats(
    stats: Sequence[Mapping[str, Any]], cfg: DataConfig, features: Sequence[str], n_shards: int
) -> dict[str, Any]:
    """Check the gathered per-partition counts; return the totals. Raises naming the problem."""
    split_rows: dict[str, int] = {}
    classes: dict[int, int] = {}
    nonfinite: dict[str, int] = {}
    label_problems: list[str] = []
    for part in stats:
        for split, n in part["split_rows"].items():
            split_rows[split] = split_rows.get(split, 0) + int(n)
        for label, n in part["classes"].items():
            classes[int(label)] = classes.get(int(label), 0) + int(n)
        for col, n in part["nonfinite"].items():
            nonfinite[col] = nonfinite.get(col, 0) + int(n)
        label_problems += part["label_problems"]
    usable = sum(n for s, n in split_rows.items() if s in SPLITS)
    if usable == 0 and not split_rows.get(DROPPED) and not split_rows.get(INVALID):
        raise DataValidationError(f"the source {cfg.dataset!r} is empty: it has no rows")
    if label_problems:
        raise DataValidationError(
            f"label column {cfg.label_column!r} must hold integer class ids >= 0; found {label_problems[:3]}"
        )
    if split_rows.get(INVALID):
        worst = sorted(nonfinite.items(), key=lambda kv: -kv[1])[:5]
        raise DataValidationError(
            f"{split_rows[INVALID]} row(s) have NaN/inf features (by column: {dict(worst)}); "
            "nan_policy='fail' refuses them (set nan_policy='drop' to drop those rows)"
        )
    if usable == 0:
        raise DataValidationError(
            f"all {split_rows.get(DROPPED, 0)} rows of {cfg.dataset!r} have NaN/inf features"
        )
    if cfg.num_classes is not None and classes and max(classes) >= cfg.num_classes:
        outside = sorted(label for label in classes if label >= cfg.num_classes)
        raise DataValidationError(
            f"label(s) {outside[:5]} ({sum(classes[c] for c in outside)} row(s)) lie outside the "
            f"{cfg.num_classes} classes 0..{cfg.num_classes - 1} (num_classes={cfg.num_classes})"
        )
    if len(classes) < 2:
        raise DataValidationError(
            f"label column {cfg.label_column!r} has {len(classes)} class(es) {sorted(classes)}; at least 2 are needed"
        )
    if split_rows.get("train", 0) < n_shards:
        raise DataValidationError(
            f"n_shards={n_shards} is more than the {split_rows.get('train', 0)} training rows: more shards than rows"
        )
    for split in SPLITS:
        if split_rows.get(split, 0) == 0:
            raise DataValidationError(f"the {split} split is empty ({usable} usable rows); use more rows")
    return {"split_rows": split_rows, "classes": classes, "dropped": split_rows.get(DROPPED, 0)}


# ---------------------------------------------------------------------------------------------
# Tasks that run on Dask workers


def generate_mnist1d_partition(num_samples: int, seed: int, val_fraction: float) -> pd.DataFrame:
    """One partition of MNIST-1D: the ``mnist1d`` package's samples (its default arguments and
    ``seed``), generated by ``training.mnist1d_gen`` (identical output, vectorized).

    The package splits its samples 80/20 into train and test; validation rows are then held
    out of train by a hash of each row's content. With 5000 samples and seed 42 this is the
    published 4000/1000 split. The rows come back grouped by split (train, validation, test;
    each split's rows in the package's order), so ``take_rows`` cuts a split as a view.
    """
    from training.mnist1d_gen import make_mnist1d

    data = make_mnist1d(num_samples, seed)  # the package's samples, generated vectorized
    cols = feature_columns(data.x.shape[1])
    x = np.concatenate([data.x, data.x_test]).astype(np.float32, copy=False)
    y = np.concatenate([data.y, data.y_test]).astype(np.int64)
    content = pd.DataFrame(x, columns=cols, copy=False)
    content[LABEL_COLUMN] = y
    # a row's hash depends on its content only: the same as hashing the train rows alone
    u = row_unit_interval(content, salt=f"val-{seed}")
    n_train = len(data.y)
    rule = SplitRule(("train", "validation"), ("validation",), (val_fraction,))
    split = np.full(len(y), "test", dtype=object)
    split[:n_train] = assign_splits(u[:n_train], np.empty(0), rule, None)
    # rows grouped by split (each split's rows in their order): take_rows then cuts views, not copies
    order = np.concatenate([np.flatnonzero(split == name) for name in SPLITS])
    # each feature column contiguous (pandas keeps the columns as rows of one 2-D block): Arrow
    # then takes them without a copy when a shard is encoded
    frame = pd.DataFrame(np.take(x.T, order, axis=1).T, columns=cols, copy=False)
    frame[LABEL_COLUMN] = y[order]
    frame[HASH_COLUMN] = u[order]
    frame[SPLIT_COLUMN] = split[order]
    return frame


def prepare_table_partition(
    frame: pd.DataFrame,
    features: Sequence[str],
    label: str,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    nan_policy: str,
) -> pd.DataFrame:
    """Select and type a user table's columns and assign each row its split by content hash."""
    out = frame[list(features)].astype(np.float32)
    out.columns = list(features)
    out[LABEL_COLUMN] = frame[label].to_numpy()
    u = row_unit_interval(out, salt=f"split-{seed}")
    rule = SplitRule(SPLITS, ("test", "validation"), (test_fraction, test_fraction + val_fraction))
    out[HASH_COLUMN] = u
    out[SPLIT_COLUMN] = assign_splits(u, np.empty(0), rule, None)
    return mark_nonfinite(out.reset_index(drop=True), features, nan_policy)


def restratify_partition(
    frame: pd.DataFrame, rule: SplitRule, thresholds: Mapping[int, Sequence[float]]
) -> pd.DataFrame:
    """Reassign the pool rows' splits with per-class thresholds (rows outside the pool keep theirs)."""
    out = frame.copy()
    in_pool = out[SPLIT_COLUMN].isin(rule.pool).to_numpy()
    out.loc[in_pool, SPLIT_COLUMN] = assign_splits(
        out.loc[in_pool, HASH_COLUMN].to_numpy(),
        out.loc[in_pool, LABEL_COLUMN].to_numpy(dtype=np.int64),
        rule,
        thresholds,
    )
    return out


def partition_stats(frame: pd.DataFrame, features: Sequence[str]) -> dict[str, Any]:
    """Counts the driver needs to validate and plan shards (never the rows themselves)."""
    split_rows = frame[SPLIT_COLUMN].value_counts().to_dict()
    labels = frame.loc[frame[SPLIT_COLUMN].isin(SPLITS), LABEL_COLUMN]
    problems: list[str] = []
    if len(labels):
        if not pd.api.types.is_integer_dtype(labels.dtype):
            numeric = pd.to_numeric(labels, errors="coerce")
            bad = labels[numeric.isna() | (numeric != np.floor(numeric))]
            if len(bad):
                problems.append(f"{bad.iloc[0]!r}")
        if not problems and (pd.to_numeric(labels) < 0).any():
            problems.append(f"{int(pd.to_numeric(labels).min())}")
    classes = {} if problems else pd.to_numeric(labels).astype(np.int64).value_counts().to_dict()
    values = frame[list(features)].to_numpy()
    if values.dtype.kind != "f":  # prepared features are float32; no float64 copy for the check
        values = values.astype(np.float64)
    nonfinite = (~np.isfinite(values)).sum(axis=0)
    return {
        "split_rows": {str(k): int(v) for k, v in split_rows.items()},
        "classes": {int(k): int(v) for k, v in classes.items()},
        "nonfinite": {c: int(n) for c, n in zip(features, nonfinite, strict=True) if n},
        "label_problems": problems,
    }


def take_rows(frame: pd.DataFrame, split: str, start: int, stop: int | None) -> pd.DataFrame:
    """Rows ``start:stop`` of one split of a partition (``stop=None``: to its end), without the
    helper columns.

    Runs where the partition lives, so only the rows a shard needs travel to its writer. A split
    whose rows are contiguous (generated partitions are grouped by split) is cut as a view.
    """
    positions = np.flatnonzero((frame[SPLIT_COLUMN] == split).to_numpy())
    if len(positions) and positions[-1] - positions[0] + 1 == len(positions):
        rows = frame.iloc[positions[0] : positions[-1] + 1]
    else:
        rows = frame.iloc[positions]
    return rows.iloc[start:stop].drop(columns=[SPLIT_COLUMN, HASH_COLUMN])


def parquet_bytes(frame: pd.DataFrame) -> memoryview:
    """``frame.to_parquet(index=False, **PARQUET_WRITE_OPTIONS)``'s bytes, encoded into an Arrow
    buffer: the encoder then never takes the GIL to write into a Python file object, which on a
    Dask worker the event loop holds whenever it moves data for other tasks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pq.write_table(table, sink, compression="snappy", **PARQUET_WRITE_OPTIONS)  # pandas' default codec
    return memoryview(sink.getvalue())


def write_shard(
    url: str,
    storage_options: Mapping[str, Any] | None,
    pieces: Sequence[pd.DataFrame],
    bounds: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Write one parquet shard from its pieces (in order; rows ``start:stop`` of each piece
    when ``bounds`` is given); return its stats."""
    if bounds is not None:
        pieces = [piece.iloc[start:stop] for piece, (start, stop) in zip(pieces, bounds, strict=True)]
    part = pieces[0].reset_index(drop=True) if len(pieces) == 1 else pd.concat(pieces, ignore_index=True)
    part[LABEL_COLUMN] = pd.to_numeric(part[LABEL_COLUMN]).astype(np.int64)
    data = parquet_bytes(part)
    storage.write_bytes_atomic(url, data, storage_options)
    sums, sumsq = feature_sums(part.drop(columns=[LABEL_COLUMN]).to_numpy())
    counts = part[LABEL_COLUMN].value_counts().sort_index()
    return {
        "rows": len(part),
        "bytes": len(data),
        "sha256": storage.sha256_bytes(data),
        "class_counts": {str(int(k)): int(v) for k, v in counts.items()},
        "sum": sums.tolist(),
        "sumsq": sumsq.tolist(),
        "schema": {c: str(t) for c, t in part.dtypes.items()},
    }


# ---------------------------------------------------------------------------------------------
# Sources


def table_fingerprint(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """What identifies a user table's content: its files with sizes and modification stamps."""
    fs, path = storage.filesystem(url, storage_options)
    if not fs.exists(path):
        raise DataValidationError(f"dataset {url!r} does not exist")
    files = (
        [path]
        if fs.isfile(path)
        else sorted(f for f in fs.find(path) if f.endswith((".parquet", ".pq", ".csv")))
    )
    if not files:
        raise DataValidationError(f"dataset folder {url!r} holds no .parquet or .csv files")
    entries = []
    for f in files:
        info = fs.info(f)
        stamp = info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("created")
        entries.append(
            {
                "file": f.rsplit("/", 1)[-1] if len(files) == 1 else f[len(path) :],
                "size": info.get("size"),
                "stamp": str(stamp),
            }
        )
    return {"url": url, "files": entries}


def read_table(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    """A lazy Dask DataFrame over a parquet or CSV file or folder."""
    import dask.dataframe as dd

    so = dict(storage_options or {})
    fs, path = storage.filesystem(url, storage_options)
    is_csv = path.endswith(".csv") or (
        fs.isdir(path)
        and any(f.endswith(".csv") for f in fs.find(path))
        and not any(f.endswith((".parquet", ".pq")) for f in fs.find(path))
    )
    try:
        if is_csv:
            target = url if not fs.isdir(path) else storage.join(url, "*.csv")
            return dd.read_csv(target, storage_options=so, blocksize="64MB", assume_missing=False)
        return dd.read_parquet(url, storage_options=so)
    except (ValueError, OSError) as exc:
        raise DataValidationError(f"cannot read dataset {url!r}: {exc}") from exc


@dataclass(frozen=True)
class SourceInfo:
    """What a source is (its fingerprint) and its columns, known before any row is read."""

    fingerprint: dict[str, Any]
    features: list[str]
    table: Any = None  # the lazy Dask DataFrame of a user table
    modality: str = "table"
    input_shape: tuple[int, ...] = ()  # one example's shape; () = (number of features,)
    kind: str = "table"  # mnist1d, shapes, images, npy or table
    classes: list[str] | None = None  # class names (image folders)
    detail: Any = None  # what the kind's partitions need (an image listing, .npy headers)
    storage_options: Any = None  # the source's (its partitions read it on the workers)


def describe_source(
    cfg: DataConfig, storage_options: Mapping[str, Any] | None, client: Any = None
) -> SourceInfo:
    """Fingerprint and columns of the source; a user table's columns are validated here, from
    metadata (images: their headers, read on the workers of ``client``)."""
    from training import source_kinds

    other = source_kinds.describe(cfg, storage_options, client)
    if other is not None:
        return other
    if cfg.dataset == "mnist1d":
        fingerprint = {
            "dataset": "mnist1d",
            "num_samples": cfg.num_samples,
            "seed": cfg.seed,
            "partition_rows": cfg.partition_rows,
            "val_fraction": cfg.val_fraction,
            "generator": "mnist1d-0.0.2",
        }
        return SourceInfo(fingerprint, feature_columns(40), kind="mnist1d")
    fingerprint = table_fingerprint(cfg.dataset, storage_options)
    ddf = read_table(cfg.dataset, storage_options)
    features = check_columns(dict(ddf.dtypes.items()), cfg.label_column, cfg.feature_columns)
    fingerprint |= {"label": cfg.label_column, "features": features, "seed": cfg.seed}
    return SourceInfo(fingerprint, features, ddf)


def source_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """The source's prepared partitions (the rows stay on the workers): futures, or for
    MNIST-1D functions ``submit(worker)`` that start generating partition ``i`` on ``worker``
    (``_per_partition_as_done`` hands them out as workers free up)."""
    from training import source_kinds

    if info.kind in source_kinds.KINDS:
        return source_kinds.partitions(cfg, info, client)
    if cfg.dataset == "mnist1d":
        n_parts = max(1, -(-cfg.num_samples // cfg.partition_rows))

        def generator(rows: int, seed: int) -> Any:
            def submit(worker: str | None) -> Any:
                return client.submit(
                    generate_mnist1d_partition,
                    rows,
                    seed,
                    cfg.val_fraction,
                    pure=False,
                    workers=None if worker is None else [worker],
                    allow_other_workers=True,  # loose: a lost worker's partition runs elsewhere
                )

            return submit

        return [
            generator(stop - start, cfg.seed + p * PARTITION_SEED_STRIDE)
            for p, (start, stop) in enumerate(even_chunks(cfg.num_samples, n_parts))
        ]
    raw = client.compute(info.table.to_delayed())
    return [
        client.submit(
            prepare_table_partition,
            part,
            info.features,
            cfg.label_column,
            cfg.val_fraction,
            cfg.test_fraction,
            cfg.seed,
            cfg.nan_policy,
            pure=False,
        )
        for part in raw
    ]


# ---------------------------------------------------------------------------------------------
# The stage


def shard_dataset(
    cfg: DataConfig,
    data_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardResult:
    """Shard ``cfg.dataset`` on the Dask cluster and write shards + manifest under ``data_root``.

    The driver only ever holds counts and statistics: rows stay on the workers. A rerun with
    the same input reuses the existing output; a failure removes what was half-written.
    """
    started = time.monotonic()
    if cfg.dataset == "mnist1d":
        log.info("shard: generating mnist1d (%d samples, seed %d) on Dask", cfg.num_samples, cfg.seed)
    else:
        log.info("shard: reading %s on Dask", cfg.dataset)
    info = describe_source(cfg, storage_options, client)
    features, source = info.features, info.fingerprint
    n_classes_hint = 10 if cfg.dataset == "mnist1d" else len(info.classes or ()) or (cfg.num_classes or 0)
    key = shard_key(source, cfg)
    name = info.kind
    out_dir = storage.join(data_root, "datasets", f"{name}-{key}")
    manifest_uri = storage.join(out_dir, MANIFEST_NAME)
    if storage.exists(manifest_uri, storage_options):
        existing = storage.read_json(manifest_uri, storage_options)
        log.info(
            "shard: reusing existing shards at %s (manifest %s)", out_dir, existing["manifest_hash"][:12]
        )
        return ShardResult(manifest_uri, existing["manifest_hash"], reused=True)

    sources = source_partitions(cfg, info, client)
    per_split_shards = {"train": cfg.n_shards, "validation": 1, "test": 1}
    # Each partition's rows of each split are cut out as soon as the partition is computed,
    # while the others are still being generated; the writers then take their rows from these
    # pieces, so nothing but the writes is left once the counts are in. (Not for a stratified
    # split: its rows change split after the counts are in.)
    whole_splits = [] if cfg.stratify else list(per_split_shards)
    # every future stays referenced until the end: cancelling a task whose dependents the
    # client no longer wants trips the scheduler (and on success, releasing them is enough)
    held: list[Any] = [s for s in sources if not callable(s)]
    try:
        partitions, stats_futures, whole_pieces = _per_partition_as_done(
            client, sources, held, features, whole_splits
        )
        stats = client.gather(stats_futures)
        totals = validate_stats(stats, cfg, features, cfg.n_shards)
        if cfg.stratify:
            partitions, stats = _stratify(partitions, split_rule(cfg), features, client, held)
            totals = validate_stats(stats, cfg, features, cfg.n_shards)
    except Exception:
        client.cancel(held)
        raise
    if totals["dropped"]:
        log.warning("shard: dropped %d row(s) with NaN/inf features (nan_policy='drop')", totals["dropped"])
    log.info("shard: %s rows per split in %d partition(s)", totals["split_rows"], len(partitions))
    try:
        holders = _holders(partitions, client)
        shards = [
            (split, f"{split}-{i:05d}.parquet", slices)
            for split, n_chunks in per_split_shards.items()
            for i, slices in enumerate(
                plan_shards([int(s["split_rows"].get(split, 0)) for s in stats], n_chunks)
            )
        ]
        shard_rows = [sum(stop - start for _, start, stop in slices) for _, _, slices in shards]
        local_rows: list[dict[str, int]] = []
        for _, _, slices in shards:
            on: dict[str, int] = {}
            for p, start, stop in slices:
                if holders[p] is not None:
                    on[str(holders[p])] = on.get(str(holders[p]), 0) + stop - start
            local_rows.append(on)
        workers = sorted({h for h in holders if h is not None})
        writers = balance_writers(shard_rows, local_rows, workers) if workers else [None] * len(shards)
        futures: dict[str, list[Any]] = {split: [] for split in per_split_shards}
        names: dict[str, list[str]] = {split: [] for split in per_split_shards}
        for (split, shard_name, slices), n_rows, writer in zip(shards, shard_rows, writers, strict=True):
            names[split].append(shard_name)
            url = storage.join(out_dir, shard_name)
            pieces = [whole_pieces[split][p] for p, _, _ in slices] if split in whole_pieces else None

            futures[split].append(
                _submit_shard(
                    client,
                    partitions,
                    holders,
                    split,
                    slices,
                    url,
                    storage_options,
                    held,
                    writer,
                    n_rows,
                    pieces,
                )
            )
        results = {split: client.gather(fs) for split, fs in futures.items()}
    except Exception:
        client.cancel(held)
        _remove_partial(out_dir, storage_options)
        raise
    del held, partitions, futures  # released: the workers drop the rows
    mean, std = combine_stats(results["train"])
    normalization: dict[str, Any] = {"mean": mean, "std": std}
    if info.modality == "image":  # per channel: every pixel of a channel shares its statistics
        from training.sources import channel_normalization, expand_channels

        channel_mean, channel_std = channel_normalization(mean, std, info.input_shape)
        normalization = {
            "mean": expand_channels(channel_mean, info.input_shape),
            "std": expand_channels(channel_std, info.input_shape),
            "channel_mean": channel_mean,
            "channel_std": channel_std,
        }
    num_classes = max(n_classes_hint, max(totals["classes"]) + 1)
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "dataset": cfg.dataset,
        "source": source,
        "config": cfg.model_dump(),
        "feature_columns": list(features),
        "modality": info.modality,
        "input_shape": list(info.input_shape or (len(features),)),
        "label_column": LABEL_COLUMN,
        "num_classes": int(num_classes),
        "schema": results["train"][0]["schema"],
        "dropped_rows": int(totals["dropped"]),
        "normalization": normalization,
        "classes": info.classes,
        "splits": {
            split: [
                {k: v for k, v in r.items() if k not in {"sum", "sumsq", "schema"}} | {"name": n}
                for n, r in zip(names[split], results[split], strict=True)
            ]
            for split in SPLITS
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest["manifest_hash"] = manifest_hash(manifest)
    try:
        storage.write_json_atomic(manifest_uri, manifest, storage_options)
    except Exception:
        _remove_partial(out_dir, storage_options)
        raise
    rows = {s: sum(e["rows"] for e in manifest["splits"][s]) for s in SPLITS}
    log.info(
        "shard: wrote %d train shards (%s rows per split) to %s in %.1fs",
        cfg.n_shards,
        rows,
        out_dir,
        time.monotonic() - started,
    )
    return ShardResult(manifest_uri, manifest["manifest_hash"], reused=False)


def _stratify(
    partitions: list[Any], rule: SplitRule, features: Sequence[str], client: Any, held: list[Any]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Reassign the pool rows' splits with exact per-class thresholds, without gathering rows.

    Two small rounds: per-class histograms of the row hashes locate the bin that holds each
    threshold, then only the hashes in those bins come to the driver (about n / HASH_BINS).
    The old partitions are not cancelled (that would cancel their dependents): they are
    released when the caller drops them.
    """
    histogram_futures = _on_holders(client, class_hash_histogram, partitions, rule)
    held += histogram_futures
    totals: dict[int, np.ndarray] = {}
    for part in client.gather(histogram_futures):
        for label, counts in part.items():
            totals[label] = totals.get(label, 0) + counts
    positions = threshold_positions(totals, rule)
    wanted = {label: sorted({b for b, _ in found if b >= 0}) for label, found in positions.items()}
    value_futures = _on_holders(client, class_hash_values, partitions, rule, wanted)
    held += value_futures
    values: dict[tuple[int, int], np.ndarray] = {}
    for part_values in client.gather(value_futures):
        for key, v in part_values.items():
            values[key] = np.concatenate([values[key], v]) if key in values else v
    thresholds = stratified_thresholds(positions, {k: np.sort(v) for k, v in values.items()})
    log.info("shard: stratified split, per-class hash thresholds %s", thresholds)
    restratified = _on_holders(client, restratify_partition, partitions, rule, thresholds)
    stats_futures = _on_holders(client, partition_stats, restratified, features)
    held += restratified + stats_futures
    return restratified, client.gather(stats_futures)


def _holders(partitions: Sequence[Any], client: Any) -> list[str | None]:
    """The worker holding each partition (waiting until they are computed)."""
    from distributed import wait

    wait(list(partitions))
    who_has = client.who_has(list(partitions))
    return [next(iter(who_has.get(p.key, ())), None) for p in partitions]


def _on_holders(client: Any, fn: Any, partitions: Sequence[Any], *args: Any) -> list[Any]:
    """Submit ``fn(partition, *args)`` per partition on the worker that holds the partition.

    Left to itself the scheduler sends such a task to an idle worker while the holder is still
    generating, copying the whole partition there (worker memory then grows with the data).
    The restriction is loose, so a lost holder does not leave the task unrunnable.
    """
    return [
        client.submit(
            fn,
            p,
            *args,
            pure=False,
            workers=None if holder is None else [holder],
            allow_other_workers=True,
        )
        for p, holder in zip(partitions, _holders(partitions, client), strict=True)
    ]


def feed_cap(unstarted: int, n_threads: int) -> int:
    """How many partition tasks a worker thread may have outstanding (running + queued) when
    ``unstarted`` are not handed out yet: three while plenty remain (the next ones are there
    when the current one ends, even if this loop is slow to hand out more on a busy machine),
    one for the last ``n_threads`` (each goes to a thread that is free, never behind a busy
    worker's task while another idles)."""
    return 3 if unstarted > n_threads else 1


def contiguous_runs(indices: Sequence[int], threads: Mapping[str, int]) -> dict[str, deque[int]]:
    """Cut ``indices`` (in order) into one contiguous run per worker, sized by its threads.

    A shard covers consecutive partitions: when neighbours live on the same worker, its writer
    finds most of its rows there and little data moves between workers.
    """
    total = sum(threads.values())
    if not threads or total <= 0:
        raise ValueError(f"need at least one worker thread, got {dict(threads)}")
    runs: dict[str, deque[int]] = {}
    start, assigned = 0, 0
    for worker, n in threads.items():
        assigned += n
        stop = round(len(indices) * assigned / total)
        runs[worker] = deque(indices[start:stop])
        start = stop
    return runs


def next_partition(runs: Mapping[str, deque[int]], worker: str) -> int | None:
    """The next partition for ``worker``: the front of its own run; once that is done, the back
    of the longest other run (the partitions its owner would reach last), so free workers keep
    busy without breaking the runs up."""
    own = runs.get(worker)
    if own:
        return own.popleft()
    longest = max(runs.values(), key=len, default=deque())
    return longest.pop() if longest else None


def _per_partition_as_done(
    client: Any,
    sources: Sequence[Any],
    held: list[Any],
    features: Sequence[str],
    whole_splits: Sequence[str],
) -> tuple[list[Any], list[Any], dict[str, list[Any]]]:
    """The partitions and, per partition, on the worker that holds it: its stats, and all its
    rows of each split in ``whole_splits`` (the pieces the shard writers take their rows from).

    ``sources`` are futures, or functions ``submit(worker)`` (see ``source_partitions``) that
    are handed out as workers free up (``feed_cap``): each worker works through its own
    contiguous run of partitions (``contiguous_runs``), then takes over the end of another's
    (``next_partition``), so the last partitions go to whichever worker is free first.

    A partition's small tasks are submitted once it is computed, pinned (loosely: a lost
    worker's tasks run elsewhere) to the worker that computed it; they outrank the partition
    tasks (priority 1), so they run between them rather than all at once after the last one.
    """
    from distributed import as_completed

    n = len(sources)
    partitions: list[Any] = [None] * n
    index: dict[Any, int] = {}
    threads = {w: max(1, int(t)) for w, t in sorted(client.nthreads().items())}
    outstanding = dict.fromkeys(threads, 0)
    queue = as_completed()
    unstarted = [i for i, s in enumerate(sources) if callable(s)]
    runs = contiguous_runs(unstarted, threads) if threads else {}
    sent_to: dict[int, str] = {}

    def start(i: int, worker: str | None) -> None:
        source = sources[i]
        future = source(worker) if callable(source) else source
        partitions[i], index[future.key] = future, i
        if callable(source):
            held.append(future)
        queue.add(future)
        if worker is not None:
            outstanding[worker] += 1
            sent_to[i] = worker

    def feed() -> None:
        left = sum(len(run) for run in runs.values())
        while left and outstanding:
            worker = min(outstanding, key=lambda w: outstanding[w] / threads[w])
            if outstanding[worker] >= feed_cap(left, sum(threads.values())) * threads[worker]:
                return
            i = next_partition(runs, worker)
            if i is None:
                return
            start(i, worker)
            left -= 1
        if not runs:  # no workers known: Dask places them
            for i in unstarted:
                start(i, None)
            unstarted.clear()

    for i, source in enumerate(sources):
        if not callable(source):
            start(i, None)
    feed()
    stats: list[Any] = [None] * n
    pieces: dict[str, list[Any]] = {split: [None] * n for split in whole_splits}
    for done in queue:
        i = index[done.key]
        sent = sent_to.pop(i, None)
        if sent in outstanding:
            outstanding[sent] -= 1
        feed()  # the next partition first: its worker is free now
        # where it was computed, which need not be where it was sent (Dask may steal a queued
        # partition for an idle worker): small tasks pinned anywhere else would pull it over
        holder = next(iter(client.who_has([done]).get(done.key, ())), None)
        where = {"workers": None if holder is None else [holder], "allow_other_workers": holder is not None}
        stats[i] = client.submit(partition_stats, done, features, pure=False, priority=1, **where)
        held.append(stats[i])
        for split in whole_splits:
            pieces[split][i] = client.submit(take_rows, done, split, 0, None, pure=False, priority=1, **where)
            held.append(pieces[split][i])
    return partitions, stats, pieces


SLICE_PRIORITY = 1 << 40  # above any shard's row count


def _submit_shard(
    client: Any,
    partitions: Sequence[Any],
    holders: Sequence[str | None],
    split: str,
    slices: Sequence[tuple[int, int, int]],
    url: str,
    storage_options: Mapping[str, Any] | None,
    held: list[Any],
    writer: str | None,
    priority: int,
    split_pieces: Sequence[Any] | None = None,
) -> Any:
    """Submit one shard: slice each partition where it lives, write on ``writer``.

    Only the rows the shard needs move between workers (never whole partitions). A higher
    ``priority`` (the shard's rows) runs first: a worker writes its longest shard first. The
    slicing tasks run before every write (``SLICE_PRIORITY``): a worker busy with a long write
    would otherwise keep the other waiting for the slices it holds. ``split_pieces``: each
    partition's rows of the split, already cut (one per entry of ``slices``); the writer takes
    its rows from them.
    """
    bounds = None if split_pieces is None else [(start, stop) for _, start, stop in slices]
    pieces = (
        list(split_pieces)
        if split_pieces is not None
        else [
            client.submit(
                take_rows,
                partitions[p],
                split,
                start,
                stop,
                pure=False,
                workers=None if holders[p] is None else [holders[p]],
                allow_other_workers=True,
                priority=SLICE_PRIORITY + priority,
            )
            for p, start, stop in slices
        ]
    )
    held += pieces
    future = client.submit(
        write_shard,
        url,
        storage_options,
        pieces,
        bounds,
        pure=False,
        workers=None if writer is None else [writer],
        allow_other_workers=True,
        priority=priority,
    )
    held.append(future)
    return future


def _remove_partial(out_dir: str, storage_options: Mapping[str, Any] | None) -> None:
    """Delete a half-written output folder (its manifest was never written)."""
    try:
        fs, path = storage.filesystem(out_dir, storage_options)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            log.warning("shard: removed the partial output at %s", out_dir)
    except Exception as exc:  # cleanup must not hide the original error
        log.warning("shard: could not remove the partial output at %s: %s", out_dir, exc)


# ---------------------------------------------------------------------------------------------
# Reading


def load_manifest(manifest_uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read a manifest and check that it is one and that its hash matches its content."""
    try:
        manifest: dict[str, Any] = storage.read_json(manifest_uri, storage_options)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"manifest {manifest_uri} does not exist") from exc
    if manifest.get("version") != MANIFEST_VERSION or "splits" not in manifest:
        raise ShardIntegrityError(f"{manifest_uri} is not a mopflow manifest (version {MANIFEST_VERSION})")
    if manifest_hash(manifest) != manifest.get("manifest_hash"):
        raise ShardIntegrityError(
            f"manifest {manifest_uri} was modified: its hash does not match its content"
        )
    return manifest


def _manifest_dir(manifest_uri: str) -> str:
    return manifest_uri.rsplit("/", 1)[0]


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _fetch_shard(
    url: str, entry: Mapping[str, Any], storage_options: Mapping[str, Any] | None, cache_dir: str | None
) -> bytes:
    """A shard's bytes; remote shards are cached on local disk under their sha256 (re-verified on use)."""
    cached = None
    if cache_dir and not _is_local(url):
        cached = Path(cache_dir) / f"{entry['sha256']}.parquet"
        if cached.exists():
            data = cached.read_bytes()
            if storage.sha256_bytes(data) == entry["sha256"]:
                return data
            cached.unlink()  # a damaged cache entry is fetched again
    try:
        data = storage.read_bytes(url, storage_options)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"shard {entry['name']} is missing ({url})") from exc
    if cached is not None and storage.sha256_bytes(data) == entry["sha256"]:
        storage.write_bytes_atomic(str(cached), data)
    return data


def read_shard(
    manifest_uri: str,
    manifest: Mapping[str, Any],
    entry: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
) -> pd.DataFrame:
    """Read one shard, verifying its checksum and schema; errors name the shard."""
    url = storage.join(_manifest_dir(manifest_uri), str(entry["name"]))
    data = _fetch_shard(url, entry, storage_options, cache_dir)
    digest = storage.sha256_bytes(data)
    if digest != entry["sha256"]:
        raise ShardIntegrityError(
            f"shard {entry['name']} is corrupt: sha256 {digest[:12]}… does not match the manifest's {str(entry['sha256'])[:12]}…"
        )
    frame = pd.read_parquet(io.BytesIO(data))
    schema = {c: str(t) for c, t in frame.dtypes.items()}
    if schema != manifest["schema"]:
        raise ShardIntegrityError(f"shard {entry['name']} has schema {schema}, expected {manifest['schema']}")
    return frame


def load_split(
    manifest_uri: str,
    split: str,
    storage_options: Mapping[str, Any] | None = None,
    shard_names: Sequence[str] | None = None,
    cache_dir: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32) and labels (int64) of a split, read from its verified shards.

    ``shard_names`` restricts reading to the shards a worker holds; memory is bounded by those.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    manifest = load_manifest(manifest_uri, storage_options)
    entries = [e for e in manifest["splits"][split] if shard_names is None or e["name"] in shard_names]
    frames = [read_shard(manifest_uri, manifest, e, storage_options, cache_dir) for e in entries]
    frame = pd.concat(frames, ignore_index=True)
    # writable and C-ordered (torch takes it without a copy; a read-only view of Arrow's buffers is copied)
    x = np.require(frame[manifest["feature_columns"]].to_numpy(dtype=np.float32), requirements=["C", "W"])
    y = np.require(frame[manifest["label_column"]].to_numpy(dtype=np.int64), requirements=["W"])
    return x, y


def shard_problem(
    manifest_uri: str,
    entry: Mapping[str, Any],
    schema: Mapping[str, str],
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """What is wrong with one shard (missing, corrupt, another schema), or None. The bytes are
    hashed as they stream (1 MiB at a time) and only the parquet footer is decoded, so the memory
    it takes does not grow with the shard."""
    import pyarrow.parquet as pq

    url = storage.join(_manifest_dir(manifest_uri), str(entry["name"]))
    try:
        digest = storage.sha256_url(url, storage_options)
    except FileNotFoundError:
        return f"shard {entry['name']} is missing ({url})"
    if digest != entry["sha256"]:
        return (
            f"shard {entry['name']} is corrupt: sha256 {digest[:12]}… does not match the manifest's "
            f"{str(entry['sha256'])[:12]}…"
        )
    fs, path = storage.filesystem(url, storage_options)
    with fs.open(path, "rb") as handle:
        found = {c: str(t) for c, t in pq.read_schema(handle).empty_table().to_pandas().dtypes.items()}
    if found != dict(schema):
        return f"shard {entry['name']} has schema {found}, expected {dict(schema)}"
    return None


def verify_manifest(
    manifest_uri: str, storage_options: Mapping[str, Any] | None = None, client: Any = None
) -> dict[str, Any]:
    """Check every shard of a manifest before any training starts; raise naming the first bad
    shard. With a Dask ``client`` the shards are checked on the workers (one task per shard, the
    answers are short strings), else here; either way each is hashed as it streams."""
    manifest = load_manifest(manifest_uri, storage_options)
    entries = [entry for split in SPLITS for entry in manifest["splits"][split]]
    schema, options = manifest["schema"], dict(storage_options or {})
    if client is None:
        problems = [shard_problem(manifest_uri, e, schema, options) for e in entries]
    else:
        futures = client.map(
            shard_problem,
            [manifest_uri] * len(entries),
            entries,
            [schema] * len(entries),
            [options] * len(entries),
            pure=False,
            key=[f"verify-{e['name'].replace('/', '-')}-{time.monotonic_ns()}" for e in entries],
        )
        problems = client.gather(futures)
    for problem in problems:
        if problem is not None:
            raise ShardIntegrityError(problem)
    return manifest
