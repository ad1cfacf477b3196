"""Dask client at the edge: an existing scheduler when an address is set, else a LocalCluster."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import dask
from distributed import Client, LocalCluster

log = logging.getLogger(__name__)


@contextmanager
def dask_client(address: str = "", n_workers: int = 2) -> Iterator[Client]:
    """Yield a Dask client; a LocalCluster (one thread per worker process) is closed on exit."""
    if address:
        log.info("connecting to Dask scheduler at %s", address)
        with Client(address, timeout="30s") as client:
            yield client
        return
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
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
            silence_logs=logging.WARNING,
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client
