"""What a served model takes: a table's feature columns, a tensor of examples ``(n, *shape)``, or
one example column ``x`` of encoded images (base64 PNG/JPEG text or bytes) or of tensors."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mopflow.training.data.examples import EXAMPLE_COLUMN, IMAGE, decode_images


def model_rows(model_input: Any, columns: Sequence[str], shape: Sequence[int]) -> np.ndarray:
    """A served request as the flat float32 rows a model takes; a malformed one is refused
    naming what was expected."""
    size = int(np.prod(shape))
    if isinstance(model_input, pd.DataFrame):
        if list(columns) == [EXAMPLE_COLUMN]:
            return example_column_rows(model_input, shape)
        missing = [c for c in columns if c not in model_input.columns]
        if missing:
            raise ValueError(f"input is missing feature column(s) {missing[:5]}")
        x = model_input[list(columns)].to_numpy(dtype=np.float32)
    else:
        x = np.asarray(model_input, dtype=np.float32)
        if x.ndim == len(shape) + 1:
            if tuple(x.shape[1:]) != tuple(shape):
                raise ValueError(f"expected examples of shape {list(shape)}, got {list(x.shape[1:])}")
            x = x.reshape(len(x), -1)
    if x.ndim != 2 or x.shape[1] != size:
        raise ValueError(f"expected {size} features per row, got shape {x.shape}")
    # pandas' copy-on-write hands out read-only views, which torch.as_tensor warns about: copy then
    return np.require(x, requirements=["C", "W"])


def example_column_rows(frame: pd.DataFrame, shape: Sequence[int]) -> np.ndarray:
    """The ``x`` column of a request: encoded images (base64 text or bytes; decoded, converted to
    the model's channels and resized to its size) or tensors of the model's shape."""
    if EXAMPLE_COLUMN not in frame.columns:
        raise ValueError(
            f"input needs the column {EXAMPLE_COLUMN!r} (one example per row); it has {list(frame.columns)[:5]}"
        )
    values = frame[EXAMPLE_COLUMN].tolist()
    if not values:
        return np.empty((0, int(np.prod(shape))), dtype=np.float32)
    if all(isinstance(v, str | bytes | bytearray) for v in values):
        if len(shape) != 3:
            raise ValueError(f"encoded images were sent, but the model takes examples of shape {list(shape)}")
        return decode_images(values, shape, [f"row {i}" for i in range(len(values))])
    rows = [np.asarray(v, dtype=np.float32) for v in values]
    bad = next((i for i, r in enumerate(rows) if r.size != int(np.prod(shape))), None)
    if bad is not None:
        raise ValueError(f"row {bad} holds {rows[bad].size} values; expected a tensor of shape {list(shape)}")
    return np.stack([r.reshape(-1) for r in rows])


def served_examples(frame: pd.DataFrame, x: np.ndarray, manifest: Mapping[str, Any]) -> Any:
    """A shard's rows as a client sends them: base64 text of the stored images (encoded images), a
    tensor ``(n, *shape)`` (other images, sequences, and tables whose features are one signal's
    steps in order, such as MNIST-1D) or the feature columns (other tables).
    ``frame``: the shard as read; ``x``: its decoded rows.

    What this returns is also a logged model's input example, so it sets the signature: a
    tensor's is one ``TensorSpec``, which MLflow checks in one step, where a table's 40 columns
    are checked one by one (about 1.4 ms of a request of 256 rows on one CPU thread). A signal's
    clients may still send its columns as a table: MLflow takes them in their order."""
    layout = manifest.get("example")
    if layout is not None and layout["encoding"] == IMAGE:
        text = [base64.b64encode(bytes(v)).decode("ascii") for v in frame[layout["column"]]]
        return pd.DataFrame({EXAMPLE_COLUMN: text})
    shape = list(manifest.get("input_shape") or [x.shape[1]])
    if str(manifest.get("modality", "table")) != "table" or manifest.get("ordered_features"):
        return x.reshape(-1, *shape)
    return pd.DataFrame(x, columns=manifest["feature_columns"])


def example_input(manifest_uri: str, manifest: Mapping[str, Any], storage_options: Mapping[str, Any]) -> Any:
    """A few validation examples of the dataset ``manifest`` describes, as a logged model's input
    example: a frame of a table's columns, an array of tensors ``(n, *shape)`` for images and
    sequences (a TensorSpec signature), or one column of base64 images for images stored encoded
    (one string column)."""
    from mopflow.training.data import read_shard
    from mopflow.training.data.reading import shard_arrays

    first = manifest["splits"]["validation"][0]  # one shard is enough for five rows
    frame = read_shard(manifest_uri, manifest, first, storage_options).iloc[:5]
    x, _ = shard_arrays(frame, manifest)
    return served_examples(frame, x, manifest)


def serving_request(
    manifest_uri: str, manifest: Mapping[str, Any], storage_options: Mapping[str, Any], rows: int
) -> Any:
    """A request of ``rows`` validation rows as a client sends them (:func:`served_examples`), the
    first validation shard's rows repeated when it has fewer: what a latency is timed on."""
    from mopflow.training.data import read_shard
    from mopflow.training.data.reading import shard_arrays

    first = manifest["splits"]["validation"][0]
    frame = read_shard(manifest_uri, manifest, first, storage_options)
    if frame.empty:
        raise ValueError(f"the validation shard {first['name']!r} has no rows to time a request on")
    picked = np.arange(rows) % len(frame)
    frame = frame.iloc[picked].reset_index(drop=True)
    x, _ = shard_arrays(frame, manifest)
    return served_examples(frame, x, manifest)
