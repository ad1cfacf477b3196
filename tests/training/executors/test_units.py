"""A chain of epochs on one worker (``task`` between two decisions of the pruner) against the same
epochs one per task, undisturbed and stopped by a notice inside the chain."""

from __future__ import annotations

from typing import Any

import pytest

from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.units import init_state, train_epochs_and_validate, train_pass_and_validate
from mopflow.training.trainable.state import read_meta
from mopflow.training.volatile import preempt
from mopflow.training.volatile.preempt import UnitPreempted
from tests.training.volatile.test_preemption import CNN_PARAMS, _NoticeAfter, _same_weights


def test_a_chain_of_epochs_ends_as_the_same_epochs_one_per_task_even_when_a_notice_stops_it(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expected: three epochs in one chain give the states, validation accuracies and losses of
    three epochs one per task; every epoch but the last is told as it ends; a notice inside the
    second epoch hands back the first epoch's record and the state at its batch, and the chain
    continued from there ends exactly as the undisturbed one."""
    data = DataRef.open(small_manifest)
    shards = sorted(e["name"] for e in load_manifest(small_manifest)["splits"]["train"])
    spec = ModelSpec("trial-0000", CNN_PARAMS, seed=3)
    epochs = 3

    state: Any = None
    apart = []
    for epoch in range(epochs):
        state, record, val_acc = train_pass_and_validate(
            spec, state, data, shards, epoch, epochs, validate=True
        )
        apart.append((val_acc, record["train_loss"], record["lr_end"]))
        # the task's span holds its parts: before the pass, the fit (its loop inside), the packing
        assert record["fit_s"] >= record["loop_s"] > 0 and record["setup_s"] >= 0 < record["pack_s"]
        assert record["setup_s"] + record["fit_s"] + record["pack_s"] <= record["end"] - record["start"]

    told: list[tuple[dict[str, Any], bytes]] = []
    chained_state, records = train_epochs_and_validate(
        spec, None, data, shards, 0, epochs, epochs, lambda record, pack: told.append((record, pack()))
    )
    assert [(r["val_acc"], r["train_loss"], r["lr_end"]) for r in records] == apart
    assert [record for record, _ in told] == records[:2]
    assert [read_meta(packed)["epoch"] for _, packed in told] == [0, 1]  # the state there, to stage
    assert _same_weights(chained_state, state) and read_meta(chained_state)["epoch"] == epochs - 1
    # the seeded first state is the same built on the worker (None) or handed over from elsewhere
    handed, _ = train_epochs_and_validate(spec, init_state(spec, data), data, shards, 0, epochs, epochs)
    assert _same_weights(handed, chained_state)
    assert all(r["loop_s"] > 0 and r["val_s"] > 0 for r in records)
    # one task: each epoch's span starts where the last ended (staging its state counts inside)
    assert all(b["start"] == a["end"] for a, b in zip(records, records[1:], strict=False))
    assert "pack_s" in records[-1] and records[-1]["end"] >= records[-1]["start"] + records[-1]["pack_s"]

    steps = -(-sum(e["rows"] for e in load_manifest(small_manifest)["splits"]["train"]) // 32)
    monkeypatch.setattr(preempt, "NOTICE", _NoticeAfter(steps + 5))  # the 5th batch of the 2nd epoch
    with pytest.raises(UnitPreempted) as stopped:
        train_epochs_and_validate(spec, None, data, shards, 0, epochs, epochs)
    monkeypatch.undo()
    assert [r["epoch"] for r in stopped.value.record["epochs"]] == [0]
    assert stopped.value.record["epochs"][0]["val_acc"] == apart[0][0]
    assert stopped.value.state is not None and read_meta(stopped.value.state)["epoch"] == 1
    resumed_state, rest = train_epochs_and_validate(spec, stopped.value.state, data, shards, 1, 2, epochs)
    assert [(r["val_acc"], r["train_loss"], r["lr_end"]) for r in rest] == apart[1:]
    assert _same_weights(resumed_state, state)


def test_a_worker_reads_the_manifest_once_not_every_pass(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expected: passes after the first build their model from the manifest the first read; a
    worker asked to forget its data (``clear_partitions``) reads it again."""
    from mopflow.training.data import reading
    from mopflow.training.data.manifest import ShardIntegrityError
    from mopflow.training.executors import units

    data = DataRef.open(small_manifest)
    shards = sorted(e["name"] for e in load_manifest(small_manifest)["splits"]["train"])
    spec = ModelSpec("trial-0000", CNN_PARAMS, seed=3)
    units.clear_partitions()
    state, _, _ = train_pass_and_validate(spec, None, data, shards, 0, 2)
    reads: list[str] = []
    monkeypatch.setattr(reading.storage, "read_json", lambda uri, *a: reads.append(uri) or {})
    train_pass_and_validate(spec, state, data, shards, 1, 2)
    assert reads == []
    units.clear_partitions()
    with pytest.raises(ShardIntegrityError, match="not a mopflow manifest"):
        train_pass_and_validate(spec, state, data, shards, 1, 2)
    assert reads == [small_manifest]


def test_lightning_is_quieted_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expected: its loggers at WARNING, and a second call sets no level (setting one clears
    every logger's cache, a cost once per pass on a worker)."""
    import logging

    from mopflow.training.trainable.lit import quiet_lightning

    quiet_lightning()
    assert logging.getLogger("pytorch_lightning").level == logging.WARNING
    levels_set: list[str] = []
    monkeypatch.setattr(logging.Logger, "setLevel", lambda self, level: levels_set.append(self.name))
    quiet_lightning()
    assert levels_set == []
