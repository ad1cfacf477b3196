from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from mopflow.base import storage
from mopflow.training.data import (
    PARQUET_WRITE_OPTIONS,
    SPLIT_COLUMN,
    SPLITS,
    DataValidationError,
    ShardIntegrityError,
    SplitRule,
    assign_splits,
    combine_stats,
    even_chunks,
    feature_sums,
    generate_mnist1d_partition,
    load_manifest,
    load_split,
    manifest_hash,
    parquet_bytes,
    row_unit_interval,
    shard_dataset,
    split_shard_counts,
    stratified_thresholds,
    take_rows,
    threshold_positions,
    training_shards,
    verify_manifest,
)
from mopflow.training.data.config import DataConfig


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


def test_feature_sums_accumulate_in_float64() -> None:
    rng = np.random.default_rng(1)
    # an offset that float32 accumulation would lose digits of
    values = (1000.0 + rng.normal(size=(20_000, 3))).astype(np.float32)
    sums, sumsq = feature_sums(values)
    exact = values.astype(np.float64)
    assert sums.dtype == np.float64 and sumsq.dtype == np.float64
    np.testing.assert_allclose(sums, exact.sum(axis=0), rtol=1e-13)
    np.testing.assert_allclose(sumsq, (exact**2).sum(axis=0), rtol=1e-13)


def test_shards_encode_features_plain_and_the_label_as_a_dictionary() -> None:
    frame = take_rows(generate_mnist1d_partition(600, 1, 0.1), "train", 0, None).reset_index(drop=True)
    data = bytes(parquet_bytes(frame))
    # the same bytes as pandas' writer with the same options (what the benchmark's baseline uses)
    assert data == frame.to_parquet(index=False, **PARQUET_WRITE_OPTIONS)
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    encodings = {
        meta.column(i).path_in_schema: set(meta.column(i).encodings) for i in range(meta.num_columns)
    }
    dictionary = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    assert encodings.pop("label") & dictionary
    assert encodings and not [c for c, e in encodings.items() if e & dictionary]
    pd.testing.assert_frame_equal(pd.read_parquet(io.BytesIO(data)), frame)


def test_generated_partitions_group_rows_by_split_and_are_cut_as_views() -> None:
    frame = generate_mnist1d_partition(1000, 3, 0.1)
    codes = frame[SPLIT_COLUMN].map({name: i for i, name in enumerate(SPLITS)}).to_numpy()
    assert (np.diff(codes) >= 0).all() and set(codes) == {0, 1, 2}
    piece = take_rows(frame, "validation", 0, None)
    assert np.shares_memory(piece["x000"].to_numpy(), frame["x000"].to_numpy())  # no copy
    # rows not grouped (a restratified table partition): the same rows, in order, as a copy
    shuffled = frame.iloc[np.random.default_rng(0).permutation(len(frame))]
    expected = shuffled[shuffled[SPLIT_COLUMN] == "validation"].iloc[5:20]
    got = take_rows(shuffled, "validation", 5, 20)
    pd.testing.assert_frame_equal(got, expected.drop(columns=[SPLIT_COLUMN, "_u"]))
    assert take_rows(frame.iloc[:0], "test", 0, None).empty


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
    assert manifest["ordered_features"] is True  # one signal's steps: the student's mixups need it
    for entry in manifest["splits"]["train"]:
        url = storage.join(result.manifest_uri.rsplit("/", 1)[0], entry["name"])
        assert storage.sha256_url(url) == entry["sha256"]


def test_validation_and_test_shards_are_no_larger_than_a_training_shard() -> None:
    assert split_shard_counts({"train": 800, "validation": 100, "test": 100}, 4) == {
        "train": 4,
        "validation": 1,
        "test": 1,
    }
    assert split_shard_counts({"train": 800, "validation": 450, "test": 201}, 4) == {
        "train": 4,
        "validation": 3,
        "test": 2,
    }
    assert split_shard_counts({"train": 800, "validation": 0}, 4)["validation"] == 1


def test_more_training_shards_are_written_when_n_shards_would_exceed_the_largest_shard() -> None:
    mb = 2**20
    assert training_shards(1000, 168, 4, 256.0) == 4  # 0.16 MB of rows: n_shards stands
    assert training_shards(10 * mb, 168, 4, 256.0) == 7  # 1680 MB in shards of <= 256 MB
    assert training_shards(10, 2 * mb, 1, 1.0) == 10  # a row over the limit: one per shard at most


