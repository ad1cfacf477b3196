"""Image folders (``root/<class>/*.png|jpg``) and parquet tensor columns (Arrow fixed-shape
tensors or encoded PNG/JPEG bytes) as shard-stage sources.

The driver only lists files and reads schemas; images are probed (sizes, channels) and decoded
on the Dask workers, and an unusable one is refused naming it (its path, or ``file#row=i``).
Shards keep each image encoded as it came and each tensor whole (one example column).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mopflow.base import storage
from mopflow.base.hosts import storage_options_here
from mopflow.training.data.examples import ExampleError, decode_image, example_stats, image_values
from mopflow.training.data.sources.arrays import (
    SourceError,
    SplitSettings,
    prepared_examples,
    prepared_partition,
    tensor_examples,
)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
_MODE_CHANNELS = {
    "1": 1,
    "L": 1,
    "I": 1,
    "F": 1,
    "I;16": 1,
    "LA": 2,
    "RGB": 3,
    "YCbCr": 3,
    "RGBA": 4,
    "CMYK": 4,
}


# ---------------------------------------------------------------------------------------------
# Image folders: root/<class>/*.png|jpg


@dataclass(frozen=True)
class ImageListing:
    """An image folder's files (URLs), their class ids and the class names (sorted folders)."""

    files: list[str]
    labels: list[int]
    classes: list[str]
    fingerprint: dict[str, Any]
    mean_bytes: float = 0.0  # the files' mean size


