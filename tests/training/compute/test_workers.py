"""Reading a cluster's workers while the client's own periodic refresh runs beside the reader."""

from __future__ import annotations

import threading
import time
from typing import Any

from mopflow.training.compute.workers import cluster_workers, joined_worker_addresses


def test_the_workers_are_all_there_in_every_read_from_any_thread(dask_client: Any) -> None:
    """Fault: the client refreshes its cached scheduler identity, without workers, every 10 ms,
    while three threads read the workers (``Client.scheduler_info()`` returns that cache: some
    of its reads come back with no workers). Expected: every read lists both workers."""
    import dask
    from distributed import Client

    expected = set(cluster_workers(dask_client))
    assert len(expected) == 2
    short: list[set[str]] = []
    reads = [0]
    with (
        dask.config.set({"distributed.client.scheduler-info-interval": "10ms"}),
        Client(dask_client.scheduler.address, set_as_default=False) as client,
    ):
        deadline = time.monotonic() + 2.0

        def read() -> None:
            while time.monotonic() < deadline:
                seen = set(cluster_workers(client))
                reads[0] += 1
                if seen != expected:
                    short.append(seen)

        threads = [threading.Thread(target=read) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert reads[0] > 100 and not short, (reads[0], short[:3])
        # each worker's identity comes with the read: what a DDP gang's choice needs
        assert all("nthreads" in worker for worker in cluster_workers(client).values())


class _StartingCluster:
    """A client whose scheduler has no worker until ``wait_for_workers`` is called."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.waited: list[tuple[int, float]] = []
        self.scheduler = self

    async def identity(self, n_workers: int) -> dict[str, Any]:
        return {"workers": dict(self.workers)}

    def sync(self, call: Any, **kwargs: Any) -> Any:
        import asyncio

        return asyncio.run(call(**kwargs))

    def wait_for_workers(self, n_workers: int, timeout: float) -> None:
        self.waited.append((n_workers, timeout))
        self.workers = {"tcp://b:2": {}, "tcp://a:1": {}}


def test_joined_worker_addresses_waits_for_a_first_worker_only_where_none_joined() -> None:
    starting = _StartingCluster()
    assert joined_worker_addresses(starting, timeout_s=5) == ["tcp://a:1", "tcp://b:2"]
    assert starting.waited == [(1, 5)]
    assert joined_worker_addresses(starting) == ["tcp://a:1", "tcp://b:2"]
    assert starting.waited == [(1, 5)]  # workers there already: no wait
