"""A user's table as a source of a sharding run (its fingerprint, how it is read), and what is
known about any source before sharding (:class:`SourceInfo`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mopflow.base import storage
from mopflow.training.data.rules import (
    DataValidationError,
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
    example: dict[str, Any] | None = None  # images and sequences: one example column (its layout)
    row_bytes: float = 0.0  # stored bytes per example (0: 4 per feature)
    ordered_features: bool = False  # the features are one signal's steps, in order (DataSpec.ordered)
