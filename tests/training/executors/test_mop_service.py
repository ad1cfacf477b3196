"""MOP's resident trainer: a unit is a direct call to the worker that holds its partition."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from mopflow.training.data import load_manifest
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.mop_service import UnitCalls, unit_label, units_running
from mopflow.training.executors.units import ChainStopped
from mopflow.training.trainable.state import read_meta
from mopflow.training.trainable.unit import ModelSpec
from mopflow.training.volatile import preempt
from mopflow.training.volatile.preempt import UnitPreempted, clear_notice, raise_notice

MLP_PARAMS = {"family": "mlp", "width": 16, "depth": 1, "lr": 3e-3, "weight_decay": 1e-5, "batch_size": 32}


def _unit_args(manifest: str, validate: bool) -> tuple[Any, ...]:
    data = DataRef.open(manifest)
    shards = sorted(e["name"] for e in load_manifest(manifest)["splits"]["train"])
    spec = ModelSpec("trial-0007", MLP_PARAMS, seed=5)
    return (spec, None, data, shards[:1], 0, 2, 0, {"visited": ["p0"], "partition": "p0"}, validate, None)


def _workers(client: Any) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


def test_a_unit_runs_on_the_worker_it_is_sent_to_and_comes_back_whole(
    small_manifest: str, dask_client: Any
) -> None:
    """Expected: the call runs ``train_pass_and_validate`` in the named worker's process (its
    record names that process), and its state, record and validation accuracy come back; two
    workers given the same unit train the same weights."""
    args = _unit_args(small_manifest, validate=True)
    calls = UnitCalls(dask_client)
    first, second = _workers(dask_client)[:2]
    pids = dask_client.run(os.getpid)
    answers = {w: calls.call(w, args).result(timeout=120) for w in (first, second)}
    for worker, (state, record, val_acc) in answers.items():
        assert record["worker"].endswith(f":{pids[worker]}")  # that worker's process trained it
        assert record["model"] == "trial-0007" and record["partition"] == args[3][0]
        assert 0.0 <= val_acc <= 1.0
        assert read_meta(state)["partition"] == "p0"
    assert _tensors(answers[first][0]) == _tensors(answers[second][0])
    assert answers[first][1]["global_step_end"] > 0
    UnitCalls(dask_client)  # a second sweep on the cluster registers the service again: harmless
    assert _tensors(calls.call(first, args).result(timeout=120)[0]) == _tensors(answers[first][0])


def _tensors(state: bytes) -> dict[str, list[float]]:
    from safetensors.torch import load

    return {name: t.flatten().tolist() for name, t in load(state).items()}


def test_a_unit_stopped_by_a_notice_comes_back_as_its_own_exception(
    small_manifest: str, dask_client: Any
) -> None:
    """Expected: a worker under a notice hands the unit back untouched, and the caller gets the
    unit's ``UnitPreempted`` itself (not a wrapped error), as it got a task's."""
    args = _unit_args(small_manifest, validate=False)
    worker = _workers(dask_client)[0]
    dask_client.run(raise_notice, workers=[worker])
    try:
        with pytest.raises(UnitPreempted) as raised:
            UnitCalls(dask_client).call(worker, args).result(timeout=120)
    finally:
        dask_client.run(clear_notice, workers=[worker])
    assert raised.value.model_id == "trial-0007" and raised.value.state is None


def test_a_leaving_worker_waits_for_the_units_it_runs_outside_tasks() -> None:
    """Expected: a worker with no task running counts as busy while a unit of the resident
    trainer runs, and idle again once it ended (its notice's leave waits for it)."""
    worker = SimpleNamespace(state=SimpleNamespace(executing_count=0))
    assert not preempt._busy(worker)
    with preempt.unit_outside_tasks():
        assert preempt._busy(worker)
    assert not preempt._busy(worker)


def test_a_units_label_names_its_model_epoch_and_partition() -> None:
    spec = ModelSpec("trial-0003", MLP_PARAMS, seed=1)
    args = (spec, None, None, ["s0"], 4, 9, 1, {"partition": "p1"}, False, None)
    assert unit_label(args) == "mop-trial-0003-e4-p1"
    assert units_running() == []  # none runs in the test process


def test_a_unit_dropped_by_its_token_ends_without_training_and_the_others_are_untouched(
    small_manifest: str, dask_client: Any
) -> None:
    """Expected: of three units sent to one worker, the second, sent with a token and dropped
    while it waits behind the first, comes back as ``ChainStopped`` (nothing of it kept); the
    first and third train as sent, and a drop for a token no unit carries changes nothing."""
    args = _unit_args(small_manifest, validate=False)
    calls = UnitCalls(dask_client)
    worker = _workers(dask_client)[0]
    first = calls.call(worker, args)
    dropped = calls.call(worker, args, token="ahead-1")
    third = calls.call(worker, args, token="ahead-2")
    calls.drop(worker, ["ahead-1", "never-sent"])
    with pytest.raises(ChainStopped):
        dropped.result(timeout=60)
    state, record, _ = first.result(timeout=60)
    again, again_record, _ = third.result(timeout=60)
    assert _tensors(state) == _tensors(again) and record["train_loss"] == again_record["train_loss"]
