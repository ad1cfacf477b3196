"""The training data a worker process holds between units: partitions, evaluation splits, manifests.

Each worker loads its shards once and keeps them, on the device they train on, across units
(or, over its memory budget, streams them from the shards pass by pass); the evaluation splits
and the manifests the same.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mopflow.base.hosts import shard_cache_here
from mopflow.training.data.ref import DataRef

log = logging.getLogger(__name__)

# Worker-process cache of loaded partitions, on the device they train on: each worker loads its
# shards once and keeps them there across units.
_PARTITIONS: dict[tuple[str, tuple[str, ...], str], tuple[Any, Any]] = {}
# Partitions over the memory budget: read from their shards pass by pass (training.streaming).
_STREAMED: dict[tuple[str, tuple[str, ...]], Any] = {}
# The same for the evaluation splits (validated after every epoch: read and verified once).
_EVAL_SPLITS: dict[tuple[str, str], tuple[Any, Any]] = {}
# The manifests of the data those come from, read and verified once per worker as they are.
_MANIFESTS: dict[str, dict[str, Any]] = {}


def training_rows(data: DataRef, shard_names: Sequence[str], device: str = "cpu") -> Any:
    """The training rows of these shards: ``(x, y)`` tensors held on ``device``
    (:func:`load_partition`) when they fit the worker's memory budget (``MOPFLOW_TRAIN_MEMORY_MB``),
    else a :class:`~mopflow.training.data.streaming.StreamedRows` that reads them from the shards each pass."""
    from mopflow.training.data.examples import batch_decoder, decoded_row_bytes, stored_row_bytes
    from mopflow.training.data.streaming import (
        StreamedRows,
        block_reader,
        cache_shards,
        shard_blocks,
        shuffle_buffer_rows,
        train_memory_bytes,
    )

    names = tuple(sorted(shard_names))
    if (data.manifest_uri, names, device) in _PARTITIONS:
        return _PARTITIONS[(data.manifest_uri, names, device)]
    if (data.manifest_uri, names) not in _STREAMED:
        manifest = _manifest(data)
        rows = sum(int(e["rows"]) for e in manifest["splits"]["train"] if e["name"] in names)
        held = rows * decoded_row_bytes(manifest)  # float32 features, int64 label
        budget = train_memory_bytes()
        if held <= budget:
            return load_partition(data, names, device)
        log.info(
            "training data: %d rows (%.0f MB) exceed the %.0f MB budget: streaming them from %d shard(s)",
            rows,
            held / 2**20,
            budget / 2**20,
            len(names),
        )
        options = data.options_here()
        local = cache_shards(data.manifest_uri, manifest, names, options, shard_cache_here())  # remote ones
        _STREAMED[(data.manifest_uri, names)] = StreamedRows(
            shard_blocks(data.manifest_uri, manifest, names, options),
            block_reader(data.manifest_uri, manifest, options, local),
            shuffle_buffer_rows(row_bytes=stored_row_bytes(manifest)),
            batch_decoder(manifest),
        )
    return _STREAMED[(data.manifest_uri, names)]


def load_partition(data: DataRef, shard_names: Sequence[str], device: str = "cpu") -> tuple[Any, Any]:
    """Features and labels of these training shards (rows in sorted shard order), loaded once per
    worker process and kept on ``device``."""
    import torch

    from mopflow.training.data import load_split

    names = tuple(sorted(shard_names))
    key = (data.manifest_uri, names, device)
    if key not in _PARTITIONS:
        host = next((v for k, v in _PARTITIONS.items() if k[:2] == key[:2]), None)
        if host is None:
            x, y = load_split(
                data.manifest_uri,
                "train",
                data.options_here(),
                shard_names=list(names),
                cache_dir=shard_cache_here(),
            )
            host = (torch.from_numpy(x), torch.from_numpy(y))
        _PARTITIONS[key] = (host[0].to(device), host[1].to(device))
    return _PARTITIONS[key]


def cached_bytes() -> int:
    """Bytes of training data this worker process holds (the storage footprint)."""
    return int(
        sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in _PARTITIONS.values())
    )


def clear_partitions() -> None:
    """Forget the cached partitions (between benchmark runs)."""
    _PARTITIONS.clear()
    _STREAMED.clear()
    _EVAL_SPLITS.clear()
    _MANIFESTS.clear()


def load_eval_split(data: DataRef, split: str) -> tuple[Any, Any]:
    """Features (as a tensor) and labels of an evaluation split, loaded once per worker process
    (evaluation moves them to the device a batch at a time)."""
    import torch

    from mopflow.training.data import load_split

    key = (data.manifest_uri, split)
    if key not in _EVAL_SPLITS:
        x, y = load_split(data.manifest_uri, split, data.options_here(), cache_dir=shard_cache_here())
        _EVAL_SPLITS[key] = (torch.from_numpy(x), y)
    return _EVAL_SPLITS[key]


def _manifest(data: DataRef) -> dict[str, Any]:
    """The data's manifest, read and verified once per worker process (as its partitions are
    loaded once): a unit builds its model from it every pass."""
    from mopflow.training.data import load_manifest

    if data.manifest_uri not in _MANIFESTS:
        _MANIFESTS[data.manifest_uri] = load_manifest(data.manifest_uri, data.options_here())
    return _MANIFESTS[data.manifest_uri]
