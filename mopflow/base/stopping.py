"""A pipeline run asked to stop (SIGINT, SIGTERM): one flag per process, read by the stages.

``mopflow run`` owns the signals while the DAG runs (``mopflow.infra.cli.local_runs``): the first one sets
the flag and raises :class:`PipelineStopped` where the run is; the stages then end their MLflow
runs ``KILLED`` (not ``FAILED``) and no task is retried. Nothing here imports Airflow.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_STOP = threading.Event()
_SIGNAL: list[int] = []
_COOPERATIVE = [0]  # how many sections in progress stop on their own when the flag is set


class PipelineStopped(Exception):
    """The run was asked to stop; it can be resumed (``mopflow run --resume``)."""


def request_stop(signum: int) -> None:
    """Record that the run was asked to stop by signal ``signum``."""
    if not _STOP.is_set():
        _SIGNAL.append(signum)
    _STOP.set()


def stop_requested() -> bool:
    """Whether this process's run was asked to stop."""
    return _STOP.is_set()


def stop_signal() -> int | None:
    """The signal that asked the run to stop (None: not asked)."""
    return _SIGNAL[0] if _SIGNAL else None


def raise_if_stopped() -> None:
    """Raise :class:`PipelineStopped` once the run was asked to stop (before a stage starts)."""
    if _STOP.is_set():
        name = signal.Signals(stop_signal() or signal.SIGINT).name
        raise PipelineStopped(f"the run was stopped by {name}")


@contextlib.contextmanager
def stops_cooperatively() -> Iterator[None]:
    """Mark a section that watches :func:`stop_requested` itself and stops cleanly (for example
    after its training units checkpointed at their next batch): a signal then only sets the
    flag instead of interrupting the section where it is."""
    _COOPERATIVE[0] += 1
    try:
        yield
    finally:
        _COOPERATIVE[0] -= 1


def cooperative() -> bool:
    """Whether a section that stops on its own is in progress."""
    return _COOPERATIVE[0] > 0


def ended_status() -> str:
    """The MLflow status of a run that ended without finishing: KILLED if stopped, else FAILED."""
    return "KILLED" if _STOP.is_set() else "FAILED"


def reset() -> None:
    """Forget a stop request (a new run in the same process)."""
    _STOP.clear()
    _SIGNAL.clear()
