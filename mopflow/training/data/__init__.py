"""Data sharding on Dask: generate or read a dataset, split it, write parquet shards + manifest,
and read them back verified.

Output is content-addressed: the folder name is a hash of the source and the shard config,
so a rerun with the same input reuses the shards (the manifest is written last, so its
presence means the shards are complete).

- :mod:`mopflow.training.data.manifest`: the format (constants, errors, the sharding result);
- :mod:`mopflow.training.data.rules`: pure rules (keys, shard plans, splits, statistics, validation);
- :mod:`mopflow.training.data.partitions`: what runs on the workers (partitions, shard writing);
- :mod:`mopflow.training.data.tables`: a user's table as a source;
- :mod:`mopflow.training.data.sharding`: the sharding stage itself (:func:`shard_dataset`);
- :mod:`mopflow.training.data.placement`: where its tasks run on the Dask workers;
- :mod:`mopflow.training.data.reading`: manifests, shards and splits read back and verified.
"""

from __future__ import annotations

from mopflow.training.data.manifest import (
    LABEL_COLUMN,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    PARQUET_WRITE_OPTIONS,
    SHARD_FORMAT_VERSION,
    SPLITS,
    ShardIntegrityError,
    ShardResult,
)
from mopflow.training.data.partitions import (
    generate_mnist1d_partition,
    parquet_bytes,
    partition_stats,
    prepare_table_partition,
    restratify_partition,
    take_rows,
    write_shard,
)
from mopflow.training.data.placement import (
    SLICE_PRIORITY,
    contiguous_runs,
    feed_cap,
    next_partition,
)
from mopflow.training.data.reading import (
    _fetch_shard,
    _is_local,
    _manifest_dir,
    load_manifest,
    load_split,
    read_shard,
    shard_problem,
    split_shards,
    stored_images,
    verify_manifest,
)
from mopflow.training.data.rules import (
    DROPPED,
    HASH_BINS,
    HASH_COLUMN,
    INVALID,
    PARTITION_SEED_STRIDE,
    SPLIT_COLUMN,
    DataValidationError,
    SplitRule,
    assign_splits,
    balance_writers,
    check_columns,
    class_hash_histogram,
    class_hash_values,
    combine_stats,
    even_chunks,
    feature_columns,
    feature_sums,
    manifest_hash,
    mark_nonfinite,
    plan_shards,
    row_unit_interval,
    shard_key,
    split_rule,
    split_shard_counts,
    stratified_thresholds,
    threshold_positions,
    training_shards,
    validate_stats,
)
from mopflow.training.data.sharding import shard_dataset
from mopflow.training.data.sources.kinds import describe_source, source_partitions
from mopflow.training.data.tables import SourceInfo, read_table, table_fingerprint

__all__ = [
    "DROPPED",
    "DataValidationError",
    "HASH_BINS",
    "HASH_COLUMN",
    "INVALID",
    "LABEL_COLUMN",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "PARQUET_WRITE_OPTIONS",
    "PARTITION_SEED_STRIDE",
    "SHARD_FORMAT_VERSION",
    "SLICE_PRIORITY",
    "SPLITS",
    "SPLIT_COLUMN",
    "ShardIntegrityError",
    "ShardResult",
    "SourceInfo",
    "SplitRule",
    "_fetch_shard",
    "_is_local",
    "_manifest_dir",
    "assign_splits",
    "balance_writers",
    "check_columns",
    "class_hash_histogram",
    "class_hash_values",
    "combine_stats",
    "contiguous_runs",
    "describe_source",
    "even_chunks",
    "feature_columns",
    "feature_sums",
    "feed_cap",
    "generate_mnist1d_partition",
    "load_manifest",
    "load_split",
    "manifest_hash",
    "mark_nonfinite",
    "next_partition",
    "parquet_bytes",
    "partition_stats",
    "plan_shards",
    "prepare_table_partition",
    "read_shard",
    "read_table",
    "restratify_partition",
    "row_unit_interval",
    "shard_dataset",
    "shard_key",
    "split_shard_counts",
    "split_shards",
    "stored_images",
    "training_shards",
    "shard_problem",
    "source_partitions",
    "split_rule",
    "stratified_thresholds",
    "table_fingerprint",
    "take_rows",
    "threshold_positions",
    "validate_stats",
    "verify_manifest",
    "write_shard",
]
