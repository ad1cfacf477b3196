"""Benchmark of what one unit's trip costs: the floor under every MOP sub-epoch.

What is measured
----------------
A MOP unit was one Dask task: the coordinator submitted it with the model's packed state as an
argument, the worker that holds the partition ran it, and the coordinator gathered the new state
(to checkpoint it and to hand it to the next partition's worker). It is now a direct call to the
worker's resident trainer (``mopflow.training.executors.mop_service``). This benchmark runs those trips
with no training in it, on the cluster a search runs on (``mopflow.training.compute.cluster.dask_client``:
a LocalCluster of ``--workers`` one-thread worker processes, its scheduler in this process as in
a search's coordinator): each unit is ``bytes(state)`` (a copy of the state it is given, so a
state of the same size comes back), on the two workers in turn, one unit at a time.

* ``by_value``: as the MOP executor does: the result is gathered and its future released, and the
  next unit is submitted with those bytes as its argument (on its way the state passes through the
  coordinator's process three times: into the client, from the client to the scheduler, from the
  scheduler to the worker).
* ``dependency`` (information): the result is gathered too (a checkpoint needs it), but the next
  unit takes the previous unit's future: Dask moves the state from worker to worker.
* ``direct``: as the MOP executor does now: no Dask task; the state goes to the worker in a call
  to a handler of its own (:func:`~mopflow.training.executors.mop_service.call_worker`), which runs
  the unit in the worker's unit thread (:func:`~mopflow.training.executors.mop_service.run_in_unit_thread`)
  and answers with the new state. The scheduler takes no part in it.

States of ``--sizes`` bytes (default 1, 128 KiB and 1 MiB: the benchmark search's models pack
13 KiB to 1.7 MiB with their AdamW moments). Per unit: wall milliseconds, the CPU milliseconds of
this process (the coordinator, Dask's client and scheduler: ``time.process_time``) and of its
main thread alone (``time.thread_time``: what the coordinator's own loop runs), and of the worker
processes (``time.process_time`` in each, through ``client.run``). Each (size, mode) runs
``--units`` units (default 300) after 20 untimed ones, the modes and sizes interleaved, repeated
``--repeats`` times (default 3); the figures are the medians over the repeats, and the ratios are
against the smallest state's ``by_value`` trip in the same run (the Dask task a MOP unit was).

Output: a plain-text table on stdout and every figure in ``benchmarks/results/roundtrip.json``
(``--out`` names another folder or file; a ``--quick`` run writes there or into a temporary folder).

Run it from the repository root::

    .venv/bin/python benchmarks/roundtrip.py                          # full: about 90 seconds
    .venv/bin/python benchmarks/roundtrip.py --quick --out /tmp/bench  # smoke test: seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

from studies import harness  # noqa: E402

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "roundtrip.json"
MODES = ("by_value", "dependency", "direct")
COPY_HANDLER = "mopflow_benchmark_copy"  # the direct mode's unit: bytes(state), in the unit thread
WARMUP_UNITS = 20


def _workers_cpu(client: Any) -> float:
    """CPU seconds of every worker process so far, summed."""
    return float(sum(client.run(time.process_time).values()))


def run_units(client: Any, workers: Sequence[str], size: int, mode: str, units: int) -> dict[str, float]:
    """``units`` trips of a state of ``size`` bytes, on ``workers`` in turn; per unit: wall, the
    coordinator process's and main thread's CPU, and the workers' CPU (milliseconds)."""
    trip = _direct_trips if mode == "direct" else _task_trips
    workers_before = _workers_cpu(client)
    wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    trip(client, workers, bytes(size), mode, units)
    per_unit = {
        "wall_ms": (time.perf_counter() - wall) * 1e3 / units,
        "coordinator_cpu_ms": (time.process_time() - cpu) * 1e3 / units,
        "coordinator_main_thread_cpu_ms": (time.thread_time() - main) * 1e3 / units,
    }
    per_unit["workers_cpu_ms"] = (_workers_cpu(client) - workers_before) * 1e3 / units
    return per_unit


def _task_trips(client: Any, workers: Sequence[str], state: bytes, mode: str, units: int) -> None:
    """The trips as Dask tasks, the state passed by value or as the previous task's future."""
    previous: Any = None
    for index in range(units):
        argument = previous if mode == "dependency" and previous is not None else state
        future = client.submit(
            bytes, argument, workers=[workers[index % len(workers)]], allow_other_workers=False, pure=False
        )
        state = future.result()
        if previous is not None:  # its dependent is done: Dask may drop it
            previous.release()
        if mode == "dependency":
            previous = future  # the next unit depends on it
        else:
            future.release()  # as the MOP executor released a unit's result once it had it
    if previous is not None:
        previous.release()


