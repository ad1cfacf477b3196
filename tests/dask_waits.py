"""Waits on a live Dask cluster for fault tests: a signal must land while a task runs, not in the
gap between two tasks, which a loaded machine can stretch past any fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def worker_is_executing(client: Any) -> bool:
    """Whether any worker of ``client``'s cluster is running a task right now."""

    def running(dask_worker: Any) -> int:
        return len(dask_worker.state.executing)

    return any(client.run(running).values())


def wait_until_executing(client: Any, keep_waiting: Callable[[], bool], timeout_s: float = 120) -> bool:
    """Poll until a worker runs a task (True), ``keep_waiting`` turns False or time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and keep_waiting():
        if worker_is_executing(client):
            return True
        time.sleep(0.02)
    return worker_is_executing(client)
