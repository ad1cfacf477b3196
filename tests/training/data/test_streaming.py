"""Training rows streamed from the shards: a seeded order in bounded memory, exact on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mopflow.training.data import ShardIntegrityError, load_manifest
from mopflow.training.data.ref import DataRef
from mopflow.training.data.streaming import (
    Block,
    StreamedRows,
    rank_batches,
    shuffle_buffer_rows,
    stream_rows,
    train_memory_bytes,
)
from mopflow.training.executors.units import clear_partitions, training_rows
from mopflow.training.trainable.schedule import steps_per_epoch
from mopflow.training.trainable.unit import ModelSpec, PassInterrupted, TrainableUnit

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 1e-4, "batch_size": 32}


def _memory_rows(n_blocks: int = 12, rows: int = 50) -> tuple[list[Block], Any, np.ndarray]:
    """Blocks over an in-memory table whose features are the row numbers (to follow the rows)."""
    table = np.arange(n_blocks * rows, dtype=np.float32)[:, None]
    blocks = [Block(f"s{i // 4}", i % 4, rows) for i in range(n_blocks)]
    reads: list[Block] = []

    def read(block: Block) -> tuple[np.ndarray, np.ndarray]:
        reads.append(block)
        start = blocks.index(block) * rows
        x = table[start : start + rows]
        return x, x[:, 0].astype(np.int64)

    read.reads = reads  # type: ignore[attr-defined]
    return blocks, read, table


def _rows_of(chunks: Any) -> list[int]:
    return [int(v) for x, _ in chunks for v in x[:, 0]]


def test_a_pass_streams_every_row_once_in_an_order_of_seed_epoch_and_pass() -> None:
    blocks, read, table = _memory_rows()
    first = _rows_of(stream_rows(blocks, read, seed=1, epoch=0, pass_index=0, buffer_rows=64))
    assert sorted(first) == list(range(len(table)))
    assert first == _rows_of(stream_rows(blocks, read, 1, 0, 0, 64))
    assert first != _rows_of(stream_rows(blocks, read, 1, 1, 0, 64))
    assert first != _rows_of(stream_rows(blocks, read, 2, 0, 0, 64))
    assert first != sorted(first)  # shuffled, not the shards' order


def test_the_buffer_bounds_what_a_pass_holds() -> None:
    blocks, read, _ = _memory_rows(n_blocks=20, rows=50)
    chunks = list(stream_rows(blocks, read, 0, 0, 0, buffer_rows=64))
    # each step holds the buffer and one block, and lets out as many rows as the block brought
    assert all(len(x) <= 50 for x, _ in chunks[:-1]) and len(chunks[-1][0]) == 64


def test_batches_resume_at_a_batch_and_ranks_share_the_stream() -> None:
    blocks, read, table = _memory_rows()
    rows = StreamedRows(blocks, read, buffer_rows=64)
    whole = [b[0][:, 0].tolist() for b in rows.batches(3, 1, 0, batch_size=32)]
    assert len(whole) == len(rows.batches(3, 1, 0, 32)) == -(-len(table) // 32)
    resumed = [b[0][:, 0].tolist() for b in rows.batches(3, 1, 0, 32, skip=5)]
    assert resumed == whole[5:]
    shares = [
        [v for b in rows.batches(3, 1, 0, 32, shard=(r, 3)) for v in b[0][:, 0].tolist()] for r in range(3)
    ]
    assert [len(s) for s in shares] == [len(table) // 3] * 3  # every rank takes as many steps
    assert not set(shares[0]) & set(shares[1]) and not set(shares[1]) & set(shares[2])


def test_a_rank_takes_every_world_th_row_cut_to_its_share_in_batches() -> None:
    rows = np.arange(11, dtype=np.float32)[:, None]
    chunks = [(rows[:4], rows[:4, 0]), (rows[4:], rows[4:, 0])]  # batches span the chunks
    batches = list(rank_batches(chunks, batch_size=2, rank_rows=5, shard=(1, 2)))
    assert [b[0][:, 0].tolist() for b in batches] == [[1, 3], [5, 7], [9]]
    assert [len(x) for x, _ in rank_batches(chunks, batch_size=4, rank_rows=11)] == [4, 4, 3]


def test_budgets_come_from_the_environment_with_clear_errors() -> None:
    assert (
        train_memory_bytes({}) == 2048 * 2**20
        and train_memory_bytes({"MOPFLOW_TRAIN_MEMORY_MB": "1.5"}) == 1.5 * 2**20
    )
    with pytest.raises(ValueError, match="MOPFLOW_TRAIN_MEMORY_MB='lots'"):
        train_memory_bytes({"MOPFLOW_TRAIN_MEMORY_MB": "lots"})
    with pytest.raises(ValueError, match="positive"):
        train_memory_bytes({"MOPFLOW_TRAIN_MEMORY_MB": "0"})
    assert shuffle_buffer_rows({"MOPFLOW_SHUFFLE_BUFFER_ROWS": "100"}) == 100


def _streamed_unit(manifest_uri: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, TrainableUnit]:
    monkeypatch.setenv("MOPFLOW_TRAIN_MEMORY_MB", "0.01")  # the test data is over it: streamed
    monkeypatch.setenv("MOPFLOW_SHUFFLE_BUFFER_ROWS", "100")
    clear_partitions()
    manifest = load_manifest(manifest_uri)
    rows = training_rows(DataRef.open(manifest_uri), [e["name"] for e in manifest["splits"]["train"]])
    assert isinstance(rows, StreamedRows)
    unit = TrainableUnit.build(ModelSpec("m", CNN, 0), manifest, steps_per_epoch([len(rows)], 32))
    return rows, unit


def test_a_streamed_pass_stopped_at_a_batch_goes_on_exactly(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, whole = _streamed_unit(small_manifest, monkeypatch)
    expected = whole.train_pass(rows, 0, part="all")
    assert expected.rows == len(rows) and expected.steps == -(-len(rows) // 32)
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] == 4

    _, stopped = _streamed_unit(small_manifest, monkeypatch)
    with pytest.raises(PassInterrupted) as raised:
        stopped.train_pass(rows, 0, part="all", stop=stop)
    _, resumed = _streamed_unit(small_manifest, monkeypatch)
    resumed.import_state(raised.value.state)
    record = resumed.train_pass(rows, 0, part="all")
    assert record.resumed_at_batch == 4 and record.train_loss == expected.train_loss
    for p, q in zip(whole.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q)
    clear_partitions()


def test_a_shard_deleted_mid_stream_is_named(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(Path(small_manifest).parent, copy)
    manifest_uri = str(copy / "manifest.json")
    rows, unit = _streamed_unit(manifest_uri, monkeypatch)
    victim = rows.blocks[-1].shard
    (copy / victim).unlink()
    with pytest.raises(ShardIntegrityError, match=f"shard {victim} failed mid-stream"):
        unit.train_pass(rows, 0)
    clear_partitions()
