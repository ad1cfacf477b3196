"""Dask client at the edge: an existing scheduler when an address is set, else a LocalCluster."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import dask
from distributed import Client, LocalCluster

from mopflow.training.compute.devices import DeviceError, WorkerSpec, gpu_worker_plan, visible_gpus

log = logging.getLogger(__name__)


def local_gpus(accelerator: str, gpus: Sequence[str] | None = None) -> list[str]:
    """The GPUs a LocalCluster gives its workers: none for ``cpu``; the visible ones otherwise
    (``gpus`` overrides what is visible). ``gpu`` with none visible is refused."""
    if accelerator == "cpu":
        return []
    found = list(visible_gpus() if gpus is None else gpus)
    if accelerator == "gpu" and not found:
        raise DeviceError(
            "accelerator 'gpu' but no CUDA device is visible (CUDA_VISIBLE_DEVICES, or a CPU-only "
            "torch: install the CUDA build of torch for GPU workers)"
        )
    return found


@contextmanager
def dask_client(
    address: str = "",
    n_workers: int = 2,
    accelerator: str = "cpu",
    trials_per_gpu: int = 1,
    gpus: Sequence[str] | None = None,
) -> Iterator[Client]:
    """Yield a Dask client; a LocalCluster (one thread per worker process) is closed on exit.

    With an ``accelerator`` other than ``cpu`` and CUDA devices visible, the LocalCluster starts
    ``trials_per_gpu`` worker processes per GPU instead of ``n_workers``, each seeing only its
    GPU (``CUDA_VISIBLE_DEVICES``) and declaring the Dask resource ``GPU=1``.
    """
    if address:
        log.info("connecting to Dask scheduler at %s", address)
        with Client(address, timeout="30s") as client:
            yield client
        return
    plan = gpu_worker_plan(local_gpus(accelerator, gpus), trials_per_gpu)
    if plan:
        log.info(
            "starting Dask LocalCluster with %d GPU worker processes (%d per GPU)", len(plan), trials_per_gpu
        )
    else:
        log.info("starting Dask LocalCluster with %d worker processes", n_workers)
    with (
        # Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which freezes glibc's
        # mmap threshold: every numpy temporary over 128 KiB is then mmap'd and page-faulted
        # afresh, and the heap is trimmed on each free. MNIST-1D generation cost 15-45% more CPU
        # in a worker than in a plain process (benchmarks/shard.py); glibc's defaults it is.
        dask.config.set(
            {
                "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                # The statistical profiler samples every worker's stack 100 times a second,
                # taking the GIL from the task each time; its only reader is the dashboard,
                # which a LocalCluster here never serves (dashboard_address=None).
                "distributed.worker.profile.enabled": False,
                # Every process's event loop wakes 50 times a second to time itself (tick), and
                # samples its own memory and system counters every 100-500 ms: idle, the three
                # processes used 0.64 CPU-s per 7 s (about 5% of a 2-core machine, taken from
                # the tasks). These intervals cut that to 0.09 CPU-s; the memory limits are still
                # checked twice a second and a blocked event loop still warned about after 3 s.
                "distributed.admin.tick.interval": "500ms",
                "distributed.admin.system-monitor.interval": "2s",
                "distributed.worker.memory.monitor-interval": "500ms",
            }
        ),
        LocalCluster(
            n_workers=0 if plan else n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
            silence_logs=logging.WARNING,
        ) as cluster,
        Client(cluster) as client,
    ):
        if plan:
            _add_workers(cluster, client, plan)
        yield client


def _add_workers(cluster: LocalCluster, client: Client, plan: Sequence[WorkerSpec]) -> None:
    """Start one worker process per spec, with the cluster's own worker options plus its env
    and resources, and wait until all have joined."""
    for worker in plan:
        spec = dict(cluster.new_spec)
        spec["options"] = {**spec["options"], "env": dict(worker.env), "resources": dict(worker.resources)}
        cluster.worker_spec[worker.name] = spec
    cluster.sync(cluster._correct_state)
    client.wait_for_workers(len(plan), timeout=120)
