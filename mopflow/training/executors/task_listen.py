"""Hearing ``task``'s chains' epochs: a Dask event on
:data:`~mopflow.training.executors.chains.EPOCH_TOPIC` carries the records of one or more of a
chain's epochs, and the scheduler stamps it with the worker it came from; it goes to the inbox
of the run in this process whose id it carries."""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

from mopflow.training.executors.chains import EPOCH_TOPIC


class ListeningRun(Protocol):
    """What of a task run (``task_run.TaskRun``) hearing its epochs touches."""

    run_id: str
    inbox: queue.Queue[tuple[str, Any]]


_LISTENING: dict[str, ListeningRun] = {}  # run id -> the run in this process that hears its chains
_LISTENING_LOCK = threading.Lock()


def listen(client: Any, run: ListeningRun) -> None:
    """Hear ``run``'s chains' epochs as they end (events on :data:`EPOCH_TOPIC`, one handler per
    client for every run in this process)."""
    with _LISTENING_LOCK:
        _LISTENING[run.run_id] = run
    client.subscribe_topic(EPOCH_TOPIC, _hear)


def stop_listening(run: ListeningRun) -> None:
    """``run`` is over: its late events are dropped."""
    with _LISTENING_LOCK:
        _LISTENING.pop(run.run_id, None)


def _hear(event: tuple[float, dict[str, Any]]) -> None:
    """The topic's handler (on the client's thread): the epochs a chain told, to its run."""
    message = event[1]
    with _LISTENING_LOCK:
        run = _LISTENING.get(str(message.get("run", "")))
    if run is not None:
        run.inbox.put(("epochs", (list(message["records"]), str(message.get("worker", "")))))
