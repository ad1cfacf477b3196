"""The sharded dataset's format: manifest and shard constants, the parquet options every shard
is written with, and the errors and result of sharding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
