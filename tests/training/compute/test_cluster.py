"""The LocalCluster that ``mopflow.training.compute.cluster.dask_client`` starts: what its worker processes run with."""

from __future__ import annotations

import os
from typing import Any

import dask
import pytest

from mopflow.training.compute.cluster import (
    START_METHOD,
    dask_client,
    shared_local_clusters,
    start_local_cluster_early,
    worker_start_settings,
)


def _worker_settings(dask_worker: Any) -> dict[str, Any]:
    return {
        "malloc_env": "MALLOC_TRIM_THRESHOLD_" in os.environ,
        "callbacks_ms": {k: pc.callback_time for k, pc in dask_worker.periodic_callbacks.items()},
    }


def test_local_workers_keep_background_work_low() -> None:
    """In the worker process itself (the settings reach it through the nanny): glibc's default
    malloc, no statistical profiler, and the event loop's self-timing, system and memory
    monitors at the intervals set in ``dask_client`` rather than Dask's 20/500/100 ms."""
    with dask_client("", 1) as client:
        (settings,) = client.run(_worker_settings).values()
        scheduler_ms = client.run_on_scheduler(
            lambda dask_scheduler: {
                k: pc.callback_time for k, pc in dask_scheduler.periodic_callbacks.items()
            }
        )
    callbacks = settings["callbacks_ms"]
    assert settings["malloc_env"] is False
    assert "profile" not in callbacks and "profile-cycle" not in callbacks
    assert callbacks["tick"] == 500
    assert callbacks["monitor"] == 2000
    assert callbacks["memory_monitor"] == 500
    # the scheduler lives in this process: the same settings apply to its event loop
    assert scheduler_ms["tick"] == 500
    assert scheduler_ms["monitor"] == 2000


def _host_settings() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ("MOPFLOW_STORAGE_OPTIONS", "MOPFLOW_SHARD_CACHE")}


def test_local_workers_use_the_storage_options_a_stage_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LocalCluster's workers are on this host: they set no storage options of their own (a
    stage's, which may come from an Airflow connection set after the cluster started, are the
    right ones here), and keep this process's other settings, its shard cache among them."""
    monkeypatch.setenv("MOPFLOW_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:9000"}')
    monkeypatch.setenv("MOPFLOW_SHARD_CACHE", "/var/cache/mopflow/shards")
    with dask_client("", 1) as client:
        (settings,) = client.run(_host_settings).values()
    assert settings == {"MOPFLOW_STORAGE_OPTIONS": "", "MOPFLOW_SHARD_CACHE": "/var/cache/mopflow/shards"}


def _pid() -> int:
    return os.getpid()


def test_stages_in_one_process_share_a_local_cluster_until_the_block_ends() -> None:
    """Within ``shared_local_clusters`` a second use gets the first one's workers (the same
    processes, imports done); another shape starts its own; when the block ends every worker
    process has ended."""
    import psutil

    with shared_local_clusters():
        with dask_client("", 1) as client:
            first = set(client.run(_pid).values())
            address = client.scheduler.address
        assert all(psutil.pid_exists(pid) for pid in first)  # kept between the uses
        with dask_client("", 1) as client:
            assert client.scheduler.address == address
            assert set(client.run(_pid).values()) == first
        with dask_client("", 2) as other:
            assert other.scheduler.address != address
            workers = first | set(other.run(_pid).values())
    assert len(workers) == 3
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def _imported(name: str) -> bool:
    import sys

    return name in sys.modules


def test_a_cluster_started_early_serves_the_next_use_with_its_imports_done() -> None:
    """``start_local_cluster_early`` starts the cluster in the background; the next use of that
    shape gets it, and its worker imported the warm-up modules before running anything else."""
    with shared_local_clusters():
        start_local_cluster_early(1, ("wave",))
        with dask_client("", 1) as client:
            assert client.submit(_imported, "wave", pure=False).result() is True
            assert client.submit(_imported, "tabnanny", pure=False).result() is False
            address = client.scheduler.address
        with dask_client("", 1) as client:
            assert client.scheduler.address == address


def test_a_cluster_that_failed_to_start_early_is_started_by_its_use(monkeypatch: Any) -> None:
    from mopflow.training.compute import cluster

    start = cluster._start
    calls: list[int] = []

    def fail_first(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no free port")
        return start(*args)

    monkeypatch.setattr(cluster, "_start", fail_first)
    with shared_local_clusters():
        start_local_cluster_early(1, ())
        with dask_client("", 1) as client:
            assert client.submit(_pid, pure=False).result() != os.getpid()
    assert len(calls) == 2


def _worker_start(variable: str) -> dict[str, Any]:
    import sys

    return {
        "parent": os.getppid(),
        "lightning_loaded": "pytorch_lightning" in sys.modules,
        "variable": os.environ.get(variable),
    }


def test_cpu_workers_fork_from_a_server_with_the_training_stack_and_this_processs_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forked from the server, a worker has torch and Lightning loaded before its first task, and
    sees this process's environment as it is when the cluster starts, not as it was when the
    server started."""
    before = dask.config.get(START_METHOD)
    with dask_client("", 1):
        pass  # the fork server is running from here on
    monkeypatch.setenv("MOPFLOW_TEST_WORKER_ENV", "set after the server started")
    with dask_client("", 1) as client:
        (seen,) = client.run(_worker_start, "MOPFLOW_TEST_WORKER_ENV").values()
    assert seen["parent"] != os.getpid()  # the fork server's child, not this process's
    assert seen["lightning_loaded"] is True
    assert seen["variable"] == "set after the server started"
    assert dask.config.get(START_METHOD) == before  # the cluster's setting ends with it


def test_the_start_method_a_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_start_settings(gpu_workers=False) == {START_METHOD: "forkserver"}
    # each GPU worker's CUDA_VISIBLE_DEVICES: spawned, even while a CPU cluster forks its workers
    with dask.config.set({START_METHOD: "forkserver"}):
        assert worker_start_settings(gpu_workers=True) == {START_METHOD: "spawn"}
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "spawn")
    assert worker_start_settings(gpu_workers=False) == {}
