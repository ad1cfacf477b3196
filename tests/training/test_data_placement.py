"""Placement rules of the shard stage: partitions handed out as workers free up, shard writers
balanced by rows (pure functions; the Dask path is covered by test_data.py)."""

from __future__ import annotations

import pytest

from training.data import balance_writers, feed_cap


def test_the_last_partitions_go_only_to_free_threads() -> None:
    assert feed_cap(18, 2) == 3  # plenty left: next tasks wait behind the running one
    assert feed_cap(2, 2) == 1 and feed_cap(1, 2) == 1  # the tail: never queued behind a busy thread


def test_writers_are_balanced_by_rows_longest_first() -> None:
    # the MNIST-1D benchmark's shape: one 200k test shard, 8 train shards of 90k, 80k validation
    rows = [90] * 8 + [80, 200]
    local = [{"a": r} for r in rows]  # every shard's rows on worker a: locality alone would pile them there
    writers = balance_writers(rows, local, ["a", "b"])
    load = {w: sum(r for r, x in zip(rows, writers, strict=True) if x == w) for w in "ab"}
    assert sorted(load.values()) == [470, 530]  # the best split of these sizes
    # ties on load go to the worker that already holds the shard's rows
    assert balance_writers([10, 10], [{"b": 10}, {"a": 10}], ["a", "b"]) == ["b", "a"]


def test_one_worker_writes_everything_and_bad_input_is_refused() -> None:
    assert balance_writers([5, 3], [{}, {}], ["only"]) == ["only", "only"]
    with pytest.raises(ValueError, match="at least one worker"):
        balance_writers([1], [{}], [])
    with pytest.raises(ValueError, match="2 shards but 1"):
        balance_writers([1, 2], [{}], ["a"])
