"""Shards that hold each image or sequence as one value: the ``x`` column keeps an image encoded
(its source's PNG/JPEG bytes) or a tensor whole (an Arrow fixed-size list of its dtype), and the
manifest's ``example`` entry records the encoding, shape and dtype.

Writing: a partition carries each example as bytes plus a few per-example statistics (helper
columns, summed into the manifest's normalization and never written). Reading: the examples
are decoded on the workers, resized to the manifest's shape, into flat float32 rows in [0, 1]
(images) or the tensors' values (tensors), batch by batch.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mopflow.training.data.manifest import LABEL_COLUMN

EXAMPLE_COLUMN = "x"
IMAGE = "image"  # encoded images (any format Pillow reads: PNG, JPEG)
TENSOR = "tensor"  # fixed-shape tensors
STAT_PREFIXES = ("_m", "_q")  # per example and group: the mean of its values and of their squares
ROW_GROUP_BYTES = 16 * 2**20  # a streamed block (one row group) stays about this size
CHANNEL_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}
Layout = Mapping[str, Any]


class ExampleError(ValueError):
    """An example cannot be read as its manifest says; the message names it."""


def example_layout(
    encoding: str, shape: Sequence[int], modality: str, dtype: str, formats: Sequence[str] = ()
) -> dict[str, Any]:
    """The manifest's ``example`` entry: the column, its encoding, the decoded shape, the stored
    dtype (``uint8`` for encoded images) and, for images, the formats found."""
    if encoding not in (IMAGE, TENSOR):
        raise ExampleError(f"example encoding {encoding!r} is not one of {[IMAGE, TENSOR]}")
    layout = {
        "column": EXAMPLE_COLUMN,
        "encoding": encoding,
        "shape": [int(n) for n in shape],
        "dtype": str(np.dtype(dtype)),
        "modality": modality,
    }
    return layout | ({"formats": sorted(set(formats))} if encoding == IMAGE else {})


def stat_columns(groups: int) -> list[str]:
    """The helper columns of a partition's per-example statistics."""
    return [f"{prefix}{g}" for prefix in STAT_PREFIXES for g in range(groups)]


def example_stats(x: np.ndarray, modality: str) -> np.ndarray:
    """Per example and group (channel or feature), the mean of its values and of their squares:
    ``(n, 2 * groups)`` float64. Every example has as many values per group, so their means over
    examples are the group's mean and second moment."""
    values = x.astype(np.float64, copy=False)
    if modality == "image":  # (n, c, h, w): groups on axis 1
        flat = values.reshape(len(values), values.shape[1], -1)
        return np.concatenate([flat.mean(axis=2), (flat * flat).mean(axis=2)], axis=1)
    flat = values.reshape(len(values), -1, values.shape[-1])  # (n, steps, features)
    return np.concatenate([flat.mean(axis=1), (flat * flat).mean(axis=1)], axis=1)


