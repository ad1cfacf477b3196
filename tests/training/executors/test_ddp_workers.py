"""Gangs of workers for DDP trials across hosts: a device is told apart by its host (or its GPU's
UUID), and a job that lost a rank goes on without the workers it blames where it can."""

from __future__ import annotations

import threading
import time
from typing import Any

from mopflow.training.compute.workers import worker_addresses
from mopflow.training.executors.ddp import shunned_after_loss
from mopflow.training.executors.ddp_job import RankLost
from mopflow.training.executors.ddp_workers import (
    WorkerGangs,
    avoidable,
    choose_gang,
    concurrent_trials,
    device_identity,
    worker_device,
)


def test_a_retry_fills_its_gang_from_workers_outside_the_lost_one_first() -> None:
    cpus = {f"w{i}": f"cpu:w{i}" for i in range(4)}
    assert choose_gang(cpus, 2) == ["w0", "w1"]  # nothing to avoid: address order, as before
    assert choose_gang(cpus, 2, prefer_not=["w0", "w1"]) == ["w2", "w3"]
    # one named worker: rank 0 too moves off it
    assert choose_gang(cpus, 2, prefer_not=["w0"]) == ["w1", "w2"]
    # too few others: as many of them as there are, then the avoided ones, in address order
    assert choose_gang(cpus, 3, prefer_not=["w0", "w1"]) == ["w2", "w3", "w0"]
    assert choose_gang({"w0": "cpu:w0", "w1": "cpu:w1"}, 2, prefer_not=["w0", "w1"]) == ["w0", "w1"]
    # distinct devices still rule: the other worker on w2's GPU cannot be rank 1
    shared = {"a0": "cuda:A", "a1": "cuda:A", "b0": "cuda:B", "c0": "cuda:C"}
    assert choose_gang(shared, 2, prefer_not=["b0", "c0"]) == ["a0", "b0"]
    assert choose_gang(shared, 4, prefer_not=["b0"]) is None


def test_a_gang_without_the_blamed_workers_is_told_possible_or_not() -> None:
    four = {f"w{i}": f"cpu:w{i}" for i in range(4)}
    assert avoidable(four, 2, ["w0", "w1"])
    assert not avoidable(four, 3, ["w0", "w1"])
    # another worker on the same GPU as a blamed one makes no gang with it
    assert not avoidable({"a0": "cuda:A", "a1": "cuda:A", "b0": "cuda:B"}, 2, ["b0"])


def test_the_workers_blamed_for_a_lost_rank_are_the_named_ones_else_the_whole_gang() -> None:
    gang = ["tcp://10.0.0.1:4000", "tcp://10.0.0.2:4000"]
    left = RankLost("rank 1's worker tcp://10.0.0.2:4000 left the cluster", workers=[gang[1]])
    assert shunned_after_loss(gang, left) == [gang[1]]
    # a rank that lost its peers names itself: the link or the peer is unknown
    assert shunned_after_loss(gang, RankLost(f"rank 0 on {gang[0]} lost its peers")) == gang


def test_one_gpu_number_on_two_hosts_is_two_devices_and_one_gpu_shared_on_a_host_is_one() -> None:
    # trials_per_gpu=2 on two hosts that each expose CUDA device 0
    ids = {
        "tcp://10.0.0.1:1": device_identity(True, "tcp://10.0.0.1:1", "node1", "0", None),
        "tcp://10.0.0.1:2": device_identity(True, "tcp://10.0.0.1:2", "node1", "0", None),
        "tcp://10.0.0.2:1": device_identity(True, "tcp://10.0.0.2:1", "node2", "0", None),
        "tcp://10.0.0.2:2": device_identity(True, "tcp://10.0.0.2:2", "node2", "0", None),
    }
    assert len(set(ids.values())) == 2
    assert concurrent_trials(ids, 2) == 2
    assert choose_gang(ids, 2) == ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]
    # the GPU's UUID, where torch sees it, names it on any host, whatever CUDA_VISIBLE_DEVICES says
    assert device_identity(True, "a", "node1", "0", "GPU-1234") == device_identity(
        True, "b", "node2", "3", "GPU-1234"
    )
    assert device_identity(True, "a", "node1", "0", "GPU-1234") != device_identity(
        True, "a", "node1", "0", "GPU-5678"
    )
    # on the CPU every worker is its own slot, whatever GPU it could see
    assert device_identity(False, "a", "node1", "0", "GPU-1234") != device_identity(
        False, "b", "node1", "0", "GPU-1234"
    )


def test_real_workers_name_their_device_per_worker_on_cpu_and_per_host_gpu_for_gpu(
    dask_client: Any,
) -> None:
    on_cpu = dask_client.run(worker_device)
    on_gpu = dask_client.run(worker_device, gpu=True)
    assert len(set(on_cpu.values())) == 2  # the LocalCluster's two workers
    # one host, the same (no) CUDA_VISIBLE_DEVICES: the GPU they would train on is one
    assert len(set(on_gpu.values())) == 1


def test_a_retry_waits_for_a_gang_without_the_blamed_workers_then_takes_them(dask_client: Any) -> None:
    """Real cluster, two workers, one-rank gangs: the other worker is held by another trial."""
    first, second = worker_addresses(dask_client)
    gangs = WorkerGangs(dask_client, 1, {})
    assert gangs.take(5) == [first]
    started = time.monotonic()
    assert gangs.take(5, prefer_not=[second], prefer_wait_s=1.0) == [second]  # no other came free
    assert time.monotonic() - started >= 1.0
    gangs.give_back([second])
    # the held worker freed meanwhile: taken instead of the blamed one
    threading.Timer(0.3, gangs.give_back, [[first]]).start()
    started = time.monotonic()
    assert gangs.take(5, prefer_not=[second], prefer_wait_s=30.0) == [first]
    assert time.monotonic() - started < 10
    gangs.give_back([first])
    # no gang without them could ever be formed: taken at once, not after the wait
    gangs = WorkerGangs(dask_client, 2, {})
    started = time.monotonic()
    assert gangs.take(5, prefer_not=[first, second], prefer_wait_s=30.0) == [first, second]
    assert time.monotonic() - started < 10
