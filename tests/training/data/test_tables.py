"""User tables (parquet/CSV from any fsspec URL): validation before writing, splits, determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mopflow.training.data import (
    DataValidationError,
    load_manifest,
    load_split,
    plan_shards,
    shard_dataset,
)
from mopflow.training.data.config import DataConfig


def _table(n: int = 400, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.normal(size=(n, 6)), columns=[f"f{i}" for i in range(6)])
    frame["kind"] = "a"  # a non-numeric column that must not become a feature by default
    frame["target"] = rng.integers(0, 3, size=n)
    return frame


def _nothing_written(root: Path) -> bool:
    return not (root / "datasets").exists() or not any((root / "datasets").iterdir())


def test_plan_shards_cuts_across_partitions_evenly() -> None:
    plan = plan_shards([5, 0, 7], 3)
    sizes = [sum(stop - start for _, start, stop in shard) for shard in plan]
    assert sizes == [4, 4, 4]
    assert plan[1] == [(0, 4, 5), (2, 0, 3)]


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_user_table_is_sharded_with_numeric_features(tmp_path: Path, dask_client: object, fmt: str) -> None:
    frame = _table()
    src = tmp_path / f"table.{fmt}"
    frame.to_parquet(src) if fmt == "parquet" else frame.to_csv(src, index=False)
    cfg = DataConfig(dataset=str(src), label_column="target", n_shards=3)
    result = shard_dataset(cfg, str(tmp_path / "out"), dask_client)
    manifest = load_manifest(result.manifest_uri)
    assert manifest["feature_columns"] == [f"f{i}" for i in range(6)]
    assert manifest["num_classes"] == 3
    rows = {s: sum(e["rows"] for e in manifest["splits"][s]) for s in manifest["splits"]}
    assert sum(rows.values()) == 400
    assert 40 <= rows["test"] <= 130 and 10 <= rows["validation"] <= 70
    x, y = load_split(result.manifest_uri, "train")
    assert x.shape[1] == 6 and y.dtype == np.int64
    # Each row keeps its split when rows are appended to the source.
    bigger = pd.concat([frame, _table(100, seed=1)], ignore_index=True)
    src2 = tmp_path / f"bigger.{fmt}"
    bigger.to_parquet(src2) if fmt == "parquet" else bigger.to_csv(src2, index=False)
    result2 = shard_dataset(cfg.model_copy(update={"dataset": str(src2)}), str(tmp_path / "out"), dask_client)
    assert result2.manifest_uri != result.manifest_uri
    x_test, _ = load_split(result.manifest_uri, "test")
    x_test2, _ = load_split(result2.manifest_uri, "test")
    old = {tuple(np.round(r, 5)) for r in x_test}
    new = {tuple(np.round(r, 5)) for r in x_test2}
    assert old <= new


def test_parquet_folder_with_explicit_features(tmp_path: Path, dask_client: object) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    frame = _table(600)
    frame.iloc[:300].to_parquet(folder / "part-0.parquet")
    frame.iloc[300:].to_parquet(folder / "part-1.parquet")
    cfg = DataConfig(dataset=str(folder), label_column="target", feature_columns=["f1", "f3"], n_shards=2)
    manifest = load_manifest(shard_dataset(cfg, str(tmp_path / "out"), dask_client).manifest_uri)
    assert manifest["feature_columns"] == ["f1", "f3"]
    assert sum(e["rows"] for s in manifest["splits"].values() for e in s) == 600


@pytest.mark.parametrize(
    ("mutate", "cfg_kwargs", "needle"),
    [
        (lambda f: f.drop(columns=["target"]), {}, "label column 'target' is missing"),
        (lambda f: f, {"feature_columns": ["f1", "nope"]}, "['nope'] are missing"),
        (lambda f: f, {"feature_columns": ["f1", "kind"]}, "must be numeric"),
        (lambda f: f.assign(target=1), {}, "1 class(es)"),
        (lambda f: f.iloc[:0], {}, "empty"),
        (lambda f: f.iloc[:10], {"n_shards": 50}, "more shards than rows"),
        (lambda f: f.assign(target=f["target"] + 0.5), {}, "integer class ids"),
    ],
)
def test_bad_tables_are_refused_before_anything_is_written(
    tmp_path: Path, dask_client: object, mutate: object, cfg_kwargs: dict, needle: str
) -> None:
    src = tmp_path / "t.parquet"
    mutate(_table()).to_parquet(src)  # type: ignore[operator]
    cfg = DataConfig(dataset=str(src), label_column="target", **cfg_kwargs)
    with pytest.raises(DataValidationError) as info:
        shard_dataset(cfg, str(tmp_path / "out"), dask_client)
    assert needle in str(info.value)
    assert _nothing_written(tmp_path / "out")


def test_nan_policy_fail_names_the_column_and_drop_reports_the_count(
    tmp_path: Path, dask_client: object
) -> None:
    frame = _table()
    frame.loc[[3, 7, 11], "f2"] = np.nan
    frame.loc[5, "f4"] = np.inf
    src = tmp_path / "t.parquet"
    frame.to_parquet(src)
    cfg = DataConfig(dataset=str(src), label_column="target")
    with pytest.raises(DataValidationError) as info:
        shard_dataset(cfg, str(tmp_path / "out"), dask_client)
    assert "4 row(s)" in str(info.value) and "'f2': 3" in str(info.value) and "'f4': 1" in str(info.value)
    assert _nothing_written(tmp_path / "out")
    dropped = shard_dataset(cfg.model_copy(update={"nan_policy": "drop"}), str(tmp_path / "out"), dask_client)
    manifest = load_manifest(dropped.manifest_uri)
    assert manifest["dropped_rows"] == 4
    assert sum(e["rows"] for s in manifest["splits"].values() for e in s) == 396


def test_missing_source_is_named(tmp_path: Path, dask_client: object) -> None:
    with pytest.raises(DataValidationError, match="does not exist"):
        shard_dataset(DataConfig(dataset=str(tmp_path / "nope.parquet")), str(tmp_path / "out"), dask_client)


def test_generated_shards_are_identical_on_one_and_two_workers(tmp_path: Path, dask_client: object) -> None:
    from mopflow.training.compute.cluster import dask_client as make_client

    cfg = DataConfig(num_samples=3000, partition_rows=1000, n_shards=3)
    two = load_manifest(shard_dataset(cfg, str(tmp_path / "two"), dask_client).manifest_uri)
    with make_client("", 1) as single:
        one = load_manifest(shard_dataset(cfg, str(tmp_path / "one"), single).manifest_uri)
    assert one["manifest_hash"] == two["manifest_hash"]
    assert [e["sha256"] for e in one["splits"]["train"]] == [e["sha256"] for e in two["splits"]["train"]]
    assert sum(e["rows"] for s in one["splits"].values() for e in s) == 3000


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        ({"notes.txt": b"a,b\n1,2\n"}, "dataset folder '{root}' holds no .parquet or .csv files"),
        ({"part-0.parquet": b"not parquet"}, "cannot read dataset '{root}'"),
    ],
)
def test_a_folder_without_a_readable_table_is_refused_naming_it(
    tmp_path: Path, files: dict[str, bytes], needle: str
) -> None:
    from mopflow.training.data.sources.kinds import describe_source

    root = tmp_path / "data"
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    with pytest.raises(DataValidationError) as info:
        describe_source(DataConfig(dataset=str(root), label_column="target"), None)
    assert needle.format(root=root) in str(info.value)
