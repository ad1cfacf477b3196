"""The LocalCluster that ``mopflow.training.compute.cluster.dask_client`` starts: what its worker processes run with."""

from __future__ import annotations

import os
from typing import Any

from mopflow.training.compute.cluster import dask_client


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
