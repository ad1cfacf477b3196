"""Accounting a run on volatile (spot) workers against a price trace.

A worker with bid ``b`` is active (running and billed at the current price) while the price is
``<= b``; above its bid it is preempted and costs nothing. Three accountings return a
:class:`~mopflow.training.volatile.run_account.RunAccount`:

* :func:`account_run`: a record of synchronous work (iterations or units, optionally on a worker
  schedule ``n_j``) replayed against the trace with each worker's bid;
* :func:`account_parallel_units`: task-parallel work (MOP units, trials), each worker on its own bid;
* :func:`account_intervals`: the real billed intervals of a replay on a live cluster.

Everything here is pure. Prices come from :mod:`mopflow.training.volatile.price_trace`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mopflow.training.volatile.price_trace import PriceTrace, repeat_trace
from mopflow.training.volatile.prices import SECONDS_PER_HOUR, PriceError, TraceExhaustedError
from mopflow.training.volatile.run_account import RunAccount


@dataclass(frozen=True)
class _Bill:
    worker_costs: tuple[float, ...]
    billed_worker_seconds: float
    idle_seconds: float


def bill_interval(trace: PriceTrace, bids: Sequence[float], start: float, stop: float) -> _Bill:
    """Cost of ``bids``' workers over ``[start, stop)``: each pays the price while it is <= its bid."""
    costs = [0.0] * len(bids)
    billed = idle = 0.0
    t = start
    while t < stop:
        i = trace.index_at(t)
        seg_stop = min(trace.segment_end(i), stop)
        length, price = seg_stop - t, trace.prices[i]
        active = 0
        for w, b in enumerate(bids):
            if price <= b:
                costs[w] += price * length / SECONDS_PER_HOUR
                active += 1
        billed += active * length
        if active == 0:
            idle += length
        t = seg_stop
    return _Bill(tuple(costs), billed, idle)


def _first_active(trace: PriceTrace, top_bid: float, t: float) -> float:
    """The first time >= t at which the price is <= the highest bid."""
    i = trace.index_at(t)
    while trace.prices[i] > top_bid:
        i += 1
        if i >= len(trace.prices):
            raise TraceExhaustedError(
                f"the price stays above every bid (highest {top_bid}) until the trace ends at {trace.end}"
            )
    return max(t, trace.times[i])


@dataclass(frozen=True)
class _Attempt:
    finished: bool
    stop: float
    survivors: int
    wasted: float


def _attempt(trace: PriceTrace, bids: Sequence[float], t: float, seconds: float) -> _Attempt:
    """One try at a unit of ``seconds`` started at t by the workers active then.

    A worker preempted mid-unit loses its partial work; the unit completes with the survivors
    (synchronous SGD with y_j active workers), or fails when every worker is preempted.
    """
    price = trace.prices[trace.index_at(t)]
    alive = [b for b in bids if price <= b]
    finish = t + seconds
    wasted = 0.0
    i = trace.index_at(t)
    while trace.segment_end(i) < finish:
        change = trace.segment_end(i)
        if change >= trace.end:
            raise TraceExhaustedError(
                f"the price trace ends at {trace.end} before a unit started at {t} finishes"
            )
        i += 1
        dropped = [b for b in alive if trace.prices[i] > b]
        wasted += len(dropped) * (change - t)
        alive = [b for b in alive if trace.prices[i] <= b]
        if not alive:
            return _Attempt(False, change, 0, wasted)
    if finish > trace.end:
        raise TraceExhaustedError(
            f"the price trace ends at {trace.end} before a unit started at {t} finishes"
        )
    return _Attempt(True, finish, len(alive), wasted)


