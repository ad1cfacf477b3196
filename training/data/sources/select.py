"""Which kind a source is, and what it gives the sharding stage: its description
(:class:`~mopflow.training.data.tables.SourceInfo`) and its partitions, started on the workers;
and the data spec of a generated dataset, known before any sharding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mopflow.training.data.config import DataConfig
from mopflow.training.data.partitions import generate_mnist1d_partition, prepare_table_partition
from mopflow.training.data.rules import PARTITION_SEED_STRIDE, check_columns, even_chunks, feature_columns
from mopflow.training.data.sources import kinds as source_kinds
from mopflow.training.data.sources.arrays import shapes_data_spec
from mopflow.training.data.tables import SourceInfo, read_table, table_fingerprint
from mopflow.training.models.families import DataSpec


def known_data_spec(cfg: DataConfig) -> Any:
    """The :class:`~mopflow.training.models.families.DataSpec` of a generated dataset (known before sharding);
    None for a user's data, whose shape is known once it is read."""
    if cfg.dataset == "mnist1d":
        return DataSpec(40, 10)  # a table of 40 features (the signal's samples), 10 classes
    if cfg.dataset == "shapes":
        shape, classes = shapes_data_spec()
        return DataSpec(shape[0] * shape[1] * shape[2], classes, shape, "image")
    return None


def describe_source(
    cfg: DataConfig, storage_options: Mapping[str, Any] | None, client: Any = None
) -> SourceInfo:
    """Fingerprint and columns of the source; a user table's columns are validated here, from
    metadata (images: their headers, read on the workers of ``client``)."""
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
    (``per_partition_as_done`` hands them out as workers free up)."""
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
