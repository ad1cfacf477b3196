"""DDP ranks are tasks on the Dask workers: they run in the worker processes, a trial needs as
many workers as ranks, and a rank whose worker is killed mid-epoch fails the job, which starts
again from its last epoch checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mopflow.training.compute.interfaces import host_interfaces, interface_for
from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.ddp import DDPExecutor

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.02, "weight_decay": 0.0, "batch_size": 16}


def test_ddp_ranks_run_in_the_dask_worker_processes(small_manifest: str, dask_client: Any) -> None:
    executor = DDPExecutor(dask_client, DataRef.open(small_manifest), world_size=2)
    outcome = executor.run([ModelSpec("d", CNN, seed=0)], epochs=2)["d"]
    assert outcome.error is None and [r.epoch for r in outcome.history] == [0, 1]
    worker_pids = set(dask_client.run(os.getpid).values())
    assert set(executor.rank_pids["d"]) == worker_pids and os.getpid() not in worker_pids
    assert len(executor.rank_pids["d"]) == 2  # one rank per worker process
    # the workers are at 127.0.0.1: gloo went through the loopback interface, not the hostname's
    loopback = interface_for("127.0.0.1", host_interfaces())
    assert loopback is not None and executor.rank_interfaces["d"] == [loopback, loopback]


def test_a_failed_rendezvous_in_a_worker_does_not_hold_up_its_next_trials(
    small_manifest: str, dask_client: Any
) -> None:
    """torch names a process group by a per-process counter that a failed rendezvous raises: a
    rank in that worker must still meet its peers under the same name on the next trial."""

    def fail_a_rendezvous() -> int:
        from datetime import timedelta

        import torch.distributed as dist

        from mopflow.training.executors.ddp_rank import free_port

        address, port = free_port()
        with contextlib.suppress(Exception):  # rank 0 of two, whose peer never comes: DistStoreError
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{address}:{port}",
                rank=0,
                world_size=2,
                timeout=timedelta(seconds=1),
            )
        assert not dist.is_initialized()
        return dist.distributed_c10d._world.group_count

    worker = sorted(dask_client.scheduler_info()["workers"])[0]
    raised = dask_client.submit(fail_a_rendezvous, workers=[worker], allow_other_workers=False, pure=False)
    assert raised.result() >= 1  # the counter this test is about was raised in one worker only
    executor = DDPExecutor(dask_client, DataRef.open(small_manifest), world_size=2, collective_timeout_s=20)
    outcome = executor.run([ModelSpec("f", CNN, seed=0)], epochs=1)["f"]
    assert outcome.error is None, outcome.error
    assert [i["kind"] for i in executor.interruptions] == []


def test_more_ranks_than_workers_is_refused_naming_both(small_manifest: str, dask_client: Any) -> None:
    executor = DDPExecutor(dask_client, DataRef.open(small_manifest), world_size=3)
    with pytest.raises(RuntimeError, match="ddp_world_size=3 needs 3 Dask workers; the cluster has 2"):
        executor.rank_workers(ModelSpec("d", CNN), wait_s=0.1)


@pytest.fixture(scope="module")
def killable_client() -> Iterator[Any]:
    """A cluster of its own (its workers get killed), waiting long enough for a restarted worker."""
    import dask

    from mopflow.training.compute.cluster import dask_client

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "120s"}), dask_client("", 2) as client:
        yield client


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_fails_the_job_and_the_trial_resumes(
    small_manifest: str, killable_client: Any, tmp_path: Path
) -> None:
    client = killable_client
    executor = DDPExecutor(
        client,
        DataRef.open(small_manifest),
        world_size=2,
        checkpoint_root=str(tmp_path),
        collective_timeout_s=30,
    )
    spec = ModelSpec("d", CNN, seed=0)
    rank1 = executor.rank_workers(spec)[1]
    victim = client.run(os.getpid, workers=[rank1])[rank1]
    checkpoint = tmp_path / "d" / "last.safetensors"
    killed: list[float] = []

    def kill_after_first_epoch() -> None:
        deadline = time.monotonic() + 120
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # into the second epoch
        os.kill(victim, signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_after_first_epoch)
    killer.start()
    started = time.monotonic()
    outcome = executor.run([spec], epochs=6)["d"]
    killer.join()
    assert killed, "the rank's worker was never killed"
    assert outcome.error is None, outcome.error
    # Every epoch reported once, in order: the job went on from its checkpoint, nothing repeated.
    assert [r.epoch for r in outcome.history] == list(range(6))
    assert [i["kind"] for i in executor.interruptions] == ["rank lost"]
    assert victim not in executor.rank_pids["d"]  # the last attempt ran on the restarted worker
    assert time.monotonic() - started < 240
    client.wait_for_workers(2, timeout=60)
