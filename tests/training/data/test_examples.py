"""Images and sequences stored as one example column: encoded images kept as their bytes, tensors
kept whole, decoded (and resized) on the reading side, batch by batch when streamed."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mopflow.training.data import DataValidationError, load_manifest, load_split, shard_dataset
from mopflow.training.data.config import DataConfig


def _folder(
    root: Path, per_class: int, fmt: str = "JPEG", sizes: tuple[tuple[int, int], ...] = ((8, 6),)
) -> None:
    rng = np.random.default_rng(1)
    for label, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = sizes[i % len(sizes)]
            pixels = rng.integers(0, 60, (h, w, 3)).astype(np.uint8)
            pixels[..., label] += 150
            suffix = "jpg" if fmt == "JPEG" else "png"
            Image.fromarray(pixels, "RGB").save(root / name / f"{i:03d}.{suffix}", format=fmt)


def _cfg(dataset: Path, **extra: object) -> DataConfig:
    return DataConfig(dataset=str(dataset), n_shards=1, val_fraction=0.2, test_fraction=0.2, **extra)


def _shard_columns(manifest_uri: str) -> list[str]:
    folder = Path(manifest_uri).parent
    return pq.read_schema(folder / load_manifest(manifest_uri)["splits"]["train"][0]["name"]).names


def test_a_jpeg_folder_of_mixed_sizes_and_a_grey_image_is_kept_encoded(
    tmp_path: Path, dask_client: object
) -> None:
    root = tmp_path / "pets"
    _folder(root, 12, sizes=((8, 6), (10, 9)))
    Image.new("L", (7, 5), 128).save(root / "cat" / "grey.jpg")
    with pytest.raises(DataValidationError, match=r"most have 3, but .*cat/grey.jpg \(1 channel"):
        shard_dataset(_cfg(root, image_size=[4, 4]), str(tmp_path / "o1"), dask_client)
    result = shard_dataset(
        _cfg(root, image_size=[4, 4], mixed_channels="convert"), str(tmp_path / "o2"), dask_client
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["feature_columns"] == ["x"] and manifest["input_shape"] == [3, 4, 4]
    assert manifest["example"] | {"formats": None} == {
        "column": "x",
        "encoding": "image",
        "shape": [3, 4, 4],
        "dtype": "uint8",
        "modality": "image",
        "formats": None,
    }
    assert manifest["example"]["formats"] == ["jpeg"]
    assert _shard_columns(result.manifest_uri) == ["x", "label"]
    stored = sum(e["bytes"] for split in manifest["splits"].values() for e in split)
    folder = sum(p.stat().st_size for p in root.rglob("*.jpg"))
    assert stored < 2 * folder + 20_000  # the files' bytes, not a float per pixel
    x, y = load_split(result.manifest_uri, "train")
    assert x.shape[1] == 48 and x.dtype == np.float32 and x.min() >= 0.0 and x.max() <= 1.0
    images = x.reshape(-1, 3, 4, 4)
    for label in range(2):  # decoding kept channels first; the grey image became three equal channels
        assert images[y == label].mean(axis=(0, 2, 3)).argmax() == label
    assert len(manifest["normalization"]["mean"]) == 48 and len(manifest["normalization"]["channel_std"]) == 3


def test_a_corrupt_jpeg_is_refused_by_name_at_shard_time(tmp_path: Path, dask_client: object) -> None:
    root = tmp_path / "bad"
    _folder(root, 4)
    (root / "dog" / "002.jpg").write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(DataValidationError, match=r"cannot decode image .*dog/002.jpg"):
        shard_dataset(_cfg(root), str(tmp_path / "o"), dask_client)


def test_4d_npy_images_are_one_tensor_column_in_their_dtype(tmp_path: Path, dask_client: object) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (120, 3, 5, 4)).astype(np.uint8)
    y = rng.integers(0, 3, 120)
    folder = tmp_path / "arrays"
    folder.mkdir()
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    result = shard_dataset(_cfg(folder), str(tmp_path / "o"), dask_client)
    manifest = load_manifest(result.manifest_uri)
    assert manifest["example"]["encoding"] == "tensor" and manifest["example"]["dtype"] == "uint8"
    assert manifest["modality"] == "image" and manifest["input_shape"] == [3, 5, 4]
    shard = Path(result.manifest_uri).parent / manifest["splits"]["train"][0]["name"]
    kind = pq.read_schema(shard).field("x").type
    assert kind.list_size == 60 and str(kind.value_type) == "uint8"  # a fixed-size list
    rows = np.concatenate([load_split(result.manifest_uri, s)[0] for s in ("train", "validation", "test")])
    assert rows.dtype == np.float32
    expected = x.reshape(120, -1).astype(np.float32)
    assert np.array_equal(rows[np.lexsort(rows.T)], expected[np.lexsort(expected.T)])  # every example, whole
    channel_mean = manifest["normalization"]["channel_mean"]
    assert np.allclose(channel_mean, x.mean(axis=(0, 2, 3)), rtol=0.1)


def test_a_chw_tensor_column_and_a_3d_npy_sequence(tmp_path: Path, dask_client: object) -> None:
    import pyarrow as pa

    rng = np.random.default_rng(2)
    images = rng.random((80, 2, 3, 3)).astype(np.float32)
    table = pa.table(
        {"img": pa.FixedShapeTensorArray.from_numpy_ndarray(images), "label": rng.integers(0, 2, 80)}
    )
    pq.write_table(table, tmp_path / "t.parquet")
    result = shard_dataset(
        _cfg(tmp_path / "t.parquet", tensor_column="img"), str(tmp_path / "o1"), dask_client
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "image" and manifest["example"]["shape"] == [2, 3, 3]
    assert _shard_columns(result.manifest_uri) == ["x", "label"]

    folder = tmp_path / "seq"
    folder.mkdir()
    np.save(folder / "x.npy", rng.normal(size=(90, 7, 2)).astype(np.float32))
    np.save(folder / "y.npy", rng.integers(0, 2, 90))
    result = shard_dataset(_cfg(folder), str(tmp_path / "o2"), dask_client)
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "sequence" and manifest["feature_columns"] == ["x"]
    assert (
        len(manifest["normalization"]["feature_mean"]) == 2 and len(manifest["normalization"]["mean"]) == 14
    )
    assert load_split(result.manifest_uri, "train")[0].shape[1] == 14


def test_streamed_images_stay_encoded_until_their_batch(tmp_path: Path, dask_client: object) -> None:
    from mopflow.training.data.examples import batch_decoder
    from mopflow.training.data.streaming import StreamedRows, block_reader, shard_blocks

    root = tmp_path / "png"
    _folder(root, 20, fmt="PNG")
    result = shard_dataset(_cfg(root), str(tmp_path / "o"), dask_client)
    manifest = load_manifest(result.manifest_uri)
    names = [e["name"] for e in manifest["splits"]["train"]]
    read = block_reader(result.manifest_uri, manifest, {})
    blocks = shard_blocks(result.manifest_uri, manifest, names, {})
    assert read(blocks[0])[0].dtype == object  # encoded bytes through the shuffle buffer
    rows = StreamedRows(blocks, read, 8, batch_decoder(manifest))
    streamed = np.concatenate([b[0].numpy() for b in rows.batches(0, 0, 0, 5)])
    x, _ = load_split(result.manifest_uri, "train")
    assert np.array_equal(np.sort(streamed, axis=0), np.sort(x, axis=0))


def test_the_pyfunc_input_takes_base64_images_tensors_and_refuses_others() -> None:
    from mopflow.registry.inputs import model_rows
    from mopflow.training.data.examples import decode_images

    rng = np.random.default_rng(3)
    blobs = []
    for _ in range(3):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (6, 5, 3)).astype(np.uint8), "RGB").save(out, format="PNG")
        blobs.append(out.getvalue())
    text = [base64.b64encode(b).decode() for b in blobs]
    rows = model_rows(pd.DataFrame({"x": text}), ["x"], (3, 4, 4))
    assert rows.shape == (3, 48) and np.array_equal(rows, decode_images(blobs, (3, 4, 4)))
    tensors = rng.random((2, 3, 4, 4)).astype(np.float32)
    as_lists = pd.DataFrame({"x": [t.tolist() for t in tensors]})
    assert np.allclose(model_rows(as_lists, ["x"], (3, 4, 4)), tensors.reshape(2, -1))
    assert np.allclose(model_rows(tensors, ["x"], (3, 4, 4)), tensors.reshape(2, -1))
    with pytest.raises(ValueError, match=r"row 1 holds 3 values; expected a tensor of shape \[3, 4, 4\]"):
        model_rows(pd.DataFrame({"x": [tensors[0].tolist(), [1.0, 2.0, 3.0]]}), ["x"], (3, 4, 4))
    with pytest.raises(ValueError, match="cannot decode image 'row 0'"):
        model_rows(pd.DataFrame({"x": [base64.b64encode(b"nope").decode()]}), ["x"], (3, 4, 4))


def test_served_rows_are_writable_whatever_the_request_shares() -> None:
    """pandas' copy-on-write and a client's read-only array hand out views torch warns about
    (and must not write to): the rows a model gets are its own."""
    from mopflow.registry.inputs import model_rows

    frozen = np.arange(12, dtype=np.float32).reshape(3, 4)
    frozen.flags.writeable = False
    columns = ["a", "b", "c", "d"]
    frame = pd.DataFrame(frozen, columns=columns)
    for request in (frame, frozen, frozen.reshape(3, 2, 2)):
        shape = (2, 2) if request is not frame and np.ndim(request) == 3 else (4,)
        rows = model_rows(request, columns, shape)
        assert rows.flags.writeable and rows.flags.c_contiguous
        assert np.array_equal(rows, frozen.reshape(3, 4))
