"""The sharding stage: a dataset, generated or read, split and written as parquet shards on Dask
with a manifest; content-addressed, so a rerun with the same input reuses the shards.

Where its tasks run (partitions handed out as workers free up, shards sliced where their rows
live) is :mod:`mopflow.training.data.placement`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mopflow.base import storage
from mopflow.training.data.config import DataConfig
from mopflow.training.data.examples import group_normalization
from mopflow.training.data.manifest import LABEL_COLUMN, MANIFEST_NAME, MANIFEST_VERSION, SPLITS, ShardResult
from mopflow.training.data.partitions import partition_stats, restratify_partition
from mopflow.training.data.placement import on_holders, partition_holders, per_partition_as_done, submit_shard
from mopflow.training.data.rules import (
    SplitRule,
    balance_writers,
    class_hash_histogram,
    class_hash_values,
    combine_stats,
    manifest_hash,
    plan_shards,
    shard_key,
    split_rule,
    split_shard_counts,
    stratified_thresholds,
    threshold_positions,
    training_shards,
    validate_stats,
)
from mopflow.training.data.sources.arrays import channel_normalization, expand_channels
from mopflow.training.data.sources.kinds import (
    KINDS_BY_NAME,
    describe_source,
    known_data_spec,
    source_kind,
    source_partitions,
)
from mopflow.training.data.tables import SourceInfo

log = logging.getLogger(__name__)

# A shard's slices: (partition, start, stop) of the partition's rows of the shard's split.
Slices = list[tuple[int, int, int]]


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
    kind = source_kind(cfg, storage_options)
    if kind.generated:
        log.info("shard: generating %s (%d samples, seed %d) on Dask", kind.name, cfg.num_samples, cfg.seed)
    else:
        log.info("shard: reading %s (%s) on Dask", cfg.dataset, kind.name)
    info = describe_source(cfg, storage_options, client)
    out_dir = storage.join(data_root, "datasets", f"{info.kind}-{shard_key(info.fingerprint, cfg)}")
    manifest_uri = storage.join(out_dir, MANIFEST_NAME)
    if storage.exists(manifest_uri, storage_options):
        existing = storage.read_json(manifest_uri, storage_options)
        log.info(
            "shard: reusing existing shards at %s (manifest %s)", out_dir, existing["manifest_hash"][:12]
        )
        return ShardResult(manifest_uri, existing["manifest_hash"], reused=True)

    sources = source_partitions(cfg, info, client)
    # every future stays referenced until the end: cancelling a task whose dependents the
    # client no longer wants trips the scheduler (and on success, releasing them is enough)
    held: list[Any] = [s for s in sources if not callable(s)]
    try:
        partitions, stats, whole_pieces, totals = _counted_partitions(cfg, client, sources, held, info)
    except Exception:
        client.cancel(held)
        raise
    if totals["dropped"]:
        log.warning("shard: dropped %d row(s) with NaN/inf features (nan_policy='drop')", totals["dropped"])
    log.info("shard: %s rows per split in %d partition(s)", totals["split_rows"], len(partitions))
    try:
        shards = _plan(stats, split_shard_counts(totals["split_rows"], _training_shards(cfg, totals, info)))
        results = _write_shards(
            client, partitions, shards, whole_pieces, out_dir, storage_options, held, info.example
        )
    except Exception:
        client.cancel(held)
        _remove_partial(out_dir, storage_options)
        raise
    del held, partitions, whole_pieces  # released: the workers drop the rows
    manifest = _manifest(cfg, info, totals, shards, results)
    try:
        storage.write_json_atomic(manifest_uri, manifest, storage_options)
    except Exception:
        _remove_partial(out_dir, storage_options)
        raise
    rows = {s: sum(e["rows"] for e in manifest["splits"][s]) for s in SPLITS}
    elapsed = time.monotonic() - started
    log.info(
        "shard: wrote %s shards (%s rows per split) to %s in %.1fs",
        {s: len(manifest["splits"][s]) for s in SPLITS},
        rows,
        out_dir,
        elapsed,
    )
    return ShardResult(manifest_uri, manifest["manifest_hash"], reused=False)


def _training_shards(cfg: DataConfig, totals: Mapping[str, Any], info: SourceInfo) -> int:
    """``cfg.n_shards``, or more when its shards would exceed ``cfg.max_shard_mb`` (logged)."""
    train_rows = int(totals["split_rows"].get("train", 0))
    row_bytes = int(info.row_bytes or 4 * len(info.features)) + 8
    count = training_shards(train_rows, row_bytes, cfg.n_shards, cfg.max_shard_mb)
    if count > cfg.n_shards:
        log.info(
            "shard: writing %d training shards, not n_shards=%d: a shard holds at most max_shard_mb=%g MB",
            count,
            cfg.n_shards,
            cfg.max_shard_mb,
        )
    return count


def _counted_partitions(
    cfg: DataConfig, client: Any, sources: Sequence[Any], held: list[Any], info: SourceInfo
) -> tuple[list[Any], list[dict[str, Any]], dict[str, list[Any]], dict[str, Any]]:
    """The computed partitions, their gathered stats, their rows of each whole split (see below)
    and the validated totals; a stratified split's partitions are re-split first."""
    # Each partition's rows of each split are cut out as soon as the partition is computed,
    # while the others are still being generated; the writers then take their rows from these
    # pieces, so nothing but the writes is left once the counts are in. (Not for a stratified
    # split: its rows change split after the counts are in.)
    whole_splits = [] if cfg.stratify else list(SPLITS)
    partitions, stats_futures, whole_pieces = per_partition_as_done(
        client, sources, held, info.features, whole_splits
    )
    stats = client.gather(stats_futures)
    totals = validate_stats(stats, cfg, info.features, cfg.n_shards)
    if cfg.stratify:
        partitions, stats = _stratify(
            partitions, split_rule(cfg, KINDS_BY_NAME[info.kind].own_test_split), info.features, client, held
        )
        totals = validate_stats(stats, cfg, info.features, cfg.n_shards)
    return partitions, stats, whole_pieces, totals


