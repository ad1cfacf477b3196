"""DDP trials side by side on gangs of workers, against one trial at a time: the strategies
benchmark's ``ddp_trials`` and ``ddp_one_at_a_time`` rows (``benchmarks/strategies.py``).

Both rows run ``DDPExecutor`` with world size ``WORLD_SIZE`` on a fresh LocalCluster of
``WORKERS`` single-thread workers: ``ddp_trials`` trains as many trials at once as gangs fit
(``floor(WORKERS / WORLD_SIZE)``), ``ddp_one_at_a_time`` one (``max_trials=1``). What they are
compared by is each worker's busy time: the sum, over the executor's records whose gang includes
the worker, of the record's span clipped to the sweep's wall interval; a worker's idle fraction is
``1 - busy / wall``. The target is judged while trials wait, from the sweep's start until its last
trial starts (``worker_idle_waiting``): after that, a gang whose trials are done has nothing left to
take while the other finishes, which no scheduler avoids. It is a scheduling measure (how long a worker held no rank), so it keeps its
meaning on a machine with fewer cores than workers, where the wall times do not.

The ratio of the rows' busy worker fractions, ``(1 - mean idle) / (1 - mean idle one at a time)``,
is the throughput gain concurrent trials give where every worker has a core of its own; on a
machine with fewer cores than workers the ranks share the cores and that gain is not measured.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

WORKERS = 4
WORLD_SIZE = 2
TARGET_MAX_IDLE = 0.10
# row -> DDPExecutor's max_trials (None: as many trials at once as gangs fit)
ROWS: dict[str, int | None] = {"ddp_trials": None, "ddp_one_at_a_time": 1}


def trials_at_once(row: str, workers: int = WORKERS, world_size: int = WORLD_SIZE) -> int:
    """How many trials the row trains at once on ``workers`` workers of ``world_size`` ranks."""
    fit = workers // world_size
    limit = ROWS[row]
    return fit if limit is None else min(fit, limit)


def gang_of(record: Mapping[str, Any]) -> list[str]:
    """The worker addresses of a DDP record's gang (``"addr1,addr2"``)."""
    return [w for w in str(record["worker"]).split(",") if w]


def busy_seconds(
    records: Iterable[Mapping[str, Any]], workers: Iterable[str], start: float, end: float
) -> dict[str, float]:
    """Per worker: the summed spans of the records whose gang includes it, each clipped to
    ``[start, end]`` (``time.time()`` values); workers in no record are 0."""
    busy = dict.fromkeys(workers, 0.0)
    for record in records:
        span = max(0.0, min(float(record["end"]), end) - max(float(record["start"]), start))
        for worker in gang_of(record):
            busy[worker] = busy.get(worker, 0.0) + span
    return busy


def _idle(
    records: Sequence[Mapping[str, Any]], workers: list[str], start: float, end: float
) -> dict[str, float]:
    wall = max(end - start, 1e-9)
    return {w: max(0.0, 1.0 - b / wall) for w, b in busy_seconds(records, workers, start, end).items()}


def idle_figures(
    records: Sequence[Mapping[str, Any]], workers: Iterable[str], start: float, end: float
) -> dict[str, Any]:
    """The sweep's wall interval, each worker's busy seconds and idle fraction
    (``1 - busy / wall``, at least 0), the largest and mean idle fraction, and the same while
    trials wait (from ``start`` until the last attempt starts: ``*_waiting``)."""
    names = list(workers)
    idle = _idle(records, names, start, end)
    last_start = max((float(r["start"]) for r in records), default=start)
    waiting = _idle(records, names, start, last_start) if last_start > start else {}
    return {
        "sweep_s": end - start,
        "waiting_s": last_start - start,
        "worker_busy_s": busy_seconds(records, names, start, end),
        "worker_idle": idle,
        "worker_idle_max": max(idle.values()) if idle else None,
        "worker_idle_mean": statistics.fmean(idle.values()) if idle else None,
        "worker_idle_waiting": waiting,
        "worker_idle_waiting_max": max(waiting.values()) if waiting else None,
    }


