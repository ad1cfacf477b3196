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

A MOP (or task-executor) unit does the same at its next batch boundary: it raises
:class:`UnitPreempted` carrying its state packed mid-pass (weights, optimizer, batches done, RNG),
which reaches the coordinator through the scheduler even after the worker is gone; the unit is
queued again and continues on another worker from that batch, in the same data order.

Redone work: the work a lost attempt did after its last checkpoint must be done again.
:func:`lost_spans` reads when a task was processing on a worker that never finished it (from the
scheduler's transition log) and :func:`redone_seconds` subtracts what checkpoints saved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

log = logging.getLogger(__name__)

NOTICE = threading.Event()  # set in a worker process once it has been told it will be preempted
DEFAULT_GRACE_S = 30.0


class UnitPreempted(Exception):
    """A training unit stopped on a spot notice. ``state`` is its packed state at the last batch
    boundary (it resumes from there); ``record`` has ``start``, ``saved_at`` and ``end`` (wall
    clock) and ``batches`` done. Travels from the worker to the coordinator as the task's error;
    the message stays short (Dask truncates long ones and would drop the state)."""

    def __init__(self, model_id: str, state: bytes | None, record: Mapping[str, Any]) -> None:
        super().__init__(f"unit of {model_id} preempted after {record.get('batches', 0)} batches")
        self.model_id = model_id
        self.state = state
        self.record = dict(record)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.model_id, self.state, self.record))


def raise_notice() -> None:
    """Give this worker process the notice (``client.run`` it on the workers): its units stop at
    their next batch boundary and hand their state back, as on a spot notice."""
    NOTICE.set()


def clear_notice() -> None:
    """Withdraw the notice (the workers stay and train again)."""
    NOTICE.clear()


def notice_received() -> bool:
    """Whether this process was told that it is about to be preempted."""
    return NOTICE.is_set()


_UNITS_OUTSIDE_TASKS = [0]  # units this worker process runs outside Dask's tasks (MOP's service)
_UNITS_LOCK = threading.Lock()


@contextmanager
def unit_outside_tasks() -> Iterator[None]:
    """Count a unit this worker runs outside a Dask task while it runs: a worker leaving on a
    notice waits for it as for a task, so that its state goes back to the coordinator first."""
    with _UNITS_LOCK:
        _UNITS_OUTSIDE_TASKS[0] += 1
    try:
        yield
    finally:
        with _UNITS_LOCK:
            _UNITS_OUTSIDE_TASKS[0] -= 1


