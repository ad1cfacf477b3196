"""What a unit of training costs beyond its passes, from a run's own records (``benchmarks/small_units.py``).

A *unit* is one record of the executor (``training/executors/units.py``): under ``mop`` one model's
pass over one partition (validated when it ends the model's epoch), under ``task`` one epoch of a
chain (a pass over every partition, validated). Each record times its batch loops (``loop_s``,
``val_s``) and its span on the worker (``start`` to ``end``, wall clock of the worker): a ``mop``
unit's span is the whole unit function, a chain's records tile the chain (each epoch's span starts
where the previous one's ended), so the spans add up to the time inside the unit functions. The
worker's fixed cost of a unit is its span less its passes.

What the records cannot see, Dask's own timing of its tasks gives (the scheduler's task stream:
``compute`` start and stop of each task, around the function call on the worker): the time inside
the Dask tasks outside every record (``train_chain``'s look for staged states before its epochs),
per unit.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mopflow.training.executors.base import pass_seconds, task_parts

# The key prefixes of the executors' unit tasks (``executors/mop.py``, ``executors/task_run.py``)
TASK_PREFIX = {"mop": "mop-", "task": "task-"}


def unit_pass_s(record: Mapping[str, Any]) -> float:
    """Seconds inside the unit's training and validation batch loops."""
    return float(record["loop_s"]) + float(record.get("val_s", 0.0))


def unit_fixed_s(record: Mapping[str, Any]) -> float:
    """Seconds of the unit's span on the worker outside its training and validation passes."""
    return float(record["end"]) - float(record["start"]) - unit_pass_s(record)


def unit_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per unit (milliseconds): the pass (mean), the worker's fixed cost outside it (median and
    mean) and its parts (means: ``setup`` before the pass, ``fit`` the pass less its loop (a
    Trainer's set-up and teardown where one is built), ``pack`` the state packed); the units and their seconds in passes (``busy_s``)."""
    timed = [r for r in records if "loop_s" in r and "start" in r and "end" in r]
    if not timed:
        return {"units": 0}
    fixed = [unit_fixed_s(r) * 1e3 for r in timed]
    busy = pass_seconds(timed) or 0.0
    return {
        "units": len(timed),
        "busy_s": busy,
        "pass_ms": busy * 1e3 / len(timed),
        "fixed_ms_median": statistics.median(fixed),
        "fixed_ms_mean": statistics.fmean(fixed),
    } | {f"{part}_ms": seconds * 1e3 / len(timed) for part, seconds in task_parts(timed).items()}


def compute_seconds(entry: Mapping[str, Any]) -> float:
    """Seconds a task-stream entry spent computing on its worker (its ``compute`` spans)."""
    return float(
        sum(float(s["stop"]) - float(s["start"]) for s in entry["startstops"] if s["action"] == "compute")
    )


def dask_figures(
    stream: Iterable[tuple[str, float]], prefix: str, records: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The unit tasks' count and, per unit, their seconds on the workers outside the records
    (ms: the tasks' compute seconds less the records' spans). ``stream``: (key, compute seconds)
    of the tasks that ran; those of the executor's units start with ``prefix``."""
    tasks = [seconds for key, seconds in stream if key.startswith(prefix)]
    timed = [r for r in records if "start" in r and "end" in r]
    if not tasks or not timed:
        return {"dask_tasks": len(tasks)}
    spans = sum(float(r["end"]) - float(r["start"]) for r in timed)
    return {"dask_tasks": len(tasks), "unrecorded_ms": (sum(tasks) - spans) * 1e3 / len(timed)}


def stream_since(index: int, dask_scheduler: Any = None) -> list[tuple[str, float]]:
    """On the scheduler (``client.run_on_scheduler``, which passes ``dask_scheduler``): (key,
    compute seconds) of every task that finished since the task stream's ``index``
    (:func:`stream_index`)."""
    return [(str(e["key"]), compute_seconds(e)) for e in dask_scheduler.get_task_stream(start_index=index)]


def stream_index(dask_scheduler: Any = None) -> int:
    """On the scheduler: how many tasks its task stream has recorded (starting it on first use)."""
    return int(dask_scheduler.get_task_stream_index())


def round_idle_shares(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """A MOP run's idle per worker and round, each as a share of the round's span (its first unit's
    start to its last unit's end): the gaps between a worker's units, each counted in the round of
    the unit before it (a unit of the next round started ahead fills its worker's gap). The run's
    last round is left out: no work waits behind it."""
    rounds: dict[int, list[Mapping[str, Any]]] = {}
    workers: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if "round" in r and "worker" in r:
            rounds.setdefault(int(r["round"]), []).append(r)
            workers.setdefault(str(r["worker"]), []).append(r)
    if len(rounds) < 2:
        return []
    span = {k: max(float(r["end"]) for r in v) - min(float(r["start"]) for r in v) for k, v in rounds.items()}
    idle: dict[tuple[str, int], float] = {}
    for worker, units in workers.items():
        units = sorted(units, key=lambda r: float(r["start"]))
        for before, after in zip(units, units[1:], strict=False):
            key = (worker, int(before["round"]))
            idle[key] = idle.get(key, 0.0) + max(0.0, float(after["start"]) - float(before["end"]))
    last = max(rounds)
    return [
        idle.get((w, k), 0.0) / span[k]
        for w in sorted(workers)
        for k in sorted(rounds)
        if k != last and span[k] > 0
    ]


def round_idle_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The median, 90th percentile and largest of :func:`round_idle_shares` (none without rounds)."""
    shares = sorted(round_idle_shares(records))
    if not shares:
        return {}
    return {
        "round_idle_median": statistics.median(shares),
        "round_idle_p90": shares[min(len(shares) - 1, int(0.9 * len(shares)))],
        "round_idle_max": shares[-1],
    }