def _check_run_inputs(
    bids: Sequence[float], work_seconds: Sequence[float], provisioned: Sequence[int] | None
) -> list[int]:
    """Refuse bad bids, durations or worker counts, naming the entry; returns the counts per unit."""
    if not bids:
        raise PriceError("bids: need at least one worker's bid")
    for w, b in enumerate(bids):
        if not b >= 0 or math.isnan(b):
            raise PriceError(f"bids[{w}]={b}: a bid must be a number >= 0")
    for j, d in enumerate(work_seconds):
        if not d > 0 or not math.isfinite(d):
            raise PriceError(f"work_seconds[{j}]={d}: a unit's duration must be finite and > 0")
    counts = list(provisioned) if provisioned is not None else [len(bids)] * len(work_seconds)
    if len(counts) != len(work_seconds):
        raise PriceError(f"provisioned has {len(counts)} entries for {len(work_seconds)} units")
    for j, n in enumerate(counts):
        if not 1 <= n <= len(bids):
            raise PriceError(f"provisioned[{j}]={n}: expected 1..{len(bids)} (the number of bids)")
    return counts


def account_run(
    trace: PriceTrace,
    bids: Sequence[float],
    work_seconds: Sequence[float],
    provisioned: Sequence[int] | None = None,
    start: float | None = None,
) -> RunAccount:
    """Replay a record of work on volatile workers against a price trace and account it.

    ``work_seconds[j]`` is how long unit j (an iteration, sub-epoch or trial) takes once started;
    ``bids[w]`` is worker w's bid; ``provisioned[j]`` (default: all) is how many workers (the first
    ones) are provisioned for unit j, as a worker schedule n_j gives. A unit starts when at least one
    provisioned worker is active (waiting is idle time), runs with the workers active at its start,
    and loses the partial work of any worker preempted before it ends; it is retried if all are.
    Workers are billed whenever they are provisioned and the price is <= their bid.
    """
    counts = _check_run_inputs(bids, work_seconds, provisioned)
    t0 = trace.start if start is None else float(start)
    t = t0
    costs = [0.0] * len(bids)
    billed = idle = useful = wasted = 0.0
    failed = 0
    used: list[int] = []
    for seconds, n in zip(work_seconds, counts, strict=True):
        unit_bids = list(bids[:n])
        unit_start = t
        while True:
            t = _first_active(trace, max(unit_bids), t)
            attempt = _attempt(trace, unit_bids, t, seconds)
            wasted += attempt.wasted
            t = attempt.stop
            if attempt.finished:
                useful += attempt.survivors * seconds
                used.append(attempt.survivors)
                break
            failed += 1
        bill = bill_interval(trace, unit_bids, unit_start, t)
        for w, c in enumerate(bill.worker_costs):
            costs[w] += c
        billed += bill.billed_worker_seconds
        idle += bill.idle_seconds
    return RunAccount.from_totals(
        worker_costs=costs,
        wall_seconds=t - t0,
        idle_seconds=idle,
        billed_worker_seconds=billed,
        useful_worker_seconds=useful,
        wasted_worker_seconds=wasted,
        units=len(used),
        failed_attempts=failed,
        workers_per_unit=used,
    )


def unit_durations(records: Sequence[Mapping[str, object]]) -> dict[str, list[float]]:
    """Per worker, the durations of its units in start order, from executor unit records.

    A record has ``worker``, ``start`` and ``end`` (seconds), as the MOP/task executors log them
    (``mop/units-epoch-*.json`` in MLflow).
    """
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for i, r in enumerate(records):
        try:
            worker, start, end = str(r["worker"]), float(r["start"]), float(r["end"])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise PriceError(f"records[{i}]={dict(r)!r}: expected worker, start and end (seconds)") from exc
        if not end > start:
            raise PriceError(f"records[{i}]: end {end} must come after start {start}")
        by_worker.setdefault(worker, []).append((start, end - start))
    return {w: [d for _, d in sorted(units)] for w, units in sorted(by_worker.items())}


def _idle_while_running(trace: PriceTrace, workers: Sequence[tuple[float, float]], t0: float) -> float:
    """Time in [t0, last end) when no worker still running (bid, end) is active."""
    stops = sorted({end for _, end in workers})
    idle, t = 0.0, t0
    while stops and t < stops[-1]:
        i = trace.index_at(t)
        piece_end = min([trace.segment_end(i)] + [e for e in stops if e > t])
        price = trace.prices[i]
        if not any(price <= bid and t < end for bid, end in workers):
            idle += piece_end - t
        t = piece_end
    return idle


