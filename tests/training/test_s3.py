"""The s3:// path for real: an S3-compatible server (moto's server mode) on 127.0.0.1, used by the
driver and by the Dask worker processes through s3fs — nothing is patched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1
from mopflow.training.data import (
    ShardIntegrityError,
    load_manifest,
    load_split,
    shard_dataset,
    verify_manifest,
)
from mopflow.training.data.config import DataConfig


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="mopflow-test")
    yield options
    server.stop()


def test_shards_round_trip_through_s3(s3_options: dict, dask_client: object, tmp_path: Path) -> None:
    import s3fs

    cfg = DataConfig(num_samples=600, n_shards=2)
    result = shard_dataset(cfg, "s3://mopflow-test/data", dask_client, s3_options)
    assert result.manifest_uri.startswith("s3://mopflow-test/data/datasets/")
    manifest = load_manifest(result.manifest_uri, s3_options)
    cache = tmp_path / "cache"
    x, y = load_split(result.manifest_uri, "train", s3_options, cache_dir=str(cache))
    assert len(x) == sum(e["rows"] for e in manifest["splits"]["train"]) and len(y) == len(x)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        f"{e['sha256']}.parquet" for e in manifest["splits"]["train"]
    )
    assert shard_dataset(cfg, "s3://mopflow-test/data", dask_client, s3_options).reused

    # Every training shard on S3 corrupted: read from S3 it is refused, so a second load that
    # still gives the same rows read none of them from S3 but from the cache.
    fs = s3fs.S3FileSystem(**s3_options)
    folder = result.manifest_uri.removeprefix("s3://").rsplit("/", 1)[0]
    for entry in manifest["splits"]["train"]:
        shard_path = f"{folder}/{entry['name']}"
        fs.pipe(shard_path, fs.cat(shard_path)[:-10] + b"0123456789")
    x_again, y_again = load_split(result.manifest_uri, "train", s3_options, cache_dir=str(cache))
    assert np.array_equal(x, x_again) and np.array_equal(y, y_again)
    with pytest.raises(ShardIntegrityError, match="train-00000.parquet is corrupt"):
        verify_manifest(result.manifest_uri, s3_options)
    with pytest.raises(ShardIntegrityError, match="is corrupt"):
        load_split(result.manifest_uri, "train", s3_options, cache_dir=str(tmp_path / "empty-cache"))


def test_a_partition_over_the_budget_streams_from_its_local_copies(
    s3_options: dict, dask_client: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mopflow.training.data.ref import DataRef
    from mopflow.training.data.streaming import StreamedRows
    from mopflow.training.executors.units import clear_partitions, training_rows

    result = shard_dataset(
        DataConfig(num_samples=700, n_shards=2), "s3://mopflow-test/stream", dask_client, s3_options
    )
    manifest = load_manifest(result.manifest_uri, s3_options)
    names = [e["name"] for e in manifest["splits"]["train"]]
    monkeypatch.setenv("MOPFLOW_TRAIN_MEMORY_MB", "0.01")
    clear_partitions()
    rows = training_rows(DataRef.open(result.manifest_uri, s3_options, str(tmp_path / "cache")), names)
    assert isinstance(rows, StreamedRows)
    copies = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert copies == sorted(f"{e['sha256']}.parquet" for e in manifest["splits"]["train"])
    streamed = np.concatenate([b[0].numpy() for b in rows.batches(0, 0, 0, 64)])
    x, _ = load_split(result.manifest_uri, "train", s3_options)
    assert streamed.shape == x.shape
    assert np.array_equal(np.sort(streamed, axis=0), np.sort(x, axis=0))  # the same rows, reordered
    clear_partitions()


def test_user_csv_on_s3(s3_options: dict, dask_client: object) -> None:
    import s3fs

    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(300, 4)), columns=["a", "b", "c", "d"])
    frame["y"] = rng.integers(0, 2, size=300)
    s3fs.S3FileSystem(**s3_options).pipe("mopflow-test/tables/t.csv", frame.to_csv(index=False).encode())
    cfg = DataConfig(dataset="s3://mopflow-test/tables/t.csv", label_column="y", n_shards=2)
    result = shard_dataset(cfg, "s3://mopflow-test/out", dask_client, s3_options)
    manifest = load_manifest(result.manifest_uri, s3_options)
    assert manifest["feature_columns"] == ["a", "b", "c", "d"]
    assert sum(e["rows"] for s in manifest["splits"].values() for e in s) == 300
