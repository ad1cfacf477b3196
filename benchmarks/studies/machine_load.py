"""What else the machine ran while a benchmark measured: CPU time used by processes outside the
benchmark's own process tree, before and during a measurement.

A timed figure taken beside another load (a test suite, another benchmark) says more about that
load than about the code measured. :class:`LoadWatch` samples, every ``interval_s``, the machine's
busy CPU time (``psutil.cpu_times``: all processes) and the CPU time of every process in the
benchmark's tree (its root and all descendants, as they come and go); what the machine used beyond
the tree is the outside load. Its share of the machine (``cpus x wall`` seconds) decides whether the
measurement was clean (:data:`CLEAN_SHARE`).

A tree process that ends between two samples takes its last interval's CPU time with it, which
then counts as outside: the error is on the side of calling a measurement unclean.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

CLEAN_SHARE = 0.10  # outside load above this share of the machine: the measurement is not clean


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (every process, kernel included)."""
    import psutil

    times = psutil.cpu_times()
    return float(
        sum(v for k, v in times._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))
    )


def tree_cpu_s(root_pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``root_pid`` and each of its live descendants, by pid."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    out: dict[int, float] = {}
    for proc in procs:
        try:
            cpu = proc.cpu_times()
        except psutil.Error:
            continue
        out[proc.pid] = float(cpu.user + cpu.system)
    return out


@dataclass
class LoadWatch:
    """Outside CPU load while a block runs: ``with LoadWatch(root_pid) as watch: ...`` then
    :meth:`record`. ``before_s`` seconds are watched first, before the block's work starts, to
    record the load the measurement started into."""

    root_pid: int = field(default_factory=os.getpid)
    # Each sample lists every process on the machine (psutil's children scan), 2-7 ms of CPU
    # taken from the search's own process: at 4 a second about 2% of a core, which on 2 cores the
    # measured workers lose. The tree's processes live for the whole search, so once a second
    # loses nothing it needs.
    interval_s: float = 1.0
    before_s: float = 0.0
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    own_cpu_s: float = 0.0
    outside_cpu_s: float = 0.0
    wall_s: float = 0.0
    before: dict[str, float] = field(default_factory=dict)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> LoadWatch:
        if self.before_s > 0:
            self.before = self._measure_for(self.before_s)
        self._last = (time.monotonic(), busy_cpu_s(), tree_cpu_s(self.root_pid))
        self._started = self._last[0]
        self._thread = threading.Thread(target=self._watch, name="load-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self.wall_s = time.monotonic() - self._started

    def _measure_for(self, seconds: float) -> dict[str, float]:
        """The outside share over ``seconds`` of watching (nothing of the block runs yet)."""
        t0, busy0, tree0 = time.monotonic(), busy_cpu_s(), tree_cpu_s(self.root_pid)
        time.sleep(seconds)
        t1, busy1, tree1 = time.monotonic(), busy_cpu_s(), tree_cpu_s(self.root_pid)
        outside = max(0.0, (busy1 - busy0) - _tree_delta(tree0, tree1))
        return {"seconds": round(t1 - t0, 2), "outside_share": round(outside / (self.cpus * (t1 - t0)), 3)}

    def _watch(self) -> None:
        while not self._done.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now, busy, tree = time.monotonic(), busy_cpu_s(), tree_cpu_s(self.root_pid)
        _, last_busy, last_tree = self._last
        own = _tree_delta(last_tree, tree)
        self.own_cpu_s += own
        self.outside_cpu_s += max(0.0, (busy - last_busy) - own)
        self._last = (now, busy, tree)

    def record(self) -> dict[str, Any]:
        """The load record: load average, outside and own CPU seconds, the outside share of the
        machine during the block (and before it, when watched) and whether it was clean."""
        share = self.outside_cpu_s / (self.cpus * self.wall_s) if self.wall_s > 0 else 0.0
        return {
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "cpus": self.cpus,
            "wall_s": round(self.wall_s, 2),
            "own_cpu_s": round(self.own_cpu_s, 2),
            "outside_cpu_s": round(self.outside_cpu_s, 2),
            "outside_share": round(share, 3),
            "before": self.before,
            "clean": share <= CLEAN_SHARE and self.before.get("outside_share", 0.0) <= CLEAN_SHARE,
        }


def _tree_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the tree used between two samples: each live process's growth, all of a new
    process's time (it started in between)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items() if cpu >= before.get(pid, 0.0))
