"""Progress of a pipeline run as events, and the concise view `mopflow run` shows of them.

The stages publish small events (:func:`publish`: a stage starts, a trial finishes, an epoch
ends) to whoever subscribed in this process; without a subscriber (an Airflow worker) they
cost a function call. :class:`ProgressView` turns them into what a person follows: the stage
running, trials finished out of the budget with the best validation accuracy so far, the epochs
of the running trials and the elapsed time: a live panel on a terminal (rich), plain lines
otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

Event = dict[str, Any]
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


@dataclass
class RunProgress:
    """What is known of a run so far (pure: updated by :meth:`apply`)."""

    stage: str = "starting"
    trials_total: int = 0
    trials_finished: int = 0
    best_val_acc: float | None = None
    running: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (epoch, epochs)
    distill: tuple[int, int] | None = None

    def apply(self, event: Event) -> bool:
        """Take one event; whether it is worth a plain line of its own."""
        kind = event["kind"]
        if kind == "stage":
            self.stage = str(event["stage"])
            return True
        if kind == "search":
            self.trials_total = int(event["total"])
            self.trials_finished = int(event.get("finished", 0))
            return False
        if kind == "epoch":
            self.running[str(event["model"])] = (int(event["epoch"]) + 1, int(event["epochs"]))
            return False
        if kind == "trial":
            self.running.pop(str(event["model"]), None)
            self.trials_finished = int(event["finished"])
            self.trials_total = int(event.get("total") or self.trials_total)
            value = event.get("value")
            if value is not None and (self.best_val_acc is None or value > self.best_val_acc):
                self.best_val_acc = float(value)
            return True
        if kind == "distill_epoch":
            self.distill = (int(event["epoch"]), int(event["epochs"]))
            return False
        return False

    def line(self, elapsed_s: float) -> str:
        """One line: stage, trials, best accuracy, running trials' epochs, elapsed time."""
        parts = [f"[{_clock(elapsed_s)}] {self.stage}"]
        if self.trials_total and self.stage in ("search", "ensemble", "distill", "register"):
            best = f", best val_acc {self.best_val_acc:.4f}" if self.best_val_acc is not None else ""
            parts.append(f"trials {self.trials_finished}/{self.trials_total}{best}")
        if self.stage == "search" and self.running:
            shown = sorted(self.running.items())[:4]
            running = ", ".join(f"{m} epoch {e}/{n}" for m, (e, n) in shown)
            more = f" (+{len(self.running) - len(shown)})" if len(self.running) > len(shown) else ""
            parts.append(f"running: {running}{more}")
        if self.stage == "distill" and self.distill:
            parts.append(f"student epoch {self.distill[0]}/{self.distill[1]}")
        return " · ".join(parts)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


class ProgressView:
    """Shows a run's progress on ``out``: a live line on a terminal, plain lines otherwise."""

    def __init__(self, out: TextIO, live: bool) -> None:
        self.out, self.live = out, live
        self.progress = RunProgress()
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._live: Any = None
        self._unsubscribe: Callable[[], None] | None = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> ProgressView:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                "", console=Console(file=self.out), refresh_per_second=4, transient=False
            ).__enter__()
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        self._unsubscribe = subscribe(self.on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._unsubscribe:
            self._unsubscribe()
        self._stop.set()
        with self._lock:
            if self._live is not None:
                self._live.update(self.progress.line(time.monotonic() - self.started))
                self._live.__exit__(None, None, None)

    def _tick(self) -> None:  # the elapsed time moves even when no event comes
        while not self._stop.wait(1.0):
            with self._lock:
                if self._live is not None:
                    self._live.update(self.progress.line(time.monotonic() - self.started))

    def on_event(self, event: Event) -> None:
        with self._lock:
            notable = self.progress.apply(event)
            text = self.progress.line(time.monotonic() - self.started)
            if self._live is not None:
                self._live.update(text)
            elif notable:
                print(text, file=self.out, flush=True)
