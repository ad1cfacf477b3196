"""The s3:// path for real: an S3-compatible server (moto's server mode) on 127.0.0.1, used by the
driver and by the Dask worker processes through s3fs — nothing is patched."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from mopflow.training.data import (
    ShardIntegrityError,
    load_manifest,
    load_split,
    shard_dataset,
    verify_manifest,
)
from mopflow.training.data.config import DataConfig
from mopflow.training.data.ref import DataRef


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)  # it binds port 0 and reports its port
    server.start()
    _, port = server.get_host_and_port()
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
    from mopflow.training.data.streaming import StreamedRows
    from mopflow.training.executors.units import clear_partitions, training_rows

    result = shard_dataset(
        DataConfig(num_samples=700, n_shards=2), "s3://mopflow-test/stream", dask_client, s3_options
    )
    manifest = load_manifest(result.manifest_uri, s3_options)
    names = [e["name"] for e in manifest["splits"]["train"]]
    monkeypatch.setenv("MOPFLOW_TRAIN_MEMORY_MB", "0.01")
    monkeypatch.setenv("MOPFLOW_SHARD_CACHE", str(tmp_path / "cache"))
    clear_partitions()
    rows = training_rows(DataRef.open(result.manifest_uri, s3_options), names)
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


def _rows_on_a_worker(data: Any, names: list[str], worker_env: dict[str, str]) -> dict[str, Any]:
    """In a Dask worker process, with ``worker_env`` set in its environment for the call: the
    training rows of ``names`` of the ``DataRef`` ``data`` (made by the coordinator) as training
    reads them (held, or streamed under a small ``MOPFLOW_TRAIN_MEMORY_MB``), and what they
    decoded to."""
    from mopflow.training.data.streaming import StreamedRows
    from mopflow.training.executors.units import clear_partitions, training_rows

    before = {name: os.environ.get(name) for name in worker_env}
    os.environ.update(worker_env)
    clear_partitions()
    try:
        rows = training_rows(data, names)
        if isinstance(rows, StreamedRows):
            batches = list(rows.batches(0, 0, 0, 8))
            x = np.concatenate([b[0].numpy() for b in batches])
            y = np.concatenate([b[1].numpy() for b in batches])
        else:
            x, y = rows[0].numpy(), rows[1].numpy()
        return {"streamed": isinstance(rows, StreamedRows), "pid": os.getpid(), "x": x, "y": y}
    finally:
        clear_partitions()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_an_image_folder_on_s3_is_sharded_and_read_back_on_the_workers(
    s3_options: dict, dask_client: Any, tmp_path: Path
) -> None:
    """A PNG folder (root/<class>/*.png) uploaded to S3, sharded from its s3:// URL (files listed
    by the driver, probed and read by the workers), and its training rows decoded on a worker,
    held in memory and streamed."""
    import s3fs
    from PIL import Image

    rng = np.random.default_rng(4)
    fs = s3fs.S3FileSystem(**s3_options)
    classes = ["circle", "square", "triangle"]
    for label, name in enumerate(classes):
        for i in range(12):
            pixels = rng.integers(0, 60, (6, 5, 3)).astype(np.uint8)
            pixels[..., label] += 150  # each class brightest in its own channel
            out = io.BytesIO()
            Image.fromarray(pixels, "RGB").save(out, format="PNG")
            fs.pipe(f"mopflow-test/shapes/{name}/{i:03d}.png", out.getvalue())
    cfg = DataConfig(dataset="s3://mopflow-test/shapes", n_shards=2, val_fraction=0.2, test_fraction=0.2)
    result = shard_dataset(cfg, "s3://mopflow-test/image-out", dask_client, s3_options)
    assert result.manifest_uri.startswith("s3://mopflow-test/image-out/datasets/")
    manifest = load_manifest(result.manifest_uri, s3_options)
    assert manifest["input_shape"] == [3, 6, 5] and manifest["example"]["encoding"] == "image"
    assert manifest["example"]["formats"] == ["png"]
    assert sum(e["rows"] for s in manifest["splits"].values() for e in s) == 36
    names = [e["name"] for e in manifest["splits"]["train"]]
    n_train = sum(e["rows"] for e in manifest["splits"]["train"])
    cache = str(tmp_path / "cache")

    data = DataRef.open(result.manifest_uri, s3_options)
    held = dask_client.submit(
        _rows_on_a_worker, data, names, {"MOPFLOW_SHARD_CACHE": cache}, pure=False
    ).result(timeout=60)
    streamed = dask_client.submit(
        _rows_on_a_worker,
        data,
        names,
        {"MOPFLOW_SHARD_CACHE": cache, "MOPFLOW_TRAIN_MEMORY_MB": "0.001"},
        pure=False,
    ).result(timeout=60)
    assert held["pid"] != os.getpid() and streamed["pid"] != os.getpid()
    assert not held["streamed"] and streamed["streamed"]
    x, y = held["x"], held["y"]
    assert x.shape == (n_train, 3 * 6 * 5) and x.dtype == np.float32
    assert x.min() >= 0.0 and x.max() <= 1.0
    images = x.reshape(-1, 3, 6, 5)
    for label in np.unique(y):  # decoded channels first, each class in its own channel
        assert images[y == label].mean(axis=(0, 2, 3)).argmax() == label
    assert streamed["x"].shape == x.shape
    assert np.array_equal(np.sort(streamed["x"], axis=0), np.sort(x, axis=0))  # the same rows, reordered
    assert np.array_equal(np.sort(streamed["y"]), np.sort(y))
    assert shard_dataset(cfg, "s3://mopflow-test/image-out", dask_client, s3_options).reused


@pytest.mark.parametrize("memory_mb", ["2048", "0.001"], ids=["held", "streamed"])
def test_a_worker_caches_shards_in_its_own_folder_not_the_coordinators(
    s3_options: dict, dask_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_mb: str
) -> None:
    """The coordinator's MOPFLOW_SHARD_CACHE names a folder of its own host: a worker process with
    its own variable caches the shards it reads (held or streamed) in its folder, and the
    coordinator's folder is never made."""
    result = shard_dataset(
        DataConfig(num_samples=500, n_shards=2), "s3://mopflow-test/own-cache", dask_client, s3_options
    )
    manifest = load_manifest(result.manifest_uri, s3_options)
    names = [e["name"] for e in manifest["splits"]["train"]]
    coordinator_cache, worker_cache = tmp_path / "coordinator-cache", tmp_path / "worker-cache"
    monkeypatch.setenv("MOPFLOW_SHARD_CACHE", str(coordinator_cache))
    out = dask_client.submit(
        _rows_on_a_worker,
        DataRef.open(result.manifest_uri, s3_options),
        names,
        {"MOPFLOW_SHARD_CACHE": str(worker_cache), "MOPFLOW_TRAIN_MEMORY_MB": memory_mb},
        pure=False,
    ).result(timeout=60)
    assert out["pid"] != os.getpid() and out["streamed"] == (memory_mb != "2048")
    assert sorted(p.name for p in worker_cache.iterdir()) == sorted(
        f"{e['sha256']}.parquet" for e in manifest["splits"]["train"]
    )
    assert not coordinator_cache.exists()


@pytest.mark.parametrize("memory_mb", ["2048", "0.001"], ids=["held", "streamed"])
def test_a_worker_with_storage_options_of_its_own_reads_through_them(
    s3_options: dict, dask_client: Any, tmp_path: Path, memory_mb: str
) -> None:
    """The coordinator's endpoint is one the worker cannot reach (a closed port, as a loopback
    endpoint seen from another host): a worker that sets its own MOPFLOW_STORAGE_OPTIONS reads the
    manifest and the shards (held or streamed) through its own."""
    from mopflow.training.models.families import DataSpec

    result = shard_dataset(
        DataConfig(num_samples=500, n_shards=2), "s3://mopflow-test/own-options", dask_client, s3_options
    )
    manifest = load_manifest(result.manifest_uri, s3_options)
    names = [e["name"] for e in manifest["splits"]["train"]]
    unreachable = {
        **s3_options,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
    }
    sent = DataRef(result.manifest_uri, DataSpec.from_manifest(manifest), unreachable)
    worker_env = {
        "MOPFLOW_STORAGE_OPTIONS": json.dumps(s3_options),
        "MOPFLOW_SHARD_CACHE": str(tmp_path / "cache"),
        "MOPFLOW_TRAIN_MEMORY_MB": memory_mb,
    }
    out = dask_client.submit(_rows_on_a_worker, sent, names, worker_env, pure=False).result(timeout=120)
    x, _ = load_split(result.manifest_uri, "train", s3_options)
    assert out["pid"] != os.getpid() and out["streamed"] == (memory_mb != "2048")
    assert np.array_equal(np.sort(out["x"], axis=0), np.sort(x, axis=0))
