"""Placement rules of the shard stage: partitions handed out as workers free up, shard writers
balanced by rows (pure functions; the Dask path is covered by test_data.py)."""

from __future__ import annotations

import pytest

from mopflow.training.data import balance_writers, contiguous_runs, feed_cap, next_partition


def test_the_last_partitions_go_only_to_free_threads() -> None:
    assert feed_cap(18, 2) == 3  # plenty left: next tasks wait behind the running one
    assert feed_cap(2, 2) == 1 and feed_cap(1, 2) == 1  # the tail: never queued behind a busy thread


def test_writers_are_balanced_by_rows_longest_first() -> None:
    # the MNIST-1D benchmark's shape: one 200k test shard, 8 train shards of 90k, 80k validation
    rows = [90] * 8 + [80, 200]
    local = [{"a": r} for r in rows]  # every shard's rows on worker a: locality alone would pile them there
    writers = balance_writers(rows, local, ["a", "b"])
    load = {w: sum(r for r, x in zip(rows, writers, strict=True) if x == w) for w in "ab"}
    assert load == {"a": 470, "b": 530}  # the best split of these sizes
    # ties on load go to the worker that already holds the shard's rows
    assert balance_writers([10, 10], [{"b": 10}, {"a": 10}], ["a", "b"]) == ["b", "a"]


def test_writers_take_the_shards_whose_rows_they_hold_when_that_stays_balanced() -> None:
    # contiguous partition runs: train shards 0-3 on a, 4-7 on b; validation and test half and half
    rows = [90] * 8 + [80, 200]
    local = [{"a": 90}] * 4 + [{"b": 90}] * 4 + [{"a": 40, "b": 40}, {"a": 100, "b": 100}]
    writers = balance_writers(rows, local, ["a", "b"])
    moved = [i for i, w in enumerate(writers[:8]) if w not in local[i]]
    assert len(moved) == 1  # one train shard moves, for balance; a load-only placement moves five
    load = {w: sum(r for r, x in zip(rows, writers, strict=True) if x == w) for w in "ab"}
    assert load == {"a": 470, "b": 530}  # the best split of these sizes


def test_one_worker_writes_everything_and_bad_input_is_refused() -> None:
    assert balance_writers([5, 3], [{}, {}], ["only"]) == ["only", "only"]
    with pytest.raises(ValueError, match="at least one worker"):
        balance_writers([1], [{}], [])
    with pytest.raises(ValueError, match="2 shards but 1"):
        balance_writers([1, 2], [{}], ["a"])


def test_each_worker_works_through_a_contiguous_run_then_takes_the_end_of_another() -> None:
    runs = contiguous_runs(list(range(6)), {"a": 1, "b": 1})
    assert {w: list(r) for w, r in runs.items()} == {"a": [0, 1, 2], "b": [3, 4, 5]}
    assert [next_partition(runs, "a") for _ in range(3)] == [0, 1, 2]
    # a's run is done while b is still on its first: a takes b's last partition, b keeps its order
    assert next_partition(runs, "a") == 5
    assert [next_partition(runs, "b") for _ in range(3)] == [3, 4, None]
    assert next_partition(runs, "a") is None
    # runs are sized by threads
    weighted = contiguous_runs(list(range(9)), {"a": 2, "b": 1})
    assert {w: list(r) for w, r in weighted.items()} == {"a": [0, 1, 2, 3, 4, 5], "b": [6, 7, 8]}
    with pytest.raises(ValueError, match="at least one worker thread"):
        contiguous_runs([0], {})