def group_normalization(mean: Sequence[float], layout: Layout) -> dict[str, Any]:
    """The manifest's normalization from the combined statistics columns (means of the per-example
    means and mean squares): per flat feature, as every model's input takes it, and per group."""
    moments = np.asarray(mean, dtype=np.float64).reshape(2, -1)
    group_mean = moments[0]
    group_std = np.sqrt(np.maximum(moments[1] - group_mean**2, 0.0))
    shape, modality = layout["shape"], layout["modality"]
    size = int(np.prod(shape))
    if modality == "image":  # channels first: each channel's pixels are contiguous
        flat_mean, flat_std = (
            np.repeat(group_mean, size // len(group_mean)),
            np.repeat(group_std, size // len(group_std)),
        )
    else:  # features last: a step's features are contiguous
        flat_mean, flat_std = (
            np.tile(group_mean, size // len(group_mean)),
            np.tile(group_std, size // len(group_std)),
        )
    key = "channel" if modality == "image" else "feature"
    return {
        "mean": flat_mean.tolist(),
        "std": flat_std.tolist(),
        f"{key}_mean": group_mean.tolist(),
        f"{key}_std": group_std.tolist(),
    }


# ---------------------------------------------------------------------------------------------
# Partitions (on the workers): examples as bytes, their statistics, labels, content hash, split


def content_hash(blobs: Sequence[bytes], labels: np.ndarray, salt: str) -> np.ndarray:
    """A number in [0, 1) per example from a hash of its bytes and label: an example keeps its
    split when examples are added."""
    key = hashlib.sha256(salt.encode()).digest()[:16]
    out = np.empty(len(blobs), dtype=np.float64)
    for i, (blob, label) in enumerate(zip(blobs, labels.tolist(), strict=True)):
        digest = hashlib.blake2b(blob, digest_size=8, key=key, person=str(int(label)).encode()[:16])
        out[i] = int.from_bytes(digest.digest(), "little") / 2.0**64
    return out


def examples_frame(blobs: Sequence[bytes], stats: np.ndarray, labels: np.ndarray) -> pd.DataFrame:
    """A partition's examples as a frame: the example column (bytes), the label and the helper
    statistics columns."""
    frame = pd.DataFrame({EXAMPLE_COLUMN: pd.Series(list(blobs), dtype=object), LABEL_COLUMN: labels})
    columns = stat_columns(stats.shape[1] // 2)
    return pd.concat([frame, pd.DataFrame(stats, columns=columns)], axis=1)


def tensor_blobs(x: np.ndarray) -> list[bytes]:
    """Each example of ``x`` (C order, its dtype) as bytes."""
    rows = np.ascontiguousarray(x).reshape(len(x), -1)
    return [row.tobytes() for row in rows]


# ---------------------------------------------------------------------------------------------
# Images


def decode_image(data: bytes | None, name: str) -> Any:
    """A decoded Pillow image; undecodable bytes are refused naming the image (``name``)."""
    from PIL import Image

    try:
        image: Image.Image = Image.open(io.BytesIO(data or b""))
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # UnidentifiedImageError is an OSError
        raise ExampleError(f"cannot decode image {name!r}: {exc}") from exc
    if image.mode == "P":  # a palette: its colours (with their transparency)
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    return image


def image_values(image: Any, shape: Sequence[int]) -> np.ndarray:
    """A decoded image as float32 ``(channels, height, width)`` in [0, 1], converted to
    ``shape``'s channel count and resized (bilinear) to its height and width."""
    from PIL import Image

    channels, height, width = (int(n) for n in shape)
    image = image.convert(CHANNEL_MODES[channels])
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    values = np.asarray(image, dtype=np.float32).reshape(height, width, channels)
    return values.transpose(2, 0, 1) / np.float32(255.0)


def decode_images(
    blobs: Sequence[Any], shape: Sequence[int], names: Sequence[str] | None = None
) -> np.ndarray:
    """Encoded images as flat float32 rows ``(n, prod(shape))`` in [0, 1], channels first."""
    out = np.empty((len(blobs), int(np.prod(shape))), dtype=np.float32)
    for i, blob in enumerate(blobs):
        name = names[i] if names is not None else f"example {i}"
        out[i] = image_values(decode_image(_as_bytes(blob), name), shape).reshape(-1)
    return out


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):  # base64 text (a served request)
        import base64
        import binascii

        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ExampleError(f"an encoded image is neither bytes nor base64 text: {exc}") from exc
    raise ExampleError(f"an encoded image must be bytes or base64 text, not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Shards: the example column as Arrow, and back


def arrow_examples(values: Sequence[bytes], layout: Layout) -> Any:
    """The example column of a shard: binary (encoded images) or a fixed-size list of the
    tensors' dtype."""
    import pyarrow as pa

    if layout["encoding"] == IMAGE:
        return pa.array(list(values), type=pa.binary())
    size = int(np.prod(layout["shape"]))
    flat = np.frombuffer(b"".join(values), dtype=np.dtype(layout["dtype"]))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), size)


def row_group_rows(row_bytes: float) -> int:
    """Rows per parquet row group of an example shard: a streamed block of about
    ``ROW_GROUP_BYTES`` (256 to 32,768 rows)."""
    return int(min(32_768, max(256, ROW_GROUP_BYTES // max(1.0, row_bytes))))


def decode_examples(values: Any, layout: Layout) -> np.ndarray:
    """A shard's example column (an Arrow array, or the objects pandas gives for it) as flat
    float32 rows; encoded images are decoded and resized to the layout's shape."""
    import pyarrow as pa

    size = int(np.prod(layout["shape"]))
    if layout["encoding"] == IMAGE:
        blobs = values.to_pylist() if isinstance(values, pa.Array | pa.ChunkedArray) else list(values)
        return decode_images(blobs, layout["shape"])
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        flat = values.flatten().to_numpy(zero_copy_only=False)
    else:
        flat = np.concatenate([np.asarray(v).reshape(-1) for v in values]) if len(values) else np.empty(0)
    return np.require(flat.astype(np.float32, copy=False).reshape(-1, size), requirements=["C", "W"])


def batch_decoder(manifest: Mapping[str, Any]) -> Callable[[np.ndarray], np.ndarray] | None:
    """What decodes a streamed batch's examples (encoded images are kept encoded through the
    shuffle buffer and decoded a batch at a time); None when the reader already decoded them."""
    layout = manifest.get("example")
    if layout is None or layout["encoding"] != IMAGE:
        return None
    shape = list(layout["shape"])
    return lambda blobs: decode_images(list(blobs), shape)


def read_examples(table: Any, manifest: Mapping[str, Any], decode: bool = True) -> np.ndarray:
    """The examples of an Arrow table read from a shard: flat float32 rows, or (``decode=False``,
    encoded images only) the encoded bytes as an object array."""
    layout = manifest.get("example")
    if layout is None:
        frame = table.select(list(manifest["feature_columns"])).to_pandas()
        return np.require(frame.to_numpy(dtype=np.float32), requirements=["C", "W"])
    column = table.column(layout["column"])
    if not decode and layout["encoding"] == IMAGE:
        out = np.empty(len(column), dtype=object)
        out[:] = column.to_pylist()
        return out
    return decode_examples(column, layout)


def input_dim(manifest: Mapping[str, Any]) -> int:
    """Values per example the models take (its flat size)."""
    if manifest.get("example") is not None:
        return int(np.prod(manifest["example"]["shape"]))
    return len(manifest["feature_columns"])


def stored_row_bytes(manifest: Mapping[str, Any]) -> float:
    """Mean bytes of one stored training row (what a streamed pass's shuffle buffer holds)."""
    entries = manifest["splits"]["train"]
    return sum(float(e["bytes"]) for e in entries) / max(1, sum(int(e["rows"]) for e in entries))


def decoded_row_bytes(manifest: Mapping[str, Any]) -> int:
    """Bytes one decoded training row takes in memory (float32 values, an int64 label)."""
    return 4 * input_dim(manifest) + 8
