"""Pure rules of sharding: content keys, shard plans, split assignment, feature statistics
and validation of a source's columns and values. No I/O; the sharding stage calls them."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mopflow.base import storage
from mopflow.training.data.config import DEFAULT_MAX_SHARD_MB, DataConfig
from mopflow.training.data.manifest import LABEL_COLUMN, MANIFEST_VERSION, SHARD_FORMAT_VERSION, SPLITS

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
    # stratify and max_shard_mb join the key only when set, so other datasets keep their addresses
    fields |= {"stratify"} if cfg.stratify else set()
    fields |= {"max_shard_mb"} if cfg.max_shard_mb != DEFAULT_MAX_SHARD_MB else set()
    shard_cfg = cfg.model_dump(include=fields)
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


def training_shards(train_rows: int, row_bytes: int, n_shards: int, max_shard_mb: float) -> int:
    """Training shards to write: ``n_shards``, or more when a shard would hold over
    ``max_shard_mb`` of rows (never more shards than rows)."""
    needed = -(-train_rows * row_bytes // max(1, int(max_shard_mb * 2**20)))
    return max(n_shards, min(needed, train_rows))


def split_shard_counts(split_rows: Mapping[str, int], train_shards: int) -> dict[str, int]:
    """Shards per split: the training split in ``train_shards``; validation and test in shards of
    at most a training shard's rows (one at least), so that no shard a stage reads grows with the
    data's size."""
    per_shard = max(1, -(-int(split_rows.get("train", 0)) // max(1, train_shards)))
    evaluation = {s: max(1, -(-int(split_rows.get(s, 0)) // per_shard)) for s in ("validation", "test")}
    return {"train": train_shards, **evaluation}


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


def split_rule(cfg: DataConfig, own_test_split: bool) -> SplitRule:
    """The split rule of a config's source (``own_test_split``: the source brings its test split)."""
    if own_test_split:
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
