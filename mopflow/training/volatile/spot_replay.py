"""Replay a spot price trace against a real Dask LocalCluster (issue #8).

Each worker of the cluster has a bid. A background thread walks the trace, time-compressed
(``speed`` trace seconds per real second; past its end the trace repeats from its start), and when
the price rises above a worker's bid it gives that worker the spot notice: SIGTERM to its worker
process, so :class:`~mopflow.training.volatile.preempt.PreemptionPlugin` checkpoints the running trial and the
worker leaves. The worker's nanny is told first that the exit is final (``close_gracefully``), so
no fresh process takes its place; once the process is gone the worker is removed from the
cluster's spec. When the price is back at or under the bid the worker is started again (a new
process, a new address) under the same name. A worker that has not left ``kill_after_s`` after its
notice is killed.

Every worker's *billed* intervals are recorded: from its start (the instance is requested) until
its process is gone (the instance is returned); the run is accounted over those real intervals
(:func:`mopflow.training.volatile.cost.account_intervals`, in trace time) into a
:class:`~mopflow.training.volatile.spot_report.SpotReport`, logged with :func:`mopflow.training.volatile.spot_report.log_replay`:

* cost: the trace's price integrated over each billed interval;
* idle: time with no worker billed (the sweep waits for prices to fall);
* useful worker-time: compute time of tasks that finished (the scheduler's task stream);
* wasted worker-time: time between a notice and the worker's exit (checkpointing and leaving;
  work before the notice is kept by the notice checkpoint);
* ``spot_failed_attempts``: notices that interrupted a running task.

The account's ideal counterpart, :func:`mopflow.training.volatile.cost.bill_interval` over the same span with the bids
(workers switching at the exact price changes), is reported as ``ideal_cost``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mopflow.training.compute.workers import cluster_workers
from mopflow.training.volatile.cost import account_intervals, bill_interval
from mopflow.training.volatile.price_trace import PriceTrace, price_at, repeat_trace
from mopflow.training.volatile.prices import SECONDS_PER_HOUR, PriceError
from mopflow.training.volatile.run_account import RunAccount
from mopflow.training.volatile.spot_report import EventKind, SpotEvent, SpotReport, notice_to_exit_seconds

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    name: Any  # the LocalCluster's worker name (an int for LocalCluster)
    bid: float
    state: Literal["up", "stopping", "down", "starting"] = "up"
    opened: float | None = None  # wall time the current billed interval opened
    pid: int | None = None
    address: str = ""
    notice_at: float = 0.0
    intervals: list[tuple[float, float]] = field(default_factory=list)


def _process_gone(pid: int | None) -> bool:
    if pid is None:
        return True
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _useful_compute_seconds(records: Iterable[Mapping[str, Any]], since: float) -> float:
    """Compute time (wall seconds) of the tasks that finished, from the scheduler's task stream."""
    return sum(
        ss["stop"] - ss["start"]
        for r in records
        if r.get("status") == "OK"
        for ss in r.get("startstops", ())
        if ss.get("action") == "compute" and ss["start"] >= since
    )


