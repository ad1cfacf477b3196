"""How much memory a stage held: the peak resident set of this process while it ran.

A daemon thread samples the process's RSS (psutil) every ``interval_s`` while a
:class:`PeakMemory` block runs; :func:`peak_memory_logged` (or the :func:`measured_stage`
decorator) wraps a stage with one and logs the peak when the stage ends, failed or not. (``ru_maxrss`` would give the whole process's
lifetime peak, not the stage's: one process runs every task under ``mopflow run``.)
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar

import psutil

log = logging.getLogger(__name__)

MB = 1024 * 1024
F = TypeVar("F", bound=Callable[..., Any])


class PeakMemory:
    """The peak resident memory of this process during a ``with`` block (bytes)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_bytes = 0
        self.peak_bytes = 0

    def sample(self) -> int:
        """Take one sample now; the RSS it saw."""
        rss = int(self._process.memory_info().rss)
        self.peak_bytes = max(self.peak_bytes, rss)
        return rss

    def __enter__(self) -> PeakMemory:
        self.start_bytes = self.sample()
        self._thread = threading.Thread(target=self._watch, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(self.interval_s):
            self.sample()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


@contextmanager
def peak_memory_logged(stage: str) -> Iterator[PeakMemory]:
    """Log the peak resident memory of this process while the block runs (failed or not)."""
    with PeakMemory() as peak:
        try:
            yield peak
        finally:
            peak.sample()
            log.info(
                "%s: peak resident memory of the task process %.0f MB (%.0f MB when it started)",
                stage,
                peak.peak_bytes / MB,
                peak.start_bytes / MB,
            )


def measured_stage(stage: str) -> Callable[[F], F]:
    """Log the peak resident memory of this process while the decorated stage function runs."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with peak_memory_logged(stage):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