def attempts(records: Iterable[Mapping[str, Any]], start: float) -> list[dict[str, Any]]:
    """The executor's job attempts in the order they ended: model, gang, start and end in seconds
    from ``start`` and epochs reported (a trial restarted after a lost rank has more than one)."""
    return [
        {
            "model": r["model"],
            "gang": gang_of(r),
            "start_s": round(float(r["start"]) - start, 3),
            "end_s": round(float(r["end"]) - start, 3),
            "epochs": r.get("epochs"),
        }
        for r in records
    ]


def expected_gain(concurrent_idle_mean: float | None, one_idle_mean: float | None) -> float | None:
    """The throughput of concurrent trials over one at a time where every worker has a core:
    the ratio of their busy worker fractions; None when a figure is missing or nothing was busy."""
    if concurrent_idle_mean is None or one_idle_mean is None or one_idle_mean >= 1.0:
        return None
    return (1.0 - concurrent_idle_mean) / (1.0 - one_idle_mean)


def targets(
    concurrent: Mapping[str, Any] | None, one: Mapping[str, Any] | None, cpus: int | None = None
) -> list[dict[str, Any]]:
    """The target lines: the concurrent row's largest worker idle fraction while trials wait
    against ``TARGET_MAX_IDLE`` (PASS/FAIL), the one-at-a-time row's beside it (MEASURED), and the
    throughput gain their busy fractions imply (EXPECTED: where every worker has a core)."""
    cpus = cpus or os.cpu_count() or 1
    idle = concurrent.get("worker_idle_waiting_max") if concurrent else None
    one_idle = one.get("worker_idle_waiting_max") if one else None
    bound = f"<= {TARGET_MAX_IDLE:.0%}"
    lines: list[dict[str, Any]] = [
        {
            "target": "DDP concurrent trials: max worker idle while trials wait",
            "value": idle,
            "bound": bound,
            "unit": "",
            "status": "UNDEFINED" if idle is None else ("PASS" if idle <= TARGET_MAX_IDLE else "FAIL"),
        },
        {
            "target": "DDP one trial at a time: max worker idle while trials wait",
            "value": one_idle,
            "bound": f"reported beside the concurrent trials' {bound}",
            "unit": "",
            "status": "UNDEFINED" if one_idle is None else "MEASURED",
        },
    ]
    gain = expected_gain(
        concurrent.get("worker_idle_mean") if concurrent else None,
        one.get("worker_idle_mean") if one else None,
    )
    where = (
        f"not measurable on this {cpus}-core machine"
        if cpus < WORKERS
        else "compare the rows' wall times for the measured one"
    )
    lines.append(
        {
            "target": "DDP concurrent trials: throughput vs one at a time, "
            "(1 - mean idle) / (1 - mean idle one at a time)",
            "value": gain,
            "bound": "none; derived from the measured idle fractions",
            "unit": "x",
            "status": "UNDEFINED" if gain is None else "EXPECTED",
            "note": f"expected on a machine with a core per worker; {where}",
        }
    )
    return lines


def format_idle(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per DDP row that has worker idle figures: each worker's idle fraction (workers
    named w0, w1, ... in address order), the largest and the mean."""
    lines = []
    for name, r in results.items():
        idle = r.get("worker_idle")
        if "error" in r or not idle:
            continue
        cells = "  ".join(f"w{i} {idle[w]:.1%}" for i, w in enumerate(sorted(idle)))
        waiting = r.get("worker_idle_waiting") or {}
        while_waiting = "  ".join(f"w{i} {waiting[w]:.1%}" for i, w in enumerate(sorted(waiting)))
        lines.append(
            f"worker idle {name}: {cells}; max {r['worker_idle_max']:.1%}, mean {r['worker_idle_mean']:.1%} "
            f"of the {r['sweep_s']:.1f}s sweep ({r.get('trials_at_once', '-')} trial(s) at once); "
            f"while trials wait (first {r.get('waiting_s', 0.0):.1f}s): {while_waiting or '-'}"
        )
    return lines