def test_max_shard_mb_bounds_every_shard_written(tmp_path: Path, dask_client: object) -> None:
    cfg = DataConfig(num_samples=2000, n_shards=2, max_shard_mb=0.05)  # 52 kB: about 310 rows
    result = shard_dataset(cfg, str(tmp_path), dask_client)
    manifest = load_manifest(result.manifest_uri)
    row_bytes = 4 * len(manifest["feature_columns"]) + 8
    shards = [e for split in SPLITS for e in manifest["splits"][split]]
    assert len(manifest["splits"]["train"]) > 2
    assert all(e["rows"] * row_bytes <= 0.05 * 2**20 for e in shards)
    default = shard_dataset(DataConfig(num_samples=2000, n_shards=2), str(tmp_path), dask_client)
    assert default.manifest_uri != result.manifest_uri  # the setting is part of the address


def test_a_large_validation_split_is_written_in_several_shards(tmp_path: Path, dask_client: object) -> None:
    cfg = DataConfig(num_samples=1000, n_shards=8, val_fraction=0.3)
    result = shard_dataset(cfg, str(tmp_path), dask_client)
    manifest = load_manifest(result.manifest_uri)
    largest_train = max(e["rows"] for e in manifest["splits"]["train"])
    validation = manifest["splits"]["validation"]
    assert len(validation) > 1 and max(e["rows"] for e in validation) <= largest_train
    x, y = load_split(result.manifest_uri, "validation")
    assert len(x) == len(y) == sum(e["rows"] for e in validation)


def test_rerun_reuses_the_content_addressed_output(tmp_path: Path, dask_client: object) -> None:
    cfg = DataConfig(num_samples=400, n_shards=2)
    first = shard_dataset(cfg, str(tmp_path), dask_client)
    second = shard_dataset(cfg, str(tmp_path), dask_client)
    assert second.reused and not first.reused
    assert second.manifest_uri == first.manifest_uri and second.manifest_hash == first.manifest_hash
    other = shard_dataset(DataConfig(num_samples=400, n_shards=3), str(tmp_path), dask_client)
    assert other.manifest_uri != first.manifest_uri


def test_a_failed_shard_write_leaves_no_manifest_and_nothing_half_written(
    tmp_path: Path, dask_client: object
) -> None:
    cfg = DataConfig(num_samples=400, n_shards=2)
    first = shard_dataset(cfg, str(tmp_path), dask_client)
    folder = Path(first.manifest_uri).parent
    manifest = load_manifest(first.manifest_uri)
    assert [e["name"] for e in manifest["splits"]["test"]] == ["test-00000.parquet"]
    shutil.rmtree(folder)
    folder.mkdir()
    # Where the test shard goes, a folder that is not empty: the written file cannot be renamed
    # over it, so that write fails; the training and validation shards (gathered first) are written.
    (folder / "test-00000.parquet").mkdir()
    (folder / "test-00000.parquet" / "in-the-way").touch()
    with pytest.raises(OSError, match="test-00000.parquet"):
        shard_dataset(cfg, str(tmp_path), dask_client)
    assert not folder.exists()  # no manifest, and the shards written before the failure are gone


