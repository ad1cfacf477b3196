from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from infra import storage
from training.config import DataConfig
from training.data import (
    DataValidationError,
    ShardIntegrityError,
    combine_stats,
    even_chunks,
    load_manifest,
    load_split,
    row_unit_interval,
    shard_dataset,
    verify_manifest,
)


def test_even_chunks_cover_all_rows_with_near_equal_sizes() -> None:
    chunks = even_chunks(10, 3)
    assert chunks == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(DataValidationError, match="more shards than rows"):
        even_chunks(2, 3)


def test_split_of_a_row_does_not_move_when_rows_are_appended() -> None:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(200, 5)).astype(np.float32))
    frame["label"] = rng.integers(0, 3, size=200)
    before = row_unit_interval(frame.iloc[:150], salt="s") < 0.2
    after = row_unit_interval(frame, salt="s") < 0.2
    assert np.array_equal(before, after[:150])
    assert 0.05 < after.mean() < 0.4


def test_combine_stats_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(30, 4)), rng.normal(3.0, 2.0, size=(50, 4))
    parts = [{"rows": len(p), "sum": p.sum(0), "sumsq": (p**2).sum(0)} for p in (a, b)]
    mean, std = combine_stats(parts)
    both = np.vstack([a, b])
    assert np.allclose(mean, both.mean(0)) and np.allclose(std, both.std(0))


def test_default_mnist1d_keeps_the_published_split(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(DataConfig(), str(tmp_path), dask_client)
    manifest = load_manifest(result.manifest_uri)
    rows = {s: sum(e["rows"] for e in manifest["splits"][s]) for s in manifest["splits"]}
    assert rows["train"] + rows["validation"] == 4000 and rows["test"] == 1000
    assert 300 <= rows["validation"] <= 500  # 10% held out by row hash
    sizes = [e["rows"] for e in manifest["splits"]["train"]]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 1
    x, y = load_split(result.manifest_uri, "train")
    assert x.shape == (rows["train"], 40) and set(np.unique(y)) == set(range(10))
    assert np.allclose(manifest["normalization"]["mean"], x.mean(0), atol=1e-4)
    assert np.allclose(manifest["normalization"]["std"], x.std(0), atol=1e-4)
    for entry in manifest["splits"]["train"]:
        url = storage.join(result.manifest_uri.rsplit("/", 1)[0], entry["name"])
        assert storage.sha256_url(url) == entry["sha256"]


def test_rerun_reuses_the_content_addressed_output(tmp_path: Path, dask_client: object) -> None:
    cfg = DataConfig(num_samples=400, n_shards=2)
    first = shard_dataset(cfg, str(tmp_path), dask_client)
    second = shard_dataset(cfg, str(tmp_path), dask_client)
    assert second.reused and not first.reused
    assert second.manifest_uri == first.manifest_uri and second.manifest_hash == first.manifest_hash
    other = shard_dataset(DataConfig(num_samples=400, n_shards=3), str(tmp_path), dask_client)
    assert other.manifest_uri != first.manifest_uri


def test_corrupt_or_missing_shard_is_named(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(DataConfig(num_samples=400, n_shards=2), str(tmp_path), dask_client)
    folder = Path(result.manifest_uri).parent
    shard = folder / "train-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardIntegrityError, match="train-00001.parquet is corrupt"):
        verify_manifest(result.manifest_uri)
    shard.unlink()
    with pytest.raises(ShardIntegrityError, match="train-00001.parquet is missing"):
        load_split(result.manifest_uri, "train")


def test_edited_manifest_is_refused(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(DataConfig(num_samples=400, n_shards=2), str(tmp_path), dask_client)
    manifest = storage.read_json(result.manifest_uri)
    manifest["splits"]["train"][0]["rows"] += 1
    storage.write_json_atomic(result.manifest_uri, manifest)
    with pytest.raises(ShardIntegrityError, match="modified"):
        load_manifest(result.manifest_uri)