def account_parallel_units(
    trace: PriceTrace,
    bids: Mapping[str, float],
    work: Mapping[str, Sequence[float]],
    start: float | None = None,
) -> RunAccount:
    """Account task-parallel work (MOP units, trials): each worker runs its own units on its own bid.

    ``work[w]`` is worker w's unit durations (see :func:`unit_durations`); a preempted worker loses
    its current unit's progress and redoes the unit when the price is back under its bid. The run ends
    when the last worker is done; idle time is time when no worker still running is active.
    """
    missing = sorted(set(work) - set(bids))
    if missing:
        raise PriceError(f"no bid for worker(s) {missing}; bids are given for {sorted(bids)}")
    if not work:
        raise PriceError("work: need at least one worker's units")
    t0 = trace.start if start is None else float(start)
    names = sorted(work)
    accounts = [account_run(trace, [bids[w]], work[w], start=t0) for w in names]
    wall = max(a.wall_seconds for a in accounts)
    idle = _idle_while_running(
        trace, [(bids[w], t0 + a.wall_seconds) for w, a in zip(names, accounts, strict=True)], t0
    )
    return RunAccount.from_totals(
        worker_costs=[a.cost for a in accounts],
        wall_seconds=wall,
        idle_seconds=idle,
        billed_worker_seconds=sum(a.billed_worker_seconds for a in accounts),
        useful_worker_seconds=sum(a.useful_worker_seconds for a in accounts),
        wasted_worker_seconds=sum(a.wasted_worker_seconds for a in accounts),
        units=sum(a.units for a in accounts),
        failed_attempts=sum(a.failed_attempts for a in accounts),
        workers_per_unit=[y for a in accounts for y in a.workers_per_unit],
    )


def on_demand_account(price: float, workers: int, work_seconds: Sequence[float]) -> RunAccount:
    """The same work on ``workers`` on-demand workers at a fixed ``price``: never preempted, never idle."""
    if not price >= 0 or not math.isfinite(price):
        raise PriceError(f"on-demand price must be finite and >= 0, got {price}")
    if workers < 1:
        raise PriceError(f"workers must be >= 1, got {workers}")
    total = float(sum(work_seconds))
    trace = PriceTrace((0.0,), (price,), total + 1.0)
    return account_run(trace, [price] * workers, work_seconds)


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals as disjoint intervals, in order."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def account_intervals(
    trace: PriceTrace,
    billed: Mapping[str, Sequence[tuple[float, float]]],
    start: float,
    stop: float,
    useful_seconds: float = 0.0,
    wasted_seconds: float = 0.0,
    units: int = 0,
    interrupted: int = 0,
) -> RunAccount:
    """Account a run from each worker's real billed intervals (trace seconds, within
    ``[start, stop]``): a worker pays the price while billed, whatever its bid."""
    if not stop >= start:
        raise PriceError(f"stop {stop} must not come before start {start}")
    if not billed:
        raise PriceError("billed: need at least one worker's intervals")
    full = repeat_trace(trace, stop + 1e-9)
    costs: list[float] = []
    total = 0.0
    for name in sorted(billed):
        cost = 0.0
        for s, e in billed[name]:
            if not start - 1e-9 <= s <= e <= stop + 1e-9:
                raise PriceError(f"worker {name}: interval ({s}, {e}) is outside the run [{start}, {stop}]")
            if e > s:
                cost += bill_interval(full, [math.inf], max(s, start), min(e, stop)).worker_costs[0]
                total += e - s
        costs.append(cost)
    covered = sum(e - s for s, e in _merged([iv for ivs in billed.values() for iv in ivs]))
    wall = stop - start
    return RunAccount.from_totals(
        worker_costs=costs,
        wall_seconds=wall,
        idle_seconds=max(0.0, wall - covered),
        billed_worker_seconds=total,
        useful_worker_seconds=useful_seconds,
        wasted_worker_seconds=wasted_seconds,
        units=units,
        failed_attempts=interrupted,
    )
