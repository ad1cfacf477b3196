"""The sharding stage: a dataset, generated or read, split and written as parquet shards on Dask
with a manifest; content-addressed, so a rerun with the same input reuses the shards."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from infra import storage
from training.config import DataConfig
from training.data.manifest import LABEL_COLUMN, MANIFEST_NAME, MANIFEST_VERSION, SPLITS, ShardResult
from training.data.partitions import partition_stats, restratify_partition, take_rows, write_shard
from training.data.rules import (
    SplitRule,
    balance_writers,
    class_hash_histogram,
    class_hash_values,
    combine_stats,
    manifest_hash,
    plan_shards,
    shard_key,
    split_rule,
    stratified_thresholds,
    threshold_positions,
    validate_stats,
)
from training.data.tables import describe_source, source_partitions

log = logging.getLogger(__name__)


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
