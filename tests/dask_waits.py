"""Waits on a live Dask cluster for fault tests: a signal must land while a task runs (or a
training pass is past its first batch), not in the gap between two tasks or during a pass's
set-up, which a loaded machine can stretch past any fixed sleep."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any


def worker_is_executing(client: Any) -> bool:
    """Whether any worker of ``client``'s cluster is running a task, or a MOP unit of its
    resident trainer, right now."""

    def running(dask_worker: Any) -> int:
        from mopflow.training.executors.mop_service import units_running

        return len(dask_worker.state.executing) + len(units_running())

    return any(client.run(running).values())


def wait_until_executing(client: Any, keep_waiting: Callable[[], bool], timeout_s: float = 120) -> bool:
    """Poll until a worker runs a task (True), ``keep_waiting`` turns False or time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and keep_waiting():
        if worker_is_executing(client):
            return True
        time.sleep(0.02)
    return worker_is_executing(client)


def fit_batches_done(client: Any) -> int:
    """The most batches that a training pass running on ``client``'s workers right now has
    finished (a plain pass's module count, or a Lightning fit loop's own progress record, read
    from the thread training); -1 when no pass runs."""

    def done_here() -> int:
        trainer_cls = getattr(sys.modules.get("pytorch_lightning"), "Trainer", None)
        found = -1
        for top in sys._current_frames().values():
            frame: FrameType | None = top
            while frame is not None:
                name = frame.f_code.co_name
                if name == "plain_pass" and "module" in frame.f_locals:
                    found = max(found, int(frame.f_locals["module"].batches_done))
                    break
                trainer = frame.f_locals.get("self") if name == "fit" else None
                if trainer_cls is not None and isinstance(trainer, trainer_cls):
                    found = max(found, int(trainer.fit_loop.epoch_loop.batch_progress.current.completed))
                    break
                frame = frame.f_back
        return found

    return max(client.run(done_here).values(), default=-1)


def wait_until_fit_batches(
    client: Any, batches: int, keep_waiting: Callable[[], bool], timeout_s: float = 120
) -> bool:
    """Poll until a fit on a worker has finished ``batches`` batches of its pass (True),
    ``keep_waiting`` turns False or time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and keep_waiting():
        if fit_batches_done(client) >= batches:
            return True
        time.sleep(0.02)
    return fit_batches_done(client) >= batches
