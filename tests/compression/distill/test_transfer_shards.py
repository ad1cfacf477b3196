"""The transfer set made on the workers shard by shard: its rows, labels and soft targets, its
reuse on a rerun, and a student trained from it in memory or streamed from its blocks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mopflow.compression.config import DistillConfig
from mopflow.compression.distill.distill import fit_student, plan_student
from mopflow.compression.distill.transfer_shards import (
    build_transfer_set,
    read_block,
    student_rows,
    train_split_rows,
)
from mopflow.training.data import load_manifest, load_split, split_shards
from mopflow.training.data.streaming import StreamedRows
from mopflow.training.models.bundle import load_bundle
from mopflow.training.models.families import DataSpec

CFG = DistillConfig(epochs=2, munge_multiplier=2, temperature=2.0).resolved("table")


def test_the_transfer_set_holds_every_shard_with_the_teachers_soft_targets(
    tmp_path: Path, dask_client: object, small_manifest: str, teacher_uri: str
) -> None:
    transfer = build_transfer_set(dask_client, small_manifest, teacher_uri, False, CFG, 7, str(tmp_path))
    train_rows = sum(e["rows"] for e in load_manifest(small_manifest)["splits"]["train"])
    assert transfer.real_rows == train_rows
    assert transfer.synthetic_rows == 2 * train_rows
    assert len(transfer.blocks) == len(load_manifest(small_manifest)["splits"]["train"])  # one per shard here
    x, y, soft = read_block(transfer.blocks[0])
    teacher = load_bundle(teacher_uri).module
    with torch.no_grad():
        expected = teacher(torch.from_numpy(x), temperature=2.0).numpy()
    assert np.allclose(soft, expected, atol=1e-5)
    real = [x_ for x_ in load_split(small_manifest, "train")[0]]
    assert any(np.array_equal(x[0], r) for r in real)  # real rows come first, unchanged
    assert not any(np.array_equal(x[-1], r) for r in real)  # synthetic rows after them
    written = [os.stat(b.shard).st_mtime_ns for b in transfer.blocks]
    again = build_transfer_set(dask_client, small_manifest, teacher_uri, False, CFG, 7, str(tmp_path))
    assert again == transfer  # a rerun reuses the blocks
    assert [os.stat(b.shard).st_mtime_ns for b in transfer.blocks] == written


def test_a_student_learns_from_the_blocks_in_memory_or_streamed(
    tmp_path: Path,
    dask_client: object,
    small_manifest: str,
    teacher_uri: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest = load_manifest(small_manifest)
    transfer = build_transfer_set(dask_client, small_manifest, teacher_uri, False, CFG, 7, str(tmp_path))
    plan = plan_student(CFG, load_bundle(teacher_uri).num_params(), DataSpec.from_manifest(manifest))
    norm = manifest["normalization"]
    common = {"mean": norm["mean"], "std": norm["std"], "seed": 0}
    held = student_rows(transfer)
    assert isinstance(held, list) and [len(t) for t in held] == [transfer.rows] * 3
    monkeypatch.setenv("MOPFLOW_DISTILL_MEMORY_MB", "0.01")  # nothing fits: the blocks stream
    streamed = student_rows(transfer)
    assert isinstance(streamed, StreamedRows) and streamed.n_rows == transfer.rows
    assert isinstance(train_split_rows(small_manifest), StreamedRows)
    _, history = fit_student(
        plan, CFG, streamed, lambda: split_shards(small_manifest, "validation"), soft=True, epochs=4, **common
    )
    assert len(history) == 4
    assert history[-1]["train_loss"] < history[0]["train_loss"]  # it learns from the stream
    assert history[-1]["val_acc"] > 0.15  # chance is 0.1
    monkeypatch.delenv("MOPFLOW_DISTILL_MEMORY_MB")
    assert isinstance(train_split_rows(small_manifest), list)


def test_a_damaged_block_fails_naming_it(tmp_path: Path) -> None:
    from mopflow.training.data import ShardIntegrityError
    from mopflow.training.data.streaming import Block

    path = tmp_path / "block-000.npz"
    path.write_bytes(b"not an npz")
    with pytest.raises(ShardIntegrityError, match="transfer block .*block-000.npz cannot be read"):
        read_block(Block(str(path), 0, 3))
    with pytest.raises(ShardIntegrityError, match="block-404.npz cannot be read"):
        read_block(Block(str(tmp_path / "block-404.npz"), 0, 3))