class SpotReplay:
    """Replays ``trace`` against ``cluster`` (a ``LocalCluster`` of nanny-managed worker processes)
    with ``bids[i]`` for the i-th worker (in the cluster's spec order). ``start()``, run the work,
    ``stop()`` returns the :class:`SpotReport`."""

    def __init__(
        self,
        cluster: Any,
        client: Any,
        trace: PriceTrace,
        bids: Sequence[float],
        speed: float,
        kill_after_s: float = 45.0,
        poll_s: float = 0.05,
        source: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        names = list(cluster.worker_spec)
        if len(bids) != len(names):
            raise PriceError(
                f"spot_bids has {len(bids)} bid(s) for a LocalCluster of {len(names)} worker(s); "
                "give one bid per worker (MOPFLOW_DASK_WORKERS sets the count)"
            )
        for i, b in enumerate(bids):
            if not 0 <= b < math.inf:
                raise PriceError(f"spot_bids[{i}]={b}: a bid must be a finite number >= 0")
        if not speed > 0 or not math.isfinite(speed):
            raise PriceError(f"speed must be a finite number of trace seconds per second > 0, got {speed}")
        if max(bids) < min(trace.prices):
            raise PriceError(
                f"every bid (highest {max(bids)}) is below the trace's lowest price {min(trace.prices)}: "
                "no worker would ever run"
            )
        self.cluster, self.client, self.trace, self.speed = cluster, client, trace, float(speed)
        self.kill_after_s, self.poll_s, self.source, self.clock = kill_after_s, poll_s, source, clock
        self._spec = {name: copy.copy(cluster.worker_spec[name]) for name in names}
        self._workers = [_Worker(name, float(b)) for name, b in zip(names, bids, strict=True)]
        self._events: list[SpotEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._stream: Any = None
        self.error: BaseException | None = None

    # -- time ---------------------------------------------------------------------------------
    def trace_time(self, wall: float) -> float:
        return self.trace.start + (wall - self._t0) * self.speed

    def _event(self, w: _Worker, kind: EventKind, wall: float, price: float, busy: bool = False) -> None:
        event = SpotEvent(str(w.name), kind, wall, self.trace_time(wall), price, w.address, w.pid, busy)
        with self._lock:
            self._events.append(event)
        log.info(
            "spot: worker %s %s at trace %.0fs (price %g, bid %g)%s",
            w.name,
            kind,
            event.trace_t - self.trace.start,
            price,
            w.bid,
            f" {w.address} pid {w.pid}" if kind == "joined" else "",
        )

    # -- the cluster --------------------------------------------------------------------------
    def _nanny(self, w: _Worker) -> Any:
        return self.cluster.workers.get(w.name)

    def _joined(self, w: _Worker) -> bool:
        nanny = self._nanny(w)
        if nanny is None or nanny.status.name != "running" or not nanny.worker_address:
            return False
        if nanny.worker_address not in cluster_workers(self.client):
            return False
        w.address, w.pid = str(nanny.worker_address), nanny.pid
        return True

    async def _set_spec(self, name: Any, spec: dict[str, Any] | None) -> None:
        # on the cluster's event loop: the spec is read there
        if spec is None:
            self.cluster.worker_spec.pop(name, None)
        else:
            self.cluster.worker_spec[name] = copy.copy(spec)
        self.cluster._correct_state()

    async def _final_exit(self, nanny: Any) -> None:
        nanny.close_gracefully(reason="spot price above bid")  # the nanny will not restart it

    def _notice(self, w: _Worker, now: float, price: float) -> None:
        nanny = self._nanny(w)
        busy = False
        if w.address:
            try:
                busy = bool(self.client.processing(workers=[w.address]).get(w.address))
            except Exception:  # the worker is leaving anyway
                busy = False
        if nanny is not None:
            self.cluster.sync(self._final_exit, nanny)
        w.state, w.notice_at = "stopping", now
        self._event(w, "notice", now, price, busy)
        if w.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)

    def _gone(self, w: _Worker, now: float, price: float, killed: bool) -> None:
        self.cluster.sync(self._set_spec, w.name, None)
        if killed:
            self._event(w, "killed", now, price)
        if w.opened is not None:
            w.intervals.append((w.opened, now))
        w.opened, w.state = None, "down"
        self._event(w, "exit", now, price)
        w.address, w.pid = "", None

    def _start_worker(self, w: _Worker, now: float, price: float) -> None:
        self.cluster.sync(self._set_spec, w.name, self._spec[w.name])
        w.state, w.opened = "starting", now
        self._event(w, "start", now, price)

    def step(self, now: float) -> float:
        """Act on the price at ``now``; returns the seconds until the price next changes."""
        price, left = price_at(self.trace, self.trace_time(now))
        for w in self._workers:
            want = price <= w.bid
            if w.state == "stopping":
                if _process_gone(w.pid):
                    self._gone(w, now, price, killed=False)
                elif now - w.notice_at > self.kill_after_s:
                    log.warning(
                        "spot: worker %s did not leave %.0fs after its notice; killing it",
                        w.name,
                        self.kill_after_s,
                    )
                    self._gone(w, self.clock(), price, killed=True)
            elif w.state == "starting":
                if self._joined(w):
                    w.state = "up"
                    self._event(w, "joined", now, price)
            elif w.state == "up" and not want:
                self._notice(w, now, price)
            elif w.state == "down" and want:
                self._start_worker(w, now, price)
        return left / self.speed

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.step(self.clock())
            except Exception as exc:  # keep the sweep alive; the report says what went wrong
                log.exception("spot: replay stopped: %s", exc)
                self.error = exc
                return
            self._stop.wait(min(self.poll_s, max(wait, 0.001)))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start billing every present worker now and replay the trace in a background thread."""
        from distributed import get_task_stream

        self._t0 = self.clock()
        self._stream = get_task_stream(client=self.client)
        self._stream.__enter__()
        price, _ = price_at(self.trace, self.trace.start)
        for w in self._workers:
            if not self._joined(w):
                raise PriceError(f"worker {w.name} of the LocalCluster is not running; cannot replay prices")
            w.opened = self._t0
            self._event(w, "joined", self._t0, price)
        self._thread = threading.Thread(target=self._loop, name="spot-replay", daemon=True)
        self._thread.start()

    def stop(self, restore: bool = True, restore_timeout_s: float = 120.0) -> SpotReport:
        """Stop replaying, account the run; with ``restore``, bring every stopped worker back."""
        if self._thread is None:
            raise RuntimeError("the replay was never started")
        self._stop.set()
        self._thread.join(timeout=30)
        stop = self.clock()
        self._stream.__exit__(None, None, None)
        records = list(self._stream.data)
        price, _ = price_at(self.trace, self.trace_time(stop))
        for w in self._workers:  # still running: billed until the run's end
            if w.opened is not None:
                w.intervals.append((w.opened, stop))
                w.opened = None
        billed = {
            str(w.name): [(self.trace_time(s), self.trace_time(e)) for s, e in w.intervals]
            for w in self._workers
        }
        account = self._account(billed, records, stop)
        ideal = self._ideal_cost(self.trace_time(stop))
        if restore:
            self._restore(price, restore_timeout_s)
        report = SpotReport(
            workers=tuple(str(w.name) for w in self._workers),
            bids=tuple(w.bid for w in self._workers),
            speed=self.speed,
            trace_start=self.trace.start,
            wall_start=self._t0,
            wall_stop=stop,
            intervals={k: tuple(v) for k, v in billed.items()},
            events=tuple(self._events),
            account=account,
            ideal_cost=ideal,
            source=self.source,
            error="" if self.error is None else f"{type(self.error).__name__}: {self.error}",
        )
        log.info(
            "spot: replay done: cost %.4f (ideal %.4f), %.2f worker-h billed, idle %.2f h, %d notice(s)",
            account.cost,
            ideal,
            account.billed_worker_seconds / SECONDS_PER_HOUR,
            account.idle_seconds / SECONDS_PER_HOUR,
            report.count("notice"),
        )
        return report

    def _account(
        self,
        billed: Mapping[str, Sequence[tuple[float, float]]],
        records: Sequence[Mapping[str, Any]],
        stop: float,
    ) -> RunAccount:
        """The run's account over the billed intervals (trace seconds); useful and wasted worker-time
        are measured in wall seconds and scaled to trace seconds."""
        return account_intervals(
            self.trace,
            billed,
            self.trace.start,
            self.trace_time(stop),
            useful_seconds=_useful_compute_seconds(records, self._t0) * self.speed,
            wasted_seconds=notice_to_exit_seconds(self._events, stop) * self.speed,
            units=sum(1 for r in records if r.get("status") == "OK"),
            interrupted=sum(1 for e in self._events if e.kind == "notice" and e.busy),
        )

    def _ideal_cost(self, t1: float) -> float:
        """The bids' bill from the trace's start to ``t1``, workers switching exactly at price changes."""
        t0 = self.trace.start
        full = repeat_trace(self.trace, t1 + 1e-9)
        return (
            sum(bill_interval(full, [w.bid for w in self._workers], t0, t1).worker_costs) if t1 > t0 else 0.0
        )

    def _restore(self, price: float, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            if w.state in ("stopping", "down"):
                while w.state == "stopping" and not _process_gone(w.pid) and time.monotonic() < deadline:
                    time.sleep(self.poll_s)
                if w.state == "stopping":
                    self.cluster.sync(self._set_spec, w.name, None)
                    w.state = "down"
                    self._event(w, "exit", self.clock(), price)  # after the run: not billed
                self.cluster.sync(self._set_spec, w.name, self._spec[w.name])
                w.state = "starting"
        while any(w.state == "starting" for w in self._workers) and time.monotonic() < deadline:
            for w in self._workers:
                if w.state == "starting" and self._joined(w):
                    w.state = "up"
                    self._event(w, "joined", self.clock(), price)  # after the run: not billed
            time.sleep(self.poll_s)