def _direct_trips(client: Any, workers: Sequence[str], state: bytes, mode: str, units: int) -> None:
    """The trips as direct calls to the workers' unit threads, as MOP's units go now."""
    from mopflow.training.executors.mop_service import call_worker

    for index in range(units):
        state = call_worker(client, workers[index % len(workers)], COPY_HANDLER, (state,)).result()


def _install_copy_handler(dask_worker: Any = None) -> None:
    """On each worker (``client.run``): the direct mode's handler, ``bytes(state)`` run as a MOP
    unit is (in the unit thread, answered as the service answers)."""
    from mopflow.training.executors.mop_service import run_in_unit_thread

    async def copy_state(args: Sequence[Any] = ()) -> dict[str, Any]:  # Dask names handlers by __name__
        return await run_in_unit_thread(bytes, args)

    dask_worker.handlers[COPY_HANDLER] = copy_state


def measure(settings: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (size, mode) ``settings.repeats`` times, interleaved; one row each with the medians."""
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.compute.workers import worker_addresses

    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    with dask_client("", settings.workers) as client:
        workers = worker_addresses(client)
        client.run(_install_copy_handler)
        for size in settings.sizes:
            for mode in MODES:
                run_units(client, workers, size, mode, WARMUP_UNITS)
        for repeat in range(settings.repeats):
            for size in settings.sizes:
                for mode in MODES:
                    runs.setdefault((size, mode), []).append(
                        run_units(client, workers, size, mode, settings.units)
                    )
            print(f"repeat {repeat + 1}/{settings.repeats} done", flush=True)
    rows = []
    for (size, mode), measured in runs.items():
        row: dict[str, Any] = {"state_bytes": size, "mode": mode, "units": settings.units}
        for key in measured[0]:
            row[key] = round(statistics.median(m[key] for m in measured), 3)
            row[f"{key}_repeats"] = [round(m[key], 3) for m in measured]
        rows.append(row)
    floor = next(r for r in rows if r["state_bytes"] == min(settings.sizes) and r["mode"] == "by_value")
    for row in rows:
        row["wall_ratio"] = round(row["wall_ms"] / floor["wall_ms"], 2)
        row["coordinator_cpu_ratio"] = round(row["coordinator_cpu_ms"] / floor["coordinator_cpu_ms"], 2)
    return rows


COLUMNS = ("state", "mode", "wall ms", "coord CPU", "main thr", "workers CPU", "wall x", "coord x")
FIGURES = (
    "wall_ms",
    "coordinator_cpu_ms",
    "coordinator_main_thread_cpu_ms",
    "workers_cpu_ms",
    "wall_ratio",
    "coordinator_cpu_ratio",
)


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The rows as a plain-text table (milliseconds per unit)."""
    cells = [[_size(r["state_bytes"]), r["mode"], *(f"{r[k]:.2f}" for k in FIGURES)] for r in rows]
    return harness.table_lines(COLUMNS, cells)


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB" if n >= 2**10 else f"{n} B"


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Path]:
    parser = harness.parser(__doc__, "20 units of 1 B and 64 KiB, once")
    parser.add_argument("--units", type=int, default=300, help="timed units per (size, mode) and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes")
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 128 * 2**10, 2**20],
        help="state sizes in bytes, comma-separated",
    )
    settings = parser.parse_args(argv)
    if settings.quick:
        settings.units, settings.repeats, settings.sizes = 20, 1, [1, 64 * 2**10]
    if settings.units < 1 or settings.repeats < 1 or settings.workers < 1 or min(settings.sizes) < 1:
        parser.error("--units, --repeats, --workers and every --sizes entry must be >= 1")
    return settings, harness.results_file(settings.out, settings.quick, RESULTS_PATH)


def main(argv: Sequence[str] | None = None) -> int:
    settings, out = parse_args(argv)
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    load_before = os.getloadavg()
    rows = measure(settings)
    lines = table(rows)
    print("\n".join(lines))
    report = {
        "benchmark": "roundtrip",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": harness.machine(load_before) | {"cpu": harness.cpu()},
        "settings": {k: v for k, v in vars(settings).items() if k != "out"},
        "rows": rows,
    }
    harness.write_report(out, report, lead="\n", config=report["settings"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
