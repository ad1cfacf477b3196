"""The sequential baseline (``benchmarks/baselines/sequential.py``) against the strategies the
search trains with: the same configuration and seed learn alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from baselines.sequential import SequentialExecutor

from mopflow.training.data import load_manifest
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.mop import MopExecutor
from mopflow.training.executors.task import TaskExecutor
from mopflow.training.trainable.unit import ModelSpec

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}
CNN_DECAY = CNN | {"weight_decay": 1e-4}


def train_shards(manifest: str) -> list[str]:
    return [e["name"] for e in load_manifest(manifest)["splits"]["train"]]


def test_mop_matches_sequential_training(small_manifest: str, dask_client: object) -> None:
    data = DataRef.open(small_manifest)
    spec = ModelSpec("m", CNN | {"width": 16, "depth": 3, "lr": 0.02}, seed=0)
    shards = train_shards(small_manifest)
    mop = MopExecutor(dask_client, data, shards, seed=0).run([spec], epochs=6)["m"].history[-1].val_acc
    sequential = SequentialExecutor(data, shards).run([spec], epochs=6)["m"].history[-1].val_acc
    assert mop > 0.3 and sequential > 0.3  # both learned (chance is 0.1)
    assert abs(mop - sequential) <= 0.1


@pytest.mark.slow
def test_sequential_task_and_mop_on_one_partition_train_identical_weights(
    small_manifest: str, dask_client: Any
) -> None:
    """The same configuration and seed trained in this process (the sequential baseline), by the
    ``task`` executor (an epoch per Dask task) and by MOP over a single partition (units on the
    Dask workers): one unit, one schedule, one data order, so bit-identical weights."""
    from safetensors.torch import load

    epochs = 2
    data = DataRef.open(small_manifest)
    shards = train_shards(small_manifest)
    spec = ModelSpec("trial-0000", CNN_DECAY, seed=7)
    runs = {
        "sequential": SequentialExecutor(data, shards).run([spec], epochs)["trial-0000"],
        "task": TaskExecutor(dask_client, data, shards).run([spec], epochs)["trial-0000"],
        "mop": MopExecutor(dask_client, data, shards, partitions=1, slots=1).run([spec], epochs)[
            "trial-0000"
        ],
    }
    expected = load(runs["sequential"].state or b"")
    for name, outcome in runs.items():
        got = load(outcome.state or b"")
        assert sorted(got) == sorted(expected), name
        for key in expected:
            assert torch.equal(got[key], expected[key]), (name, key)
        assert [r.val_acc for r in outcome.history] == [r.val_acc for r in runs["sequential"].history]
    # another seed: another initialisation and batch order, so other weights
    other = TaskExecutor(dask_client, data, shards).run([ModelSpec("trial-0001", CNN_DECAY, seed=8)], epochs)
    got = load(other["trial-0001"].state or b"")
    assert not all(torch.equal(got[key], expected[key]) for key in expected if not key.startswith("opt."))
