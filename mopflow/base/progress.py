"""Progress of a pipeline run as events, and the view `mopflow run` shows of them.

The stages publish small events (:func:`publish`: a stage starts, a trial finishes, an epoch
ends) to whoever subscribed in this process; without a subscriber (an Airflow worker) they
cost a function call. :class:`ProgressView` subscribes for the length of a run and shows them
(:mod:`~mopflow.base.progress_state` adds them up, :mod:`~mopflow.base.progress_view`
draws them): a bar per stage with each finished trial above the bars on a terminal, one plain
line per event otherwise.

The events and their fields:

- ``stage``: ``stage`` (its name) starts, or starts again on a retry;
- ``search``: ``total`` trials to finish, ``finished`` already (a resumed study's); with
  ``extra``, ``complete`` and ``needed`` when the total grows by trials the ensemble needs;
- ``epoch``: ``model`` trained ``epoch`` (from 0) of ``epochs``, ``val_acc``;
- ``trial``: trial ``number`` of ``model`` and ``family`` finished in ``state`` after ``epoch``
  of ``epochs`` epochs with ``value``; ``continues`` names the trial a promotion went on from;
  ``finished`` of ``total`` trials;
- ``distill_epoch``: the student trained ``epoch`` (from 1) of ``epochs``;
- ``stop``: ``signal`` asked the run to stop, within ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from mopflow.base.progress_state import Event, RunProgress

_SUBSCRIBERS: list[Callable[[Event], None]] = []
_LOCK = threading.Lock()


def publish(kind: str, **fields: Any) -> None:
    """Tell the subscribers (if any) that ``kind`` happened; never raises."""
    for subscriber in list(_SUBSCRIBERS):
        try:
            subscriber({"kind": kind, **fields})
        except Exception:  # a view must never break the run
            continue


def subscribe(subscriber: Callable[[Event], None]) -> Callable[[], None]:
    """Receive every event from now on; returns the function that unsubscribes."""
    with _LOCK:
        _SUBSCRIBERS.append(subscriber)

    def unsubscribe() -> None:
        with _LOCK:
            if subscriber in _SUBSCRIBERS:
                _SUBSCRIBERS.remove(subscriber)

    return unsubscribe


class ProgressView:
    """Shows a run's progress on ``out`` while the block runs: bars on a terminal (``live``),
    plain lines otherwise. ``console`` and ``clock`` (monotonic seconds) default to ``out`` and
    :func:`time.monotonic`."""

    def __init__(
        self, out: TextIO, live: bool, console: Any = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.out, self.live, self.console, self.clock = out, live, console, clock
        self.state = RunProgress()
        self.started = clock()
        self._lock = threading.RLock()  # a signal handler may publish while this thread shows an event
        self._view: Any = None
        self._unsubscribe: Callable[[], None] | None = None

    def __enter__(self) -> ProgressView:
        from mopflow.base.progress_view import PlainView, TerminalView

        if self.live:
            from rich.console import Console

            self._view = TerminalView(self.console or Console(file=self.out), self.clock)
        else:
            self._view = PlainView(self.out, self.started)
        self._view.start()
        self._unsubscribe = subscribe(self.on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._unsubscribe:
            self._unsubscribe()
        with self._lock:
            self._view.close(self.state, self.clock())

    def on_event(self, event: Event) -> None:
        with self._lock:
            now = self.clock()
            self._view.show(self.state.apply(event, now), self.state, now)
