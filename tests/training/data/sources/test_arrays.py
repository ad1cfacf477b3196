from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mopflow.training.data import DataValidationError, load_manifest, load_split, shard_dataset
from mopflow.training.data.config import DataConfig
from mopflow.training.data.sources.arrays import (
    SHAPES_CLASSES,
    channel_normalization,
    expand_channels,
    generate_shapes,
)


def test_generated_shapes_are_deterministic_and_cover_every_class() -> None:
    x, y = generate_shapes(400, seed=3)
    again, _ = generate_shapes(400, seed=3)
    assert x.shape == (400, 3 * 16 * 16) and x.dtype == np.float32
    assert np.array_equal(x, again)
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert set(y.tolist()) == set(range(len(SHAPES_CLASSES)))
    assert not np.array_equal(x, generate_shapes(400, seed=4)[0])


def test_channel_normalization_pools_each_channels_pixels() -> None:
    rng = np.random.default_rng(0)
    images = rng.normal([[[1.0]], [[5.0]]], [[[2.0]], [[0.5]]], size=(500, 2, 3, 4)).reshape(500, -1)
    mean, std = channel_normalization(images.mean(0), images.std(0), (2, 3, 4))
    pooled = images.reshape(500, 2, -1).transpose(1, 0, 2).reshape(2, -1)
    assert np.allclose(mean, pooled.mean(1)) and np.allclose(std, pooled.std(1))
    assert expand_channels([1.0, 2.0], (2, 1, 2)) == [1.0, 1.0, 2.0, 2.0]


def test_npy_pairs_give_sequences_and_labels_outside_the_classes_are_refused(
    tmp_path: Path, dask_client: object
) -> None:
    rng = np.random.default_rng(0)
    folder = tmp_path / "seq"
    folder.mkdir()
    x = rng.normal(size=(300, 12, 2)).astype(np.float32)
    y = rng.integers(0, 3, 300)
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    result = shard_dataset(
        DataConfig(dataset=str(folder), n_shards=2, partition_rows=100), str(tmp_path / "out"), dask_client
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "sequence" and manifest["input_shape"] == [12, 2]
    xs, ys = [], []
    for split in ("train", "validation", "test"):
        part_x, part_y = load_split(result.manifest_uri, split)
        xs.append(part_x)
        ys.append(part_y)
    got = np.concatenate(xs)
    order = np.lexsort(got.T[::-1])
    expected = x.reshape(300, -1)
    assert np.array_equal(got[order], expected[np.lexsort(expected.T[::-1])])
    assert sorted(np.concatenate(ys).tolist()) == sorted(y.tolist())

    with pytest.raises(DataValidationError, match=r"label\(s\) \[2\] .* outside the 2 classes"):
        shard_dataset(DataConfig(dataset=str(folder), num_classes=2), str(tmp_path / "o2"), dask_client)
    np.save(folder / "y.npy", y[:10])
    with pytest.raises(DataValidationError, match=r"y.npy has shape \[10\]; expected \(300,\)"):
        shard_dataset(DataConfig(dataset=str(folder)), str(tmp_path / "o3"), dask_client)


def test_the_generated_shapes_dataset_shards_as_images(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(
        DataConfig(dataset="shapes", num_samples=600, n_shards=2), str(tmp_path / "out"), dask_client
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "image" and manifest["input_shape"] == [3, 16, 16]
    assert manifest["num_classes"] == len(SHAPES_CLASSES)
    rows = sum(e["rows"] for split in manifest["splits"].values() for e in split)
    assert rows == 600


@pytest.mark.parametrize(
    ("x", "y", "needle"),
    [
        (b"not an array", np.zeros(10, np.int64), "'{root}/x.npy' is not a .npy file"),
        (
            np.zeros(10, np.float32),
            np.zeros(10, np.int64),
            "{root}/x.npy has shape [10]; expected (n, features)",
        ),
        (
            np.zeros((10, 3), np.complex64),
            np.zeros(10, np.int64),
            "x.npy holds complex64 (fortran order: False)",
        ),
        (
            np.asfortranarray(np.zeros((10, 3), np.float32)),
            np.zeros(10, np.int64),
            "x.npy holds float32 (fortran order: True)",
        ),
        (
            np.zeros((10, 3), np.float32),
            np.zeros(10),
            "{root}/y.npy holds float64; expected integer class ids",
        ),
    ],
)
def test_an_unusable_npy_pair_is_refused_naming_the_file_and_what_it_holds(
    tmp_path: Path, x: np.ndarray | bytes, y: np.ndarray, needle: str
) -> None:
    from mopflow.training.data.sources.kinds import describe_source

    root = tmp_path / "pair"
    root.mkdir()
    if isinstance(x, bytes):
        (root / "x.npy").write_bytes(x)
    else:
        np.save(root / "x.npy", x)
    np.save(root / "y.npy", y)
    with pytest.raises(DataValidationError) as info:
        describe_source(DataConfig(dataset=str(root)), None)
    assert needle.format(root=root) in str(info.value)