def test_corrupt_or_missing_shard_is_named(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(DataConfig(num_samples=400, n_shards=2), str(tmp_path), dask_client)
    folder = Path(result.manifest_uri).parent
    shard = folder / "train-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for client in (None, dask_client):  # here, and on the workers
        with pytest.raises(ShardIntegrityError, match="train-00001.parquet is corrupt"):
            verify_manifest(result.manifest_uri, client=client)
    shard.unlink()
    with pytest.raises(ShardIntegrityError, match="train-00001.parquet is missing"):
        verify_manifest(result.manifest_uri, client=dask_client)
    with pytest.raises(ShardIntegrityError, match="train-00001.parquet is missing"):
        load_split(result.manifest_uri, "train")


def test_a_shard_of_another_schema_is_named(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(DataConfig(num_samples=400, n_shards=2), str(tmp_path), dask_client)
    assert verify_manifest(result.manifest_uri, client=dask_client)["manifest_hash"] == result.manifest_hash
    manifest = storage.read_json(result.manifest_uri)
    entry = manifest["splits"]["test"][0]
    shard = Path(result.manifest_uri).parent / entry["name"]
    frame = pd.read_parquet(shard)
    frame["x000"] = frame["x000"].astype("float64")  # same columns, another type
    frame.to_parquet(shard)
    entry["sha256"] = storage.sha256_url(str(shard))  # a consistent manifest: only the schema differs
    manifest["manifest_hash"] = manifest_hash(manifest)
    storage.write_json_atomic(result.manifest_uri, manifest)
    with pytest.raises(ShardIntegrityError, match=f"{entry['name']} has schema .*'x000': 'float64'"):
        verify_manifest(result.manifest_uri, client=dask_client)


def test_edited_manifest_is_refused(tmp_path: Path, dask_client: object) -> None:
    result = shard_dataset(DataConfig(num_samples=400, n_shards=2), str(tmp_path), dask_client)
    manifest = storage.read_json(result.manifest_uri)
    manifest["splits"]["train"][0]["rows"] += 1
    storage.write_json_atomic(result.manifest_uri, manifest)
    with pytest.raises(ShardIntegrityError, match="modified"):
        load_manifest(result.manifest_uri)


TABLE_RULE = SplitRule(("train", "validation", "test"), ("test", "validation"), (0.2, 0.3))


def _imbalanced(n: int, seed: int) -> pd.DataFrame:
    """Rows of 3 classes in proportions 70/20/10 (small classes are where a plain hash split drifts)."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.normal(size=(n, 4)).astype(np.float32), columns=list("abcd"))
    frame["label"] = rng.choice(3, size=n, p=[0.7, 0.2, 0.1])
    return frame


def _split_in_memory(frame: pd.DataFrame, stratify: bool) -> np.ndarray:
    """The split names the stage assigns, computed in one process with the same pure helpers."""
    u = row_unit_interval(frame, salt="split-0")
    labels = frame["label"].to_numpy()
    if not stratify:
        return assign_splits(u, labels, TABLE_RULE, None)
    histograms = {
        int(c): np.bincount(np.minimum((u[labels == c] * 1024).astype(int), 1023), minlength=1024)
        for c in np.unique(labels)
    }
    positions = threshold_positions(histograms, TABLE_RULE)
    bins = np.minimum((u * 1024).astype(int), 1023)
    values = {
        (c, b): np.sort(u[(labels == c) & (bins == b)])
        for c, found in positions.items()
        for b, _ in found
        if b >= 0
    }
    return assign_splits(u, labels, TABLE_RULE, stratified_thresholds(positions, values))


def test_stratified_split_gives_every_class_the_fractions_to_one_row() -> None:
    frame = _imbalanced(3000, seed=3)
    labels = frame["label"].to_numpy()
    plain, strat = _split_in_memory(frame, False), _split_in_memory(frame, True)
    worst_plain = 0.0
    for c in range(3):
        n_c = int((labels == c).sum())
        for split, fraction in (("test", 0.2), ("validation", 0.1)):
            expected = fraction * n_c
            assert abs(int((strat[labels == c] == split).sum()) - expected) <= 1.0
            worst_plain = max(worst_plain, abs(int((plain[labels == c] == split).sum()) - expected))
    assert worst_plain > 1.0  # the plain hash split does drift: stratifying changes something


def test_stratified_split_moves_few_rows_when_rows_are_appended() -> None:
    frame = _imbalanced(3000, seed=4)
    bigger = pd.concat([frame, _imbalanced(300, seed=5)], ignore_index=True)
    plain_moved = _split_in_memory(frame, False) != _split_in_memory(bigger, False)[:3000]
    strat_moved = _split_in_memory(frame, True) != _split_in_memory(bigger, True)[:3000]
    assert not plain_moved.any()  # unstratified: no row ever changes split
    # stratified: only rows whose hash lies between a class's old and new threshold move
    assert strat_moved.mean() < 0.03


def test_stratified_table_shards_have_exact_class_fractions(tmp_path: Path, dask_client: object) -> None:
    frame = _imbalanced(2000, seed=6)
    src = tmp_path / "table.parquet"
    frame.to_parquet(src)
    cfg = DataConfig(dataset=str(src), n_shards=2, stratify=True)
    result = shard_dataset(cfg, str(tmp_path / "out"), dask_client)
    manifest = load_manifest(result.manifest_uri)
    totals = frame["label"].value_counts().to_dict()
    for split, fraction in (("test", 0.2), ("validation", 0.1)):
        (entry,) = manifest["splits"][split]
        for c, n_c in totals.items():
            assert abs(entry["class_counts"][str(c)] - fraction * n_c) <= 1.0, (split, c)
    # same assignment as the in-memory helpers (the Dask path gathers only per-class histograms)
    expected = _split_in_memory(frame, True)
    _, y_test = load_split(result.manifest_uri, "test")
    assert np.array_equal(np.sort(y_test), np.sort(frame["label"].to_numpy()[expected == "test"]))
    plain = shard_dataset(cfg.model_copy(update={"stratify": False}), str(tmp_path / "out"), dask_client)
    assert plain.manifest_uri != result.manifest_uri  # stratify is part of the content address


def test_stratified_mnist1d_holds_out_validation_per_class(tmp_path: Path, dask_client: object) -> None:
    cfg = DataConfig(num_samples=1000, partition_rows=500, n_shards=2, stratify=True)
    manifest = load_manifest(shard_dataset(cfg, str(tmp_path), dask_client).manifest_uri)
    train = {
        c: sum(e["class_counts"].get(c, 0) for e in manifest["splits"]["train"]) for c in map(str, range(10))
    }
    (val,) = manifest["splits"]["validation"]
    for c in map(str, range(10)):
        assert abs(val["class_counts"][c] - 0.1 * (train[c] + val["class_counts"][c])) <= 1.0
    rows = {s: sum(e["rows"] for e in manifest["splits"][s]) for s in manifest["splits"]}
    assert sum(rows.values()) == 1000
    plain = load_manifest(
        shard_dataset(cfg.model_copy(update={"stratify": False}), str(tmp_path), dask_client).manifest_uri
    )
    # the package's own test rows are untouched: only validation is held out per class
    assert plain["splits"]["test"][0]["sha256"] == manifest["splits"]["test"][0]["sha256"]


def _transfers(dask_worker: object) -> list[dict]:
    """Every incoming transfer a worker logged: {key: nbytes} per transfer."""
    return [dict(entry["keys"]) for entry in dask_worker.transfer_incoming_log]  # type: ignore[attr-defined]


def test_shard_writers_never_pull_whole_partitions(tmp_path: Path, dask_client: object) -> None:
    before = {w: len(log) for w, log in dask_client.run(_transfers).items()}  # type: ignore[attr-defined]
    cfg = DataConfig(num_samples=4000, partition_rows=1000, n_shards=3)
    manifest = load_manifest(shard_dataset(cfg, str(tmp_path), dask_client).manifest_uri)
    after = dask_client.run(_transfers)  # type: ignore[attr-defined]
    moved = {k: n for w, log in after.items() for entry in log[before.get(w, 0) :] for k, n in entry.items()}
    # each partition stays on the worker that generated it; only slices travel to the writers
    assert not [k for k in moved if str(k).startswith("generate_mnist1d_partition")]
    assert all(str(k).startswith("take_rows") for k in moved), sorted(moved)
    total = sum(e["rows"] for split in manifest["splits"].values() for e in split)
    assert total == 4000


def test_small_tasks_follow_a_partition_to_the_worker_that_computed_it(dask_client: object) -> None:
    from distributed import wait

    from mopflow.training.data import feature_columns
    from mopflow.training.data.placement import per_partition_as_done

    workers = sorted(dask_client.nthreads())  # type: ignore[attr-defined]

    def elsewhere(seed: int) -> object:
        def submit(worker: str | None) -> object:
            # as when Dask steals a queued partition: it runs on another worker than it was sent to
            other = next(w for w in workers if w != worker)
            return dask_client.submit(  # type: ignore[attr-defined]
                generate_mnist1d_partition, 300, seed, 0.1, pure=False, workers=[other]
            )

        return submit

    before = {w: len(log) for w, log in dask_client.run(_transfers).items()}  # type: ignore[attr-defined]
    held: list[object] = []
    parts, stats, pieces = per_partition_as_done(
        dask_client, [elsewhere(s) for s in range(4)], held, feature_columns(40), list(SPLITS)
    )
    wait(held)
    holders = dask_client.who_has(held)  # type: ignore[attr-defined]
    for i, part in enumerate(parts):
        where = set(holders[part.key])
        assert set(holders[stats[i].key]) == where
        assert all(set(holders[pieces[split][i].key]) == where for split in SPLITS)
    after = dask_client.run(_transfers)  # type: ignore[attr-defined]
    moved = [k for w, log in after.items() for entry in log[before.get(w, 0) :] for k in entry]
    assert not moved, moved
    counts = [s["split_rows"] for s in dask_client.gather(stats)]  # type: ignore[attr-defined]
    assert all(sum(c.values()) == 300 for c in counts)
