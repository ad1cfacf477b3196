"""Where training runs: resolving the accelerator, GPU workers of a LocalCluster, device-aware
state; the ``gpu``-marked tests train on a CUDA device and are skipped without one."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from mopflow.base.settings import Settings, SettingsError
from mopflow.training.compute.cluster import dask_client, local_gpus, shared_local_clusters
from mopflow.training.compute.devices import (
    CPU,
    DeviceError,
    DeviceSpec,
    all_bf16,
    device_for_cluster,
    gpu_worker_addresses,
    gpu_worker_plan,
    gpu_workers,
    gpu_workers_bf16,
    resolve_device,
    visible_gpus,
)
from mopflow.training.compute.workers import cluster_workers
from mopflow.training.executors import DataRef, ModelSpec

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}


@pytest.mark.parametrize(
    ("accelerator", "gpus", "expected"),
    [("auto", 0, "cpu"), ("auto", 2, "gpu"), ("cpu", 2, "cpu"), ("gpu", 1, "gpu")],
)
def test_the_accelerator_resolves_against_the_gpu_workers(accelerator: Any, gpus: int, expected: str) -> None:
    device = resolve_device(accelerator, "32", gpus)
    assert device.accelerator == expected
    assert device.resources() == ({"GPU": 1} if expected == "gpu" else {})
    assert device.ddp_backend() == ("nccl" if expected == "gpu" else "gloo")
    assert device.trainer_kwargs() == {"accelerator": expected, "devices": 1, "precision": "32"}


def test_gpu_without_gpu_workers_and_bf16_without_bfloat16_are_refused() -> None:
    with pytest.raises(DeviceError, match=r"accelerator 'gpu' but no GPU worker.*--resources GPU=1"):
        resolve_device("gpu", "32", 0)
    with pytest.raises(DeviceError, match="bf16-mixed"):
        resolve_device("auto", "bf16-mixed", 1, bf16_supported=False)
    assert resolve_device("auto", "bf16-mixed", 0, bf16_supported=False) == DeviceSpec("cpu", "bf16-mixed")
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        local_gpus("gpu", [])
    assert local_gpus("cpu", ["0"]) == [] and local_gpus("auto", ["0", "1"]) == ["0", "1"]


def test_the_gpu_worker_plan_gives_each_worker_one_gpu_and_the_gpu_resource() -> None:
    plan = gpu_worker_plan(["0", "3"], trials_per_gpu=2)
    assert [(w.name, w.env, w.resources) for w in plan] == [
        ("gpu0-0", {"CUDA_VISIBLE_DEVICES": "0"}, {"GPU": 1}),
        ("gpu0-1", {"CUDA_VISIBLE_DEVICES": "0"}, {"GPU": 1}),
        ("gpu3-0", {"CUDA_VISIBLE_DEVICES": "3"}, {"GPU": 1}),
        ("gpu3-1", {"CUDA_VISIBLE_DEVICES": "3"}, {"GPU": 1}),
    ]
    with pytest.raises(DeviceError, match="trials_per_gpu=0"):
        gpu_worker_plan(["0"], 0)


def test_a_cpu_only_torch_sees_no_gpu_whatever_cuda_visible_devices_says() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == []


def test_a_local_cluster_for_gpus_starts_a_worker_per_gpu_slot_that_sees_only_its_gpu() -> None:
    # The mechanism on any machine: two "GPUs" by id, two workers each (nothing here touches CUDA).
    # Under mopflow run (shared_local_clusters) the next stage asking for them gets the same ones.
    with shared_local_clusters():
        with dask_client("", 2, accelerator="auto", trials_per_gpu=2, gpus=["0", "1"]) as client:
            first = client.scheduler.address
        with dask_client("", 2, accelerator="auto", trials_per_gpu=2, gpus=["0", "1"]) as client:
            assert client.scheduler.address == first
            _check_gpu_workers(client)


def _check_gpu_workers(client: Any) -> None:
    """Four workers, one per GPU slot, each seeing only its GPU and declaring GPU=1."""
    workers = cluster_workers(client).values()
    assert sorted(w["name"] for w in workers) == ["gpu0-0", "gpu0-1", "gpu1-0", "gpu1-1"]
    assert all(w["resources"] == {"GPU": 1} for w in workers)
    seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert sorted(seen.values()) == ["0", "0", "1", "1"]
    assert gpu_workers(client) == 4
    assert device_for_cluster(client, "auto", "32").accelerator == "gpu"
    assert device_for_cluster(client, "cpu", "32") == CPU
    # A unit that needs the GPU resource runs only on such a worker.
    future = client.submit(os.getpid, resources={"GPU": 1}, pure=False)
    assert future.result(timeout=60) in client.run(os.getpid).values()


def test_a_cpu_cluster_has_no_gpu_workers(dask_client: Any) -> None:
    assert gpu_workers(dask_client) == 0
    assert device_for_cluster(dask_client, "auto", "32") == CPU
    with pytest.raises(DeviceError, match="no GPU worker"):
        device_for_cluster(dask_client, "gpu", "32")


def test_bf16_needs_every_gpu_worker_to_say_so_and_no_gpu_worker_is_the_cpu_s_yes() -> None:
    assert all_bf16({}) is True
    assert all_bf16({"tcp://a:1": True, "tcp://b:1": True}) is True
    assert all_bf16({"tcp://a:1": True, "tcp://b:1": False}) is False
    assert all_bf16({"tcp://a:1": True, "tcp://b:1": OSError("worker gone")}) is False


def _bf16_unless_the_cpu_worker(dask_worker: Any) -> bool:
    return bool(dask_worker.name != "cpu")


def _no_bf16() -> bool:
    return False


def test_bf16_is_asked_of_the_gpu_workers_only() -> None:
    """One worker that declares the GPU resource and one that does not, in this process: the
    probe runs on the GPU worker alone, and its answer is the cluster's."""
    import torch
    from distributed import Client, Scheduler, SpecCluster, Worker

    workers = {
        "gpu": {"cls": Worker, "options": {"nthreads": 1, "resources": {"GPU": 1}}},
        "cpu": {"cls": Worker, "options": {"nthreads": 1}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        gpus = gpu_worker_addresses(client)
        assert [cluster_workers(client)[a]["name"] for a in gpus] == ["gpu"]
        assert gpu_workers_bf16(client, gpus, probe=_bf16_unless_the_cpu_worker) is True
        assert gpu_workers_bf16(client, gpus, probe=_no_bf16) is False
        assert gpu_workers_bf16(client, [], probe=_no_bf16) is True
        # CPU torch (or a GPU with bfloat16) on the GPU worker: bf16-mixed on the GPU is allowed
        if not torch.cuda.is_available() or torch.cuda.is_bf16_supported():
            assert device_for_cluster(client, "auto", "bf16-mixed") == DeviceSpec("gpu", "bf16-mixed")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MOPFLOW_ACCELERATOR": "tpu"}, "MOPFLOW_ACCELERATOR='tpu' is not one of ['auto', 'cpu', 'gpu']"),
        ({"MOPFLOW_PRECISION": "16"}, "MOPFLOW_PRECISION='16' is not one of ['32', 'bf16-mixed']"),
        ({"MOPFLOW_TRIALS_PER_GPU": "0"}, "MOPFLOW_TRIALS_PER_GPU='0' must be an integer from 1 to 64"),
    ],
)
def test_bad_device_settings_are_refused_naming_the_value(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    assert needle in str(info.value)


def test_device_settings_default_to_auto_one_trial_per_gpu_and_32_bit() -> None:
    settings = Settings.from_env({})
    assert (settings.accelerator, settings.trials_per_gpu, settings.precision) == ("auto", 1, "32")


def test_a_model_spec_keeps_its_device_through_a_job_file() -> None:
    spec = ModelSpec("m", CNN, 3, DeviceSpec("gpu", "bf16-mixed"))
    assert ModelSpec.from_dict(asdict(spec)) == spec
    assert ModelSpec.from_dict({"model_id": "m", "params": CNN}).device == CPU


# ---------------------------------------------------------------------------- on a CUDA device

GPU = DeviceSpec("gpu", "32")


@pytest.mark.gpu
def test_gpu_optimizer_state_is_on_the_device_after_a_hop(small_manifest: str) -> None:
    import torch

    from mopflow.training.data import load_manifest
    from mopflow.training.executors.units import init_state, train_pass
    from mopflow.training.trainable.unit import TrainableUnit

    spec = ModelSpec("m", CNN, 0, GPU)
    data = DataRef.open(small_manifest)
    manifest = load_manifest(small_manifest)
    shards = [e["name"] for e in manifest["splits"]["train"]][:1]  # one MOP partition
    state, _ = train_pass(spec, init_state(spec, data), data, shards, 0, 2, 0)
    unit = TrainableUnit.build(spec, manifest, 1)
    unit.import_state(state)
    optimizer = torch.optim.AdamW(unit.model.to("cuda").parameters())
    unit.restore_moments(optimizer)
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert moments and all(m.device.type == "cuda" for m in moments)
    again, _ = train_pass(spec, state, data, shards, 1, 2, 0)  # the next hop trains on from there
    assert again != state


@pytest.mark.gpu
def test_gpu_task_trial_and_mop_sweep(small_manifest: str, tmp_path: Path) -> None:
    from mopflow.training.search.config import SearchConfig
    from mopflow.training.search.sweep import run_search_with_executor, run_strategy_search
    from tests.spaces import fixed_cnn_space

    space = fixed_cnn_space(batch_size=32, lr=0.01)
    with dask_client("", 1, accelerator="gpu") as client:
        device = device_for_cluster(client, "gpu", "32")
        task = SearchConfig(n_trials=1, epochs=2, space=space, pruner="none", sampler="random")
        done = run_strategy_search(
            task,
            small_manifest,
            "gpu-task",
            str(tmp_path / "t.log"),
            str(tmp_path / "t"),
            client,
            device=device,
        )
        assert [r.state for r in done.results] == ["COMPLETE"]
        mop = SearchConfig(
            n_trials=2, epochs=2, strategy="mop", model_slots=2, space=space, pruner="none", sampler="random"
        )
        swept = run_search_with_executor(
            mop,
            small_manifest,
            "gpu-mop",
            str(tmp_path / "m.log"),
            str(tmp_path / "m"),
            client,
            device=device,
        )
        assert [r.state for r in swept.results] == ["COMPLETE", "COMPLETE"]


@pytest.mark.gpu
def test_gpu_ddp_trial_over_nccl(small_manifest: str) -> None:
    import torch

    from mopflow.training.executors.ddp import DDPExecutor

    world = min(2, torch.cuda.device_count())  # nccl: one rank per GPU
    with dask_client("", 1, accelerator="gpu") as client:
        outcome = DDPExecutor(client, DataRef.open(small_manifest), world_size=world).run(
            [ModelSpec("d", CNN, 0, GPU)], epochs=2
        )["d"]
    assert outcome.error is None and [r.epoch for r in outcome.history] == [0, 1]


@pytest.mark.gpu
def test_workers_sharing_a_gpu_name_it_by_its_uuid() -> None:
    """trials_per_gpu=2: the two workers of each GPU name one device, by the GPU's UUID."""
    import torch

    from mopflow.training.executors.ddp_workers import worker_device

    with dask_client("", 1, accelerator="gpu", trials_per_gpu=2) as client:
        named = client.run(worker_device, gpu=True)
    uuids = {str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())}
    assert {d.removeprefix("cuda:") for d in named.values()} == uuids
    assert len(named) == 2 * len(uuids)


