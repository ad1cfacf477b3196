"""Where MOP's data lives: the training shards grouped into one partition per worker, on the
workers that may take MOP's units (those declaring the units' Dask resources, a GPU)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mopflow.training.compute.workers import joined_worker_addresses, workers_with


def partition_shards(shard_names: Sequence[str], n_partitions: int) -> dict[str, list[str]]:
    """Group the training shards into one partition per worker (the data is partitioned once)."""
    n = max(1, min(n_partitions, len(shard_names)))
    groups: dict[str, list[str]] = {f"p{i}": [] for i in range(n)}
    for i, name in enumerate(sorted(shard_names)):
        groups[f"p{i % n}"].append(name)
    return groups


def eligible_workers(client: Any, resources: Mapping[str, float]) -> list[str]:
    """The joined workers that declare ``resources`` (every one when none is needed); fails
    naming the resources when none does."""
    workers = joined_worker_addresses(client)
    if not resources:
        return workers
    eligible = workers_with(client, resources)
    if not eligible:
        raise RuntimeError(
            f"no Dask worker declares the resources {dict(resources)} MOP's units need "
            f"(workers: {', '.join(workers)}); start GPU workers with: dask worker --resources GPU=1"
        )
    return eligible


def cluster_size(client: Any, workers: Sequence[str]) -> int:
    """Workers the cluster is meant to have: a LocalCluster's spec (a worker restarting after a spot
    notice, or not yet up on a loaded machine, still counts), else the workers connected now."""
    spec = getattr(getattr(client, "cluster", None), "worker_spec", None)
    return max(len(spec), len(workers)) if isinstance(spec, dict) and spec else len(workers)


def partition_rows(manifest: Mapping[str, Any], partitions: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Training rows of each partition, from the manifest's shard rows."""
    rows = {e["name"]: int(e["rows"]) for e in manifest["splits"]["train"]}
    return {p: sum(rows[name] for name in names) for p, names in partitions.items()}
