from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mopflow.training.data import DataValidationError, load_manifest, load_split, shard_dataset
from mopflow.training.data.config import DataConfig
from mopflow.training.models.families import DataSpec


def _write_images(root: Path, per_class: int = 12, size: tuple[int, int] = (8, 6), mode: str = "RGB") -> None:
    rng = np.random.default_rng(0)
    for label, name in enumerate(["cat", "dog", "owl"]):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 60, (size[1], size[0], 3)).astype(np.uint8)
            pixels[..., label] += 150  # each class has its own dominant channel
            Image.fromarray(pixels, "RGB").convert(mode).save(folder / f"{i:03d}.png")


def test_image_folder_is_decoded_on_workers_with_shape_classes_and_channel_stats(
    tmp_path: Path, dask_client: object
) -> None:
    _write_images(tmp_path / "pets")
    result = shard_dataset(
        DataConfig(dataset=str(tmp_path / "pets"), n_shards=2, val_fraction=0.2, test_fraction=0.2),
        str(tmp_path / "out"),
        dask_client,
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "image" and manifest["input_shape"] == [3, 6, 8]
    assert manifest["classes"] == ["cat", "dog", "owl"] and manifest["num_classes"] == 3
    assert len(manifest["normalization"]["channel_mean"]) == 3
    assert len(manifest["normalization"]["mean"]) == 3 * 6 * 8
    assert DataSpec.from_manifest(manifest) == DataSpec(144, 3, (3, 6, 8), "image")
    x, y = load_split(result.manifest_uri, "train")
    assert x.shape[1] == 144 and x.min() >= 0.0 and x.max() <= 1.0
    images = x.reshape(-1, 3, 6, 8)
    for label in range(3):  # the class's dominant channel survived decoding, channels first
        assert images[y == label].mean(axis=(0, 2, 3)).argmax() == label


def test_image_problems_are_refused_naming_the_item(tmp_path: Path, dask_client: object) -> None:
    root = tmp_path / "bad"
    _write_images(root, per_class=3)
    (root / "dog" / "001.png").write_bytes(b"not an image")
    with pytest.raises(DataValidationError, match=r"cannot decode image .*dog/001.png"):
        shard_dataset(DataConfig(dataset=str(root)), str(tmp_path / "o1"), dask_client)

    mixed = tmp_path / "mixed"
    _write_images(mixed, per_class=10)
    Image.new("RGB", (10, 9)).save(mixed / "owl" / "big.png")
    with pytest.raises(DataValidationError, match=r"mixed sizes .*6x8 \(30 image\(s\).*9x10 \(1 image"):
        shard_dataset(DataConfig(dataset=str(mixed)), str(tmp_path / "o2"), dask_client)
    resized = shard_dataset(
        DataConfig(dataset=str(mixed), image_size=[4, 4], n_shards=1, val_fraction=0.2, test_fraction=0.2),
        str(tmp_path / "o3"),
        dask_client,
    )
    assert load_manifest(resized.manifest_uri)["input_shape"] == [3, 4, 4]

    channels = tmp_path / "channels"
    _write_images(channels, per_class=3)
    Image.new("L", (8, 6)).save(channels / "cat" / "grey.png")
    with pytest.raises(
        DataValidationError, match=r"mixed channel counts: most have 3, but .*grey.png \(1 channel"
    ):
        shard_dataset(DataConfig(dataset=str(channels)), str(tmp_path / "o4"), dask_client)

    empty = tmp_path / "empty"
    _write_images(empty, per_class=3)
    (empty / "yak").mkdir()
    with pytest.raises(DataValidationError, match=r"class folder .*yak' holds no images"):
        shard_dataset(DataConfig(dataset=str(empty)), str(tmp_path / "o5"), dask_client)
    assert not (tmp_path / "o1").exists() or not any((tmp_path / "o1").rglob("*.parquet"))


def test_parquet_tensor_columns_fixed_shape_and_encoded_images(tmp_path: Path, dask_client: object) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6, 3)).astype(np.float32)
    folder = tmp_path / "tensors"
    folder.mkdir()
    for part in range(2):  # a partition per file
        rows = slice(100 * part, 100 * (part + 1))
        table = pa.table(
            {"example": pa.FixedShapeTensorArray.from_numpy_ndarray(x[rows]), "y": rng.integers(0, 2, 100)}
        )
        pq.write_table(table, folder / f"part-{part}.parquet")
    result = shard_dataset(
        DataConfig(dataset=str(folder), tensor_column="example", label_column="y", n_shards=2),
        str(tmp_path / "o1"),
        dask_client,
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "sequence" and manifest["input_shape"] == [6, 3]
    assert sum(e["rows"] for split in manifest["splits"].values() for e in split) == 200

    def png(pixels: np.ndarray) -> bytes:
        out = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(out, format="PNG")
        return out.getvalue()

    blobs = [png(rng.integers(0, 255, (5, 4, 3)).astype(np.uint8)) for _ in range(60)]
    images = tmp_path / "images.parquet"
    pq.write_table(pa.table({"img": blobs, "label": rng.integers(0, 3, 60)}), images)
    result = shard_dataset(
        DataConfig(dataset=str(images), tensor_column="img", n_shards=1, val_fraction=0.2, test_fraction=0.2),
        str(tmp_path / "o2"),
        dask_client,
    )
    manifest = load_manifest(result.manifest_uri)
    assert manifest["modality"] == "image" and manifest["input_shape"] == [3, 5, 4]
    assert len(manifest["normalization"]["channel_std"]) == 3

    pq.write_table(pa.table({"img": [*blobs[:3], b"junk"], "label": [0, 1, 2, 0]}), tmp_path / "bad.parquet")
    with pytest.raises(DataValidationError, match=r"cannot decode image .*bad.parquet#row=3"):
        shard_dataset(
            DataConfig(dataset=str(tmp_path / "bad.parquet"), tensor_column="img"),
            str(tmp_path / "o3"),
            dask_client,
        )
    with pytest.raises(DataValidationError, match=r"tensor_column 'label' has type int64; expected"):
        shard_dataset(
            DataConfig(dataset=str(images), tensor_column="label"), str(tmp_path / "o4"), dask_client
        )


def test_a_folder_without_class_folders_and_an_image_of_another_mode_are_named(tmp_path: Path) -> None:
    from mopflow.training.data.sources.images import SourceError, list_image_folder, probe

    Image.new("RGB", (4, 4)).save(tmp_path / "loose.png")
    with pytest.raises(SourceError) as info:
        list_image_folder(str(tmp_path), None)
    assert f"image folder '{tmp_path}' has no class folders" in str(info.value)
    with pytest.raises(SourceError, match=r"image 'owl/7.png' has mode 'HSV'; expected one of \['1', "):
        probe(Image.new("HSV", (4, 4)), "owl/7.png")


def _tensor_table(path: Path, shape: tuple[int, ...]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.zeros((6, *shape), np.float32)
    pq.write_table(
        pa.table({"example": pa.FixedShapeTensorArray.from_numpy_ndarray(x), "y": [0, 1] * 3}), path
    )


@pytest.mark.parametrize(
    ("name", "cfg", "needle"),
    [
        ("missing.parquet", {"tensor_column": "example"}, "dataset '{url}' does not exist"),
        (
            "csv-folder",
            {"tensor_column": "example"},
            "dataset folder '{url}' holds no .parquet files (tensor_column='example' needs parquet)",
        ),
        (
            "t.parquet",
            {"tensor_column": "pixels", "label_column": "y"},
            "column 'pixels' is not in '{url}'; its columns are ['example', 'y']",
        ),
        ("t.parquet", {"tensor_column": "example"}, "column 'label' is not in '{url}'"),
        (
            "t4d.parquet",
            {"tensor_column": "example", "label_column": "y"},
            "tensor_column 'example' holds tensors of shape [2, 2, 2, 2]",
        ),
    ],
)
def test_an_unusable_tensor_column_is_refused_naming_it(
    tmp_path: Path, name: str, cfg: dict[str, str], needle: str
) -> None:
    from mopflow.training.data.sources.kinds import describe_source

    (tmp_path / "csv-folder").mkdir()
    (tmp_path / "csv-folder" / "t.csv").write_text("example,label\n1,0\n")
    _tensor_table(tmp_path / "t.parquet", (3,))
    _tensor_table(tmp_path / "t4d.parquet", (2, 2, 2, 2))
    url = str(tmp_path / name)
    with pytest.raises(DataValidationError) as info:
        describe_source(DataConfig(dataset=url, **cfg), None)
    assert needle.format(url=url) in str(info.value)
