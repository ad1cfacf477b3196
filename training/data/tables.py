"""Sources of a sharding run: a user's table (its fingerprint, how it is read, its partitions)
and what is known about a source before sharding (:class:`SourceInfo`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mopflow.infra import storage
from mopflow.training.config import DataConfig
from mopflow.training.data.partitions import generate_mnist1d_partition, prepare_table_partition
from mopflow.training.data.rules import (
    PARTITION_SEED_STRIDE,
    DataValidationError,
    check_columns,
    even_chunks,
    feature_columns,
)


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
    from mopflow.training import source_kinds

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
    from mopflow.training import source_kinds

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
