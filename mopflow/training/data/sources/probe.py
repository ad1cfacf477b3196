"""The shard stage's image and array sources (generated ``shapes``, ``.npy`` pairs, image folders,
tensor columns): what each is (fingerprint, example shape, modality) and its partitions, started on
the Dask workers (``mopflow.training.data.sources.arrays`` and ``...images`` do the work). The
registry of kinds is :mod:`mopflow.training.data.sources.kinds`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mopflow.base import storage
from mopflow.training.data.config import DataConfig
from mopflow.training.data.examples import EXAMPLE_COLUMN, IMAGE, TENSOR, example_layout
from mopflow.training.data.rules import (
    PARTITION_SEED_STRIDE,
    even_chunks,
    feature_columns,
)
from mopflow.training.data.sources.arrays import (
    SourceError,
    SplitSettings,
    check_npy_pair,
    npy_header,
    npy_partition,
    shapes_data_spec,
    shapes_partition,
)
from mopflow.training.data.sources.images import (
    image_formats,
    image_partition,
    image_shape,
    list_image_folder,
    probe_encoded,
    probe_images,
    tensor_column,
    tensor_partition,
)
from mopflow.training.data.tables import SourceInfo, table_fingerprint
from mopflow.training.models.families import DataSpec

PROBE_CHUNK = 256  # images whose headers one task reads
SHAPES_GENERATOR = "shapes-1"
# in the fingerprint of every source stored as one example column: their shards' address changed
EXAMPLE_STORAGE = {"storage": "example-column-1"}


def _examples(
    info: SourceInfo, encoding: str, dtype: str, row_bytes: float, formats: list[str] | None = None
) -> SourceInfo:
    """``info`` stored as one example column (images and sequences; tables keep their columns)."""
    if info.modality == "table":
        return info
    layout = example_layout(encoding, info.input_shape, info.modality, dtype, formats or [])
    return dataclasses.replace(
        info,
        fingerprint=info.fingerprint | EXAMPLE_STORAGE,
        features=[EXAMPLE_COLUMN],
        example=layout,
        row_bytes=row_bytes,
    )


def _split(cfg: DataConfig) -> SplitSettings:
    return SplitSettings(cfg.val_fraction, cfg.test_fraction, cfg.seed, cfg.nan_policy)


def describe_shapes(cfg: DataConfig, storage_options: Mapping[str, Any] | None, client: Any) -> SourceInfo:
    """The generated ``shapes`` images: 3x16x16, 8 classes."""
    shape, classes = shapes_data_spec()
    fingerprint = {
        "dataset": "shapes",
        "num_samples": cfg.num_samples,
        "seed": cfg.seed,
        "partition_rows": cfg.partition_rows,
        "generator": SHAPES_GENERATOR,
    }
    names = [str(c) for c in range(classes)]
    info = SourceInfo(fingerprint, feature_columns(math.prod(shape)), None, "image", shape, "shapes", names)
    return _examples(info, TENSOR, "float32", 4.0 * math.prod(shape))


def shapes_spec(cfg: DataConfig) -> DataSpec:
    """The data spec of the ``shapes`` images, known before sharding."""
    shape, classes = shapes_data_spec()
    return DataSpec(math.prod(shape), classes, shape, "image")


def describe_npy(cfg: DataConfig, storage_options: Mapping[str, Any] | None, client: Any) -> SourceInfo:
    """A folder with ``x.npy`` and ``y.npy``: their headers, checked against each other."""

    headers = (
        npy_header(storage.join(cfg.dataset, "x.npy"), storage_options),
        npy_header(storage.join(cfg.dataset, "y.npy"), storage_options),
    )
    shape, modality = check_npy_pair(*headers, cfg.dataset)
    fingerprint = _files_fingerprint(cfg, storage_options) | {"seed": cfg.seed, "shape": list(shape)}
    info = SourceInfo(
        fingerprint,
        feature_columns(math.prod(shape)),
        None,
        modality,
        tuple(shape),
        "npy",
        None,
        headers,
        storage_options,
    )
    return _examples(info, TENSOR, str(headers[0].dtype), headers[0].dtype.itemsize * math.prod(shape))


def _files_fingerprint(cfg: DataConfig, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:

    fs, path = storage.filesystem(cfg.dataset, storage_options)
    entries = []
    for name in ("x.npy", "y.npy"):
        info = fs.info(f"{path.rstrip('/')}/{name}")
        stamp = info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("created")
        entries.append({"file": name, "size": info.get("size"), "stamp": str(stamp)})
    return {"url": cfg.dataset, "files": entries}


def describe_images(cfg: DataConfig, storage_options: Mapping[str, Any] | None, client: Any) -> SourceInfo:
    """An image folder (``root/<class>/*.png|jpg``): every image's header, read on the workers."""

    listing = list_image_folder(cfg.dataset, storage_options)
    chunks = [listing.files[i : i + PROBE_CHUNK] for i in range(0, len(listing.files), PROBE_CHUNK)]
    if client is None:
        probes = [p for chunk in chunks for p in probe_images(chunk, storage_options)]
    else:
        futures = [client.submit(probe_images, chunk, storage_options, pure=False) for chunk in chunks]
        probes = [p for part in client.gather(futures) for p in part]
    shape = image_shape(listing.files, probes, cfg.image_size, cfg.mixed_channels)
    fingerprint = listing.fingerprint | {"seed": cfg.seed, "shape": list(shape)}
    info = SourceInfo(
        fingerprint,
        feature_columns(math.prod(shape)),
        None,
        "image",
        shape,
        "images",
        listing.classes,
        listing,
        storage_options,
    )
    return _examples(info, IMAGE, "uint8", listing.mean_bytes, image_formats(listing.files))


def describe_tensors(cfg: DataConfig, storage_options: Mapping[str, Any] | None, client: Any) -> SourceInfo:
    """A parquet table whose ``tensor_column`` holds each example (a tensor, or an encoded image)."""

    assert cfg.tensor_column is not None
    source = tensor_column(cfg.dataset, cfg.tensor_column, cfg.label_column, storage_options)
    shape: tuple[int, ...]
    if source.shape is not None:
        shape = source.shape
        modality = {1: "table", 2: "sequence", 3: "image"}.get(len(shape))
        if modality is None:
            raise SourceError(
                f"tensor_column {cfg.tensor_column!r} holds tensors of shape {list(shape)}; expected (features,), "
                "(steps, features) or (channels, height, width)"
            )
    else:  # encoded images: their sizes are read on the workers
        if client is None:
            probes = [probe_encoded(f, source, storage_options) for f in source.files]
        else:
            probes = client.gather(
                [client.submit(probe_encoded, f, source, storage_options, pure=False) for f in source.files]
            )
        names = [
            f"{f}#row={i}" for f, part in zip(source.files, probes, strict=True) for i in range(len(part))
        ]
        shape = image_shape(names, [p for part in probes for p in part], cfg.image_size, cfg.mixed_channels)
        modality = "image"
    fingerprint = table_fingerprint(cfg.dataset, storage_options) | {
        "tensor_column": cfg.tensor_column,
        "label": cfg.label_column,
        "seed": cfg.seed,
        "shape": list(shape),
    }
    info = SourceInfo(
        fingerprint,
        feature_columns(math.prod(shape)),
        None,
        modality,
        tuple(shape),
        "tensors",
        None,
        source,
        storage_options,
    )
    if source.shape is None:
        return _examples(info, IMAGE, "uint8", 4.0 * math.prod(shape) / 8, ["png", "jpeg"])
    return _examples(info, TENSOR, source.dtype, np.dtype(source.dtype).itemsize * math.prod(shape))


def _chunks(n: int, cfg: DataConfig) -> list[tuple[int, int]]:
    return even_chunks(n, max(1, -(-n // cfg.partition_rows)))


def shapes_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """Futures of the generated ``shapes`` partitions, one seed each."""
    return [
        client.submit(
            shapes_partition, stop - start, cfg.seed + p * PARTITION_SEED_STRIDE, _split(cfg), pure=False
        )
        for p, (start, stop) in enumerate(_chunks(cfg.num_samples, cfg))
    ]


def image_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """Futures of an image folder's partitions, decoded on the workers."""
    listing = info.detail
    return [
        client.submit(
            image_partition,
            listing.files[start:stop],
            listing.labels[start:stop],
            info.input_shape,
            _split(cfg),
            info.storage_options,
            pure=False,
        )
        for start, stop in _chunks(len(listing.files), cfg)
    ]


def tensor_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """Futures of a tensor column's partitions: one per parquet file."""
    split, so = _split(cfg), info.storage_options
    return [
        client.submit(tensor_partition, url, info.detail, info.input_shape, split, so, pure=False)
        for url in info.detail.files
    ]


def npy_partitions(cfg: DataConfig, info: SourceInfo, client: Any) -> list[Any]:
    """Futures of an ``.npy`` pair's partitions, row ranges read on the workers."""
    split, so = _split(cfg), info.storage_options
    return [
        client.submit(npy_partition, cfg.dataset, info.detail, start, stop, split, so, pure=False)
        for start, stop in _chunks(info.detail[0].shape[0], cfg)
    ]
