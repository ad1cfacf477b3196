"""The kinds of data source, as a registry of small objects: which kind a dataset is, its
description (:class:`~mopflow.training.data.tables.SourceInfo`), its partitions started on the
workers, and for a generated dataset the data spec known before any sharding.

A kind matches a config by the dataset's name (generated data) or by what its URL holds; the
first kind in :data:`SOURCE_KINDS` that matches is the dataset's kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mopflow.training.data.config import KNOWN_DATASETS, DataConfig
from mopflow.training.data.partitions import generate_mnist1d_partition, prepare_table_partition
from mopflow.training.data.rules import (
    PARTITION_SEED_STRIDE,
    DataValidationError,
    check_columns,
    even_chunks,
    feature_columns,
)
from mopflow.training.data.sources import probe
from mopflow.training.data.sources.arrays import SourceError, is_npy_folder
from mopflow.training.data.sources.images import is_image_folder
from mopflow.training.data.tables import SourceInfo, read_table, table_fingerprint
from mopflow.training.models.families import DataSpec

Options = Mapping[str, Any] | None
MNIST1D_GENERATOR = "mnist1d-0.0.2"


@dataclass(frozen=True)
class SourceKind:
    """One kind of data source.

    ``matches`` tells whether a config's dataset is of this kind; ``describe`` reads what the
    source is (before anything is written; unusable items refused, naming them); ``partitions``
    starts its prepared partitions on the workers. A generated dataset (``generated``) is named in
    the config, and its ``spec`` is known before sharding; with ``own_test_split`` it brings its
    own test split, and only validation is cut from its training rows."""

    name: str
    matches: Callable[[DataConfig, Options], bool]
    describe: Callable[[DataConfig, Options, Any], SourceInfo]
    partitions: Callable[[DataConfig, SourceInfo, Any], list[Any]]
    generated: bool = False
    spec: Callable[[DataConfig], DataSpec] | None = None
    own_test_split: bool = False


def _named(name: str) -> Callable[[DataConfig, Options], bool]:
    return lambda cfg, storage_options: cfg.dataset == name


def _describe_mnist1d(cfg: DataConfig, storage_options: Options, client: Any) -> SourceInfo:
    fingerprint = {
        "dataset": "mnist1d",
        "num_samples": cfg.num_samples,
        "seed": cfg.seed,
        "partition_rows": cfg.partition_rows,
        "val_fraction": cfg.val_fraction,
        "generator": MNIST1D_GENERATOR,
    }
    return SourceInfo(fingerprint, feature_columns(40), kind="mnist1d", ordered_features=True)


def _mnist1d_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """Functions ``submit(worker)`` that start generating partition ``i`` on ``worker``
    (``per_partition_as_done`` hands them out as workers free up)."""
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


def _describe_table(cfg: DataConfig, storage_options: Options, client: Any) -> SourceInfo:
    """A user's parquet or CSV table: its columns validated from metadata."""
    fingerprint = table_fingerprint(cfg.dataset, storage_options)
    ddf = read_table(cfg.dataset, storage_options)
    features = check_columns(dict(ddf.dtypes.items()), cfg.label_column, cfg.feature_columns)
    fingerprint |= {"label": cfg.label_column, "features": features, "seed": cfg.seed}
    return SourceInfo(fingerprint, features, ddf)


def _table_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
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


SOURCE_KINDS: tuple[SourceKind, ...] = (
    SourceKind(
        "mnist1d",
        _named("mnist1d"),
        _describe_mnist1d,
        _mnist1d_partitions,
        generated=True,
        spec=lambda cfg: DataSpec(40, 10, ordered=True),  # 40 samples of the signal, 10 classes
        own_test_split=True,  # the package's published test split
    ),
    SourceKind(
        "shapes", _named("shapes"), probe.describe_shapes, probe.shapes_partitions, True, probe.shapes_spec
    ),
    # a location (a path or URL: it has a "/") holding tensors, a .npy pair or an image folder
    SourceKind(
        "tensors",
        lambda cfg, so: "/" in cfg.dataset and cfg.tensor_column is not None,
        probe.describe_tensors,
        probe.tensor_partitions,
    ),
    SourceKind(
        "npy",
        lambda cfg, so: "/" in cfg.dataset and is_npy_folder(cfg.dataset, so),
        probe.describe_npy,
        probe.npy_partitions,
    ),
    SourceKind(
        "images",
        lambda cfg, so: "/" in cfg.dataset and is_image_folder(cfg.dataset, so),
        probe.describe_images,
        probe.image_partitions,
    ),
    SourceKind("table", lambda cfg, so: True, _describe_table, _table_partitions),
)
KINDS_BY_NAME = {kind.name: kind for kind in SOURCE_KINDS}
# the config's dataset names are exactly the generated kinds (checked once, here)
if {kind.name for kind in SOURCE_KINDS if kind.generated} != set(KNOWN_DATASETS):
    raise ImportError("mopflow.training.data.sources.kinds: the generated kinds and KNOWN_DATASETS disagree")


def source_kind(cfg: DataConfig, storage_options: Options) -> SourceKind:
    """The kind of ``cfg.dataset``: the first in :data:`SOURCE_KINDS` that matches it."""
    return next(kind for kind in SOURCE_KINDS if kind.matches(cfg, storage_options))


def known_data_spec(cfg: DataConfig) -> DataSpec | None:
    """The :class:`~mopflow.training.models.families.DataSpec` of a generated dataset (known before
    sharding); None for a user's data, whose shape is known once it is read."""
    kind = KINDS_BY_NAME.get(cfg.dataset)
    return kind.spec(cfg) if kind is not None and kind.spec is not None else None


def describe_source(cfg: DataConfig, storage_options: Options, client: Any = None) -> SourceInfo:
    """Fingerprint and columns of the source; a user table's columns are validated here, from
    metadata (images: their headers, read on the workers of ``client``)."""
    try:
        return source_kind(cfg, storage_options).describe(cfg, storage_options, client)
    except SourceError as exc:
        raise DataValidationError(str(exc)) from exc


def source_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """The source's prepared partitions (the rows stay on the workers): futures, or functions
    ``submit(worker)`` that start one on a worker (generated data)."""
    return KINDS_BY_NAME[info.kind].partitions(cfg, info, client)