def test_the_student_s_device_resolves_in_its_own_process() -> None:
    import torch

    from mopflow.training.compute.devices import local_device

    if torch.cuda.is_available():
        assert local_device("auto", "32").accelerator == "gpu"
    else:
        assert local_device("auto", "32") == CPU
        with pytest.raises(DeviceError, match="accelerator 'gpu'"):
            local_device("gpu", "32")
    assert local_device("cpu", "bf16-mixed") == DeviceSpec("cpu", "bf16-mixed")


@pytest.mark.gpu
def test_gpu_student_trains_on_the_gpu_and_comes_back_on_the_cpu() -> None:
    import numpy as np

    from mopflow.compression.config import DistillConfig
    from mopflow.compression.distill.distill import plan_student
    from mopflow.training.models.families import DataSpec
    from tests.compression.helpers import train_student

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 40)).astype(np.float32)
    y = rng.integers(0, 10, size=256).astype(np.int64)
    cfg = DistillConfig(epochs=2)
    plan = plan_student(cfg, 100_000, DataSpec(40, 10))
    model, history = train_student(plan, cfg, x, y, x, y, [0.0] * 40, [1.0] * 40, None, 0, device=GPU)
    assert len(history) == 2 and next(model.parameters()).device.type == "cpu"


def test_seeding_the_cpu_draws_as_torch_manual_seed_does() -> None:
    import torch

    torch.manual_seed(1)  # another state first: the seed must replace it
    CPU.seed(5)
    seeded = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(seeded, torch.rand(4))