def _busy(worker: Any) -> bool:
    """Whether the worker still runs a task or a unit outside its tasks."""
    return bool(worker.state.executing_count > 0 or _UNITS_OUTSIDE_TASKS[0] > 0)


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
        _keep_the_nanny(worker)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and _busy(worker):
            await asyncio.sleep(0.1)
        if _busy(worker):
            log.warning("preemption: grace period over with a task still running; leaving anyway")
        else:
            # Hand results still held here (a unit that finished as the notice came) to another
            # worker first, so the coordinator can still fetch them; restart=True: under a nanny
            # (local clusters) a fresh worker process takes this one's place.
            left = max(1.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(
                    worker.close_gracefully(restart=True, reason="preempted (SIGTERM)"), left
                )
                self._exit_for_the_nanny(worker)
                return
            except Exception as exc:  # no worker to take the data, or out of time: just leave
                log.warning("preemption: graceful close failed (%s); leaving", exc)
        # nanny=False: under a nanny (local clusters) a fresh worker process takes this one's place
        await worker.close(nanny=False, executor_wait=False, reason="preempted (SIGTERM)")
        self._exit_for_the_nanny(worker)

    @staticmethod
    def _exit_for_the_nanny(worker: Any) -> None:
        """End the closed worker's process now under a nanny, so that the nanny starts the fresh
        one at once: a process that trained takes seconds to wind down (torch and Lightning
        teardown), and a LocalCluster gives up on a worker not back within 15 s
        (``distributed.deploy.lost-worker-timeout``)."""
        if getattr(worker, "nanny", None):
            logging.shutdown()
            os._exit(0)


def _keep_the_nanny(worker: Any) -> None:
    """Make every close of the leaving worker leave its nanny running, which then starts the
    fresh worker. Once the scheduler has removed the worker (the graceful close retires it
    first), a heartbeat already due is answered "missing" and Dask's worker closes itself *and
    its nanny*: no worker would take this one's place."""
    close = worker.close

    async def close_keeping_the_nanny(*args: Any, **kwargs: Any) -> Any:
        return await close(*args, **(kwargs | {"nanny": False}))

    worker.close = close_keeping_the_nanny


FINISHED_STATES = ("memory", "erred", "forgotten")


def lost_spans(story: Iterable[Sequence[Any]]) -> list[tuple[float, float]]:
    """When a task ran on a worker that did not finish it: ``(start, end)`` wall-clock spans from
    its scheduler story (transitions ``(key, start, finish, recommendations, stimulus, time)``).

    A span opens when the task goes to ``processing`` and is lost when it leaves ``processing``
    for anything but a result (the worker died, the task was rescheduled or cancelled). A span
    that ended in a result is lost too when the task runs again: the result died with its worker
    before it was fetched.
    """
    spans: list[tuple[float, float]] = []
    opened: float | None = None
    answered: tuple[float, float] | None = None
    for transition in story:
        before, after, at = str(transition[1]), str(transition[2]), float(transition[-1])
        if after == "processing" and before != "processing":
            if answered is not None:  # run again: the earlier result was lost
                spans.append(answered)
                answered = None
            opened = at
        elif before == "processing" and after != "processing":
            if opened is not None and after not in FINISHED_STATES:
                spans.append((opened, at))
            elif opened is not None and after == "memory":
                answered = (opened, at)
            opened = None
    return spans


def redone_seconds(spans: Iterable[tuple[float, float]], saved_at: Iterable[float] = ()) -> float:
    """Seconds of lost spans after the last checkpoint written within each: the work redone."""
    saves = sorted(saved_at)
    total = 0.0
    for start, end in spans:
        last = max([start, *(t for t in saves if start <= t <= end)])
        total += max(0.0, end - last)
    return total


def task_story(client: Any, key: str) -> list[tuple[Any, ...]]:
    """The scheduler's transitions of ``key`` (empty when they cannot be read). The scheduler keeps
    a bounded log (``distributed.admin.low-level-log-length``): a long-lost span may be gone."""
    try:
        story = client.run_on_scheduler(_scheduler_story, key)
    except Exception as exc:  # accounting must never fail a sweep
        log.debug("preemption: no scheduler story for %s: %s", key, exc)
        return []
    return [tuple(t) for t in story]


def _scheduler_story(key: str, dask_scheduler: Any = None) -> list[tuple[Any, ...]]:
    return [tuple(t) for t in dask_scheduler.story(key)]


GRACE_ENV = "MOPFLOW_PREEMPT_GRACE_S"


def register_preemption(client: Any, environ: Mapping[str, str] | None = None) -> float:
    """Install the SIGTERM (spot notice) handling on every worker, present and future; returns
    the grace period (``MOPFLOW_PREEMPT_GRACE_S``, default 30 s)."""
    raw = (os.environ if environ is None else environ).get(GRACE_ENV, "") or str(DEFAULT_GRACE_S)
    try:
        grace = float(raw)
    except ValueError:
        raise ValueError(f"{GRACE_ENV}={raw!r} is not a number of seconds") from None
    if not 0 < grace <= 3600:
        raise ValueError(f"{GRACE_ENV}={grace} must be in (0, 3600] seconds")
    client.register_plugin(PreemptionPlugin(grace))
    return grace