def _stratify(
    partitions: list[Any], rule: SplitRule, features: Sequence[str], client: Any, held: list[Any]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Reassign the pool rows' splits with exact per-class thresholds, without gathering rows.

    Two small rounds: per-class histograms of the row hashes locate the bin that holds each
    threshold, then only the hashes in those bins come to the driver (about n / HASH_BINS).
    The old partitions are not cancelled (that would cancel their dependents): they are
    released when the caller drops them.
    """
    histogram_futures = on_holders(client, class_hash_histogram, partitions, rule)
    held += histogram_futures
    totals: dict[int, np.ndarray] = {}
    for part in client.gather(histogram_futures):
        for label, counts in part.items():
            totals[label] = totals.get(label, 0) + counts
    positions = threshold_positions(totals, rule)
    wanted = {label: sorted({b for b, _ in found if b >= 0}) for label, found in positions.items()}
    value_futures = on_holders(client, class_hash_values, partitions, rule, wanted)
    held += value_futures
    values: dict[tuple[int, int], np.ndarray] = {}
    for part_values in client.gather(value_futures):
        for key, v in part_values.items():
            values[key] = np.concatenate([values[key], v]) if key in values else v
    thresholds = stratified_thresholds(positions, {k: np.sort(v) for k, v in values.items()})
    log.info("shard: stratified split, per-class hash thresholds %s", thresholds)
    restratified = on_holders(client, restratify_partition, partitions, rule, thresholds)
    stats_futures = on_holders(client, partition_stats, restratified, features)
    held += restratified + stats_futures
    return restratified, client.gather(stats_futures)


def _plan(
    stats: Sequence[Mapping[str, Any]], per_split_shards: Mapping[str, int]
) -> list[tuple[str, str, Slices]]:
    """Every shard to write, in order: its split, its file name and its slices of the partitions."""
    return [
        (split, f"{split}-{i:05d}.parquet", slices)
        for split, n_chunks in per_split_shards.items()
        for i, slices in enumerate(plan_shards([int(s["split_rows"].get(split, 0)) for s in stats], n_chunks))
    ]


def _local_rows(slices: Slices, holders: Sequence[str | None]) -> dict[str, int]:
    """A shard's rows by the worker holding them (rows on no known worker are left out)."""
    on: dict[str, int] = {}
    for p, start, stop in slices:
        if holders[p] is not None:
            on[str(holders[p])] = on.get(str(holders[p]), 0) + stop - start
    return on


def _write_shards(
    client: Any,
    partitions: Sequence[Any],
    shards: Sequence[tuple[str, str, Slices]],
    whole_pieces: Mapping[str, Sequence[Any]],
    out_dir: str,
    storage_options: Mapping[str, Any] | None,
    held: list[Any],
    layout: Mapping[str, Any] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Write ``shards`` under ``out_dir``, each on the worker that holds most of its rows (as
    balanced by rows); what each write returned, by split, in the order of ``shards``."""
    holders = partition_holders(partitions, client)
    shard_rows = [sum(stop - start for _, start, stop in slices) for _, _, slices in shards]
    local_rows = [_local_rows(slices, holders) for _, _, slices in shards]
    workers = sorted({h for h in holders if h is not None})
    writers = balance_writers(shard_rows, local_rows, workers) if workers else [None] * len(shards)
    futures: dict[str, list[Any]] = {split: [] for split in SPLITS}
    for (split, shard_name, slices), n_rows, writer in zip(shards, shard_rows, writers, strict=True):
        pieces = [whole_pieces[split][p] for p, _, _ in slices] if split in whole_pieces else None
        url = storage.join(out_dir, shard_name)
        futures[split].append(
            submit_shard(
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
                layout,
            )
        )
    return {split: client.gather(fs) for split, fs in futures.items()}


def _normalization(mean: list[float], std: list[float], info: SourceInfo) -> dict[str, Any]:
    """The manifest's feature normalization: per feature, and for images per channel too (every
    pixel of a channel shares its statistics; a sequence's steps share each feature's)."""
    if info.example is not None:  # the means of the examples' statistics columns
        return group_normalization(mean, info.example)
    if info.modality != "image":
        return {"mean": mean, "std": std}
    channel_mean, channel_std = channel_normalization(mean, std, info.input_shape)
    return {
        "mean": expand_channels(channel_mean, info.input_shape),
        "std": expand_channels(channel_std, info.input_shape),
        "channel_mean": channel_mean,
        "channel_std": channel_std,
    }


def _manifest(
    cfg: DataConfig,
    info: SourceInfo,
    totals: Mapping[str, Any],
    shards: Sequence[tuple[str, str, Slices]],
    results: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """The manifest of the written ``shards`` (``results``: what each write returned, by split),
    with its own hash."""
    names: dict[str, list[str]] = {split: [] for split in SPLITS}
    for split, shard_name, _ in shards:
        names[split].append(shard_name)
    known = known_data_spec(cfg)
    n_classes_hint = known.num_classes if known else len(info.classes or ()) or (cfg.num_classes or 0)
    features = info.features
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "dataset": cfg.dataset,
        "source": info.fingerprint,
        "config": cfg.model_dump(),
        "feature_columns": list(features),
        "modality": info.modality,
        "input_shape": list(info.input_shape or (len(features),)),
        **({"ordered_features": True} if info.ordered_features else {}),
        "label_column": LABEL_COLUMN,
        "num_classes": int(max(n_classes_hint, max(totals["classes"]) + 1)),
        "schema": results["train"][0]["schema"],
        **({"example": info.example} if info.example is not None else {}),
        "dropped_rows": int(totals["dropped"]),
        "normalization": _normalization(*combine_stats(results["train"]), info),
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
    return manifest


def _remove_partial(out_dir: str, storage_options: Mapping[str, Any] | None) -> None:
    """Delete a half-written output folder (its manifest was never written)."""
    try:
        fs, path = storage.filesystem(out_dir, storage_options)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            log.warning("shard: removed the partial output at %s", out_dir)
    except Exception as exc:  # cleanup must not hide the original error
        log.warning("shard: could not remove the partial output at %s: %s", out_dir, exc)
