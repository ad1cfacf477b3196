"""Spot/preemptible workers: act on the preemption notice (SIGTERM) instead of dying mid-epoch.

A cloud sends SIGTERM some seconds before it takes a spot VM away. On a Dask worker running
mopflow training, :class:`PreemptionPlugin` turns that signal into a notice
(:data:`NOTICE`) that the training loop checks at every batch boundary: the trial writes a
checkpoint of where it is (mid-epoch) and asks Dask to run it again elsewhere
(``distributed.Reschedule``); the worker then leaves the cluster within the grace period. The
trial resumes from that checkpoint (weights, optimizer, schedule, step count) on another (or a
restarted) worker, not from the start of the epoch; the rest of that epoch draws from a fresh
shuffle, as the DataLoader keeps no position. Without a notice (SIGKILL) a trial loses at most the epoch it was in (it checkpoints
every finished epoch).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

log = logging.getLogger(__name__)

NOTICE = threading.Event()  # set in a worker process once it has been told it will be preempted
DEFAULT_GRACE_S = 30.0


class Preempted(Exception):
    """Raised inside the training loop after the checkpoint is written; the task is rescheduled."""


def notice_received() -> bool:
    """Whether this process was told that it is about to be preempted."""
    return NOTICE.is_set()


class PreemptionPlugin(WorkerPlugin):
    """On SIGTERM: raise the notice, let the running trial checkpoint and hand itself back, then
    close the worker once nothing runs or ``grace_s`` has passed (whichever comes first)."""

    name = "mopflow-preemption"

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s

    def setup(self, worker: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption: cannot install a SIGTERM handler outside the main thread")
            return
        loop = asyncio.get_event_loop()

        def on_sigterm(signum: int, frame: Any) -> None:
            if NOTICE.is_set():
                return
            NOTICE.set()
            log.warning(
                "preemption: SIGTERM on worker %s; checkpointing and leaving within %.0fs",
                worker.address,
                self.grace_s,
            )
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._leave(worker)))

        signal.signal(signal.SIGTERM, on_sigterm)

    async def _leave(self, worker: Any) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and worker.state.executing_count > 0:
            await asyncio.sleep(0.1)
        if worker.state.executing_count > 0:
            log.warning("preemption: grace period over with a task still running; leaving anyway")
        # nanny=False: under a nanny (local clusters) a fresh worker process takes this one's place
        await worker.close(nanny=False, executor_wait=False, reason="preempted (SIGTERM)")