def is_image_folder(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url`` is a folder whose sub-folders hold images (``root/<class>/*.png``)."""
    fs, path = storage.filesystem(url, storage_options)
    if not fs.isdir(path):
        return False
    return any(
        f.lower().endswith(IMAGE_EXTENSIONS) and f[len(path) :].strip("/").count("/") == 1
        for f in fs.find(path)
    )


def list_image_folder(url: str, storage_options: Mapping[str, Any] | None) -> ImageListing:
    """The folder's images by class; an empty class folder is refused naming it."""
    fs, path = storage.filesystem(url, storage_options)
    path = path.rstrip("/")
    classes = sorted(
        entry["name"].rstrip("/").rsplit("/", 1)[-1]
        for entry in fs.ls(path, detail=True)
        if entry["type"] == "directory"
    )
    if not classes:
        raise SourceError(f"image folder {url!r} has no class folders (expected root/<class>/*.png|jpg)")
    files: list[str] = []
    labels: list[int] = []
    entries: list[list[Any]] = []
    for label, name in enumerate(classes):
        found = sorted(f for f in fs.find(f"{path}/{name}") if f.lower().endswith(IMAGE_EXTENSIONS))
        if not found:
            raise SourceError(
                f"class folder {storage.join(url, name)!r} holds no images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        for f in found:
            info = fs.info(f)
            stamp = info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("created")
            entries.append([f[len(path) + 1 :], info.get("size"), str(stamp)])
            files.append(fs.unstrip_protocol(f) if "://" in url else f)
            labels.append(label)
    fingerprint = {
        "url": url,
        "classes": classes,
        "files": storage.canonical_hash(entries),
        "count": len(files),
    }
    mean_bytes = sum(float(e[1] or 0) for e in entries) / max(1, len(entries))
    return ImageListing(files, labels, classes, fingerprint, mean_bytes)


def decode(data: bytes | None, name: str) -> Any:
    """A decoded Pillow image; undecodable bytes are refused naming the image (``name``)."""
    try:
        return decode_image(data, name)
    except ExampleError as exc:
        raise SourceError(str(exc)) from exc


def probe(image: Any, name: str) -> tuple[int, int, int]:
    """(channels, height, width) of a decoded image; a mode without a channel count is refused."""
    channels = _MODE_CHANNELS.get(image.mode)
    if channels is None:
        raise SourceError(f"image {name!r} has mode {image.mode!r}; expected one of {sorted(_MODE_CHANNELS)}")
    return channels, image.height, image.width


def probe_images(
    files: Sequence[str], storage_options: Mapping[str, Any] | None
) -> list[tuple[int, int, int]]:
    """(channels, height, width) of each image (runs on a worker); an undecodable one is refused
    naming its path."""
    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    return [probe(decode(storage.read_bytes(url, storage_options), url), url) for url in files]


def image_shape(
    files: Sequence[str],
    probes: Sequence[tuple[int, int, int]],
    resize: Sequence[int] | None,
    mixed_channels: str = "refuse",
) -> tuple[int, int, int]:
    """The one (channels, height, width) the images are read as. Mixed channel counts are
    refused naming the images outside the most common count, or (``mixed_channels="convert"``)
    read as the largest count; mixed sizes are refused unless ``resize`` ((height, width)) is
    set, naming the sizes found."""
    by_channels: dict[int, list[str]] = {}
    by_size: dict[tuple[int, int], list[str]] = {}
    for url, (channels, height, width) in zip(files, probes, strict=True):
        by_channels.setdefault(channels, []).append(url)
        by_size.setdefault((height, width), []).append(url)
    if len(by_channels) > 1 and mixed_channels != "convert":
        common = max(by_channels, key=lambda c: (len(by_channels[c]), c))
        odd = [
            f"{url} ({c} channel(s))"
            for c, urls in sorted(by_channels.items())
            if c != common
            for url in urls
        ]
        raise SourceError(
            f"images have mixed channel counts: most have {common}, but {', '.join(odd[:5])}"
            f"{f' and {len(odd) - 5} more' if len(odd) > 5 else ''}; convert them to one mode, or set "
            "mixed_channels='convert'"
        )
    channels = max(by_channels)
    if resize is not None:
        return channels, int(resize[0]), int(resize[1])
    if len(by_size) > 1:
        found = ", ".join(
            f"{h}x{w} ({len(urls)} image(s), e.g. {urls[0]})" for (h, w), urls in sorted(by_size.items())
        )
        raise SourceError(f"images have mixed sizes (height x width): {found}; set image_size to resize them")
    height, width = next(iter(by_size))
    return channels, height, width


def encoded_examples(
    blobs: Sequence[bytes],
    names: Sequence[str],
    shape: Sequence[int],
    labels: np.ndarray,
    split: SplitSettings,
) -> pd.DataFrame:
    """Encoded images kept as they are, as a partition: each is decoded here once (an
    undecodable one is refused naming it) for its statistics at ``shape``."""
    stats = np.empty((len(blobs), 2 * int(shape[0])), dtype=np.float64)
    for i, (blob, name) in enumerate(zip(blobs, names, strict=True)):
        values = image_values(decode(blob, name), shape)
        stats[i] = example_stats(values[None], "image")[0]
    return prepared_examples(blobs, stats, labels, split)


def image_formats(files: Sequence[str]) -> list[str]:
    """The image formats of a folder's files, by extension (``png``, ``jpeg``)."""
    return sorted({"jpeg" if f.lower().endswith((".jpg", ".jpeg")) else "png" for f in files})


# ---------------------------------------------------------------------------------------------
# Parquet with a tensor column: Arrow's fixed-shape tensor type, or encoded images (PNG/JPEG bytes)


@dataclass(frozen=True)
class TensorColumn:
    """A parquet dataset's files and its tensor column: fixed-shape tensors (``shape`` known
    from the schema) or encoded images (``shape`` None until probed)."""

    files: list[str]
    column: str
    label: str
    shape: tuple[int, ...] | None
    dtype: str = "float32"  # the tensors' value type


def tensor_column(
    url: str, column: str, label: str, storage_options: Mapping[str, Any] | None
) -> TensorColumn:
    """Read the schema of a parquet file or folder; refuse a column that is missing or neither
    a fixed-shape tensor nor binary (encoded images), naming it and its type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = storage.filesystem(url, storage_options)
    if not fs.exists(path):
        raise SourceError(f"dataset {url!r} does not exist")
    files = [path] if fs.isfile(path) else sorted(f for f in fs.find(path) if f.endswith((".parquet", ".pq")))
    if not files:
        raise SourceError(
            f"dataset folder {url!r} holds no .parquet files (tensor_column={column!r} needs parquet)"
        )
    with fs.open(files[0], "rb") as f:
        schema = pq.read_schema(f)
    for name in (column, label):
        if name not in schema.names:
            raise SourceError(f"column {name!r} is not in {url!r}; its columns are {schema.names}")
    kind = schema.field(column).type
    dtype = "float32"
    if isinstance(kind, pa.FixedShapeTensorType):
        shape: tuple[int, ...] | None = tuple(int(n) for n in kind.shape)
        dtype = np.dtype(kind.value_type.to_pandas_dtype()).name
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        shape = None
    else:
        raise SourceError(
            f"tensor_column {column!r} has type {kind}; expected Arrow's fixed-shape tensor or binary "
            "(encoded PNG/JPEG images)"
        )
    urls = [fs.unstrip_protocol(f) if "://" in url else f for f in files]
    return TensorColumn(urls, column, label, shape, dtype)


def _read_columns(url: str, columns: Sequence[str], storage_options: Mapping[str, Any] | None) -> Any:
    import pyarrow.parquet as pq

    fs, path = storage.filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        return pq.read_table(f, columns=list(columns))


def probe_encoded(
    url: str, source: TensorColumn, storage_options: Mapping[str, Any] | None
) -> list[tuple[int, int, int]]:
    """(channels, height, width) of each encoded image of one parquet file (runs on a worker)."""
    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    table = _read_columns(url, [source.column], storage_options)
    return [
        probe(decode(blob, f"{url}#row={i}"), f"{url}#row={i}")
        for i, blob in enumerate(table.column(source.column).to_pylist())
    ]


# ---------------------------------------------------------------------------------------------
# Partitions (run on the Dask workers)


def image_partition(
    files: Sequence[str],
    labels: Sequence[int],
    shape: Sequence[int],
    split: SplitSettings,
    storage_options: Mapping[str, Any] | None,
) -> pd.DataFrame:
    """One partition of an image folder: the files' bytes as they are, split by content hash."""
    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    blobs = [storage.read_bytes(url, storage_options) for url in files]
    return encoded_examples(blobs, files, shape, np.asarray(labels, dtype=np.int64), split)


def tensor_partition(
    url: str,
    source: TensorColumn,
    shape: Sequence[int],
    split: SplitSettings,
    storage_options: Mapping[str, Any] | None,
) -> pd.DataFrame:
    """One parquet file's tensors (kept in their dtype) or encoded images (kept encoded), split
    by content hash."""
    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    table = _read_columns(url, [source.column, source.label], storage_options)
    labels = table.column(source.label).to_numpy()
    values = table.column(source.column).combine_chunks()
    if source.shape is not None:
        x = values.to_numpy_ndarray()
        modality = {1: "table", 2: "sequence", 3: "image"}[len(source.shape)]
        if modality == "table":
            return prepared_partition(x.reshape(len(table), -1).astype(np.float32), labels, split)
        return tensor_examples(x, labels, modality, split)
    names = [f"{url}#row={i}" for i in range(len(table))]
    return encoded_examples(values.to_pylist(), names, shape, labels, split)
