"""The model-averaging baseline (``benchmarks/baselines/averaging.py``): copies trained on each partition from the same start, averaged."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from baselines.averaging import ModelAveragingExecutor, average_states
from safetensors.torch import load, save

from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, EpochReport, ModelSpec, TrainAll
from mopflow.training.executors.units import evaluate_state, init_state, train_pass
from mopflow.training.trainable.state import read_meta

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}


def _packed(tensors: dict[str, torch.Tensor], global_step: int, **meta: object) -> bytes:
    info = json.dumps({"model_id": "m", "global_step": global_step, **meta})
    return bytes(save(tensors, metadata={"meta": info, "steps": json.dumps({"0": float(global_step)})}))


def test_floats_are_averaged_counters_take_the_largest_and_the_moments_are_dropped() -> None:
    a = _packed(
        {
            "model.w": torch.tensor([1.0, 2.0]),
            "model.bn.num_batches_tracked": torch.tensor(7),
            "opt.0.exp_avg": torch.ones(2),
            "opt.0.exp_avg_sq": torch.ones(2),
        },
        global_step=10,
        epoch=0,
        partition="p0",
    )
    b = _packed(
        {
            "model.w": torch.tensor([3.0, 6.0]),
            "model.bn.num_batches_tracked": torch.tensor(9),
            "opt.0.exp_avg": torch.zeros(2),
            "opt.0.exp_avg_sq": torch.zeros(2),
        },
        global_step=12,
        epoch=0,
        partition="p1",
    )
    averaged = average_states([a, b], {"epoch": 0})
    tensors = load(averaged)
    assert sorted(tensors) == ["model.bn.num_batches_tracked", "model.w"]
    assert torch.equal(tensors["model.w"], torch.tensor([2.0, 4.0]))
    assert tensors["model.bn.num_batches_tracked"].item() == 9
    assert read_meta(averaged) == {"model_id": "m", "epoch": 0, "global_step": 12}


def test_copies_of_different_models_are_refused() -> None:
    a = _packed({"model.w": torch.zeros(2)}, global_step=1)
    b = _packed({"model.v": torch.zeros(2)}, global_step=1)
    with pytest.raises(ValueError, match="not copies of one model"):
        average_states([a, b])


class Reports(TrainAll):
    def __init__(self) -> None:
        self.reports: list[EpochReport] = []

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.reports.append(report)
        return True


def test_an_epoch_returns_the_mean_of_the_copies_trained_from_the_same_start(
    small_manifest: str, dask_client: object
) -> None:
    data = DataRef.open(small_manifest)
    train = load_manifest(small_manifest)["splits"]["train"]
    spec = ModelSpec("m", CNN, seed=0)
    executor = ModelAveragingExecutor(dask_client, data, [e["name"] for e in train])
    assert executor.partitions == {"p0": ["train-00000.parquet"], "p1": ["train-00001.parquet"]}
    controller = Reports()
    outcome = executor.run([spec], epochs=1, controller=controller)["m"]

    # The copies, trained here through the same unit function from the same initial state.
    steps = max(math.ceil(int(e["rows"]) / 32) for e in train)
    start = init_state(spec, data)
    copies = [
        load(train_pass(spec, start, data, [name], 0, 1, index, {"partition": f"p{index}"}, steps)[0])
        for index, name in enumerate(["train-00000.parquet", "train-00001.parquet"])
    ]
    assert outcome.state is not None and outcome.error is None
    averaged = load(outcome.state)
    assert sorted(averaged) == sorted(k for k in copies[0] if k.startswith("model."))  # no moments
    drift = max(float((copies[0][k] - copies[1][k]).abs().max()) for k in averaged)
    assert drift > 1e-3  # the copies differ: their mean is neither of them
    for name, value in averaged.items():
        expected = (copies[0][name].double() + copies[1][name].double()) / 2
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6, msg=name)
    assert read_meta(outcome.state)["global_step"] == steps

    # One report for the epoch: the averaged model's validation accuracy, told to the controller.
    assert [r.epoch for r in outcome.history] == [0] and controller.reports == outcome.history
    assert outcome.history[0].val_acc == pytest.approx(evaluate_state(spec, outcome.state, data))
    # Each copy trained in the process of the worker holding its partition, one per worker.
    pids = dask_client.run(os.getpid)  # type: ignore[attr-defined]
    ran = {r["partition"]: int(r["process"].rsplit(":", 1)[1]) for r in executor.records}
    assert ran == {p: pids[w] for p, w in executor.placement.items()} and len(set(ran.values())) == 2


def test_every_epoch_is_reported_and_a_stopped_model_trains_no_more(
    small_manifest: str, dask_client: object
) -> None:
    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]

    class StopM0(Reports):
        def on_epoch_end(self, report: EpochReport) -> bool:
            super().on_epoch_end(report)
            return report.model_id != "m0"

    controller = StopM0()
    outcomes = ModelAveragingExecutor(dask_client, data, shards).run(
        [ModelSpec("m0", CNN, seed=0), ModelSpec("m1", CNN, seed=1)], epochs=2, controller=controller
    )
    assert outcomes["m0"].stopped_early and [r.epoch for r in outcomes["m0"].history] == [0]
    assert [r.epoch for r in outcomes["m1"].history] == [0, 1]
    assert all(0.0 <= r.val_acc <= 1.0 and math.isfinite(r.train_loss) for r in controller.reports)
    assert read_meta(outcomes["m1"].state or b"")["epoch"] == 1
