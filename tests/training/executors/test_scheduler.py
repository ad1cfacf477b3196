"""The MOP scheduler's choice among the units an idle worker can take: most units left first."""

from __future__ import annotations

import random

from mopflow.training.executors.gantt import idle_fraction
from mopflow.training.executors.scheduler import MopScheduler, Unit, check_invariants, round_robin


def _epoch(scheduler: MopScheduler, models: list[str], seconds: dict[str, float]) -> list[dict]:
    """Drive one epoch with fixed unit durations per model; return its unit records."""
    scheduler.start_epoch(models)
    clock, started, records = 0.0, {}, []
    free_at = {w: 0.0 for w in set(scheduler.placement.values())}
    while not scheduler.epoch_finished:
        idle = [w for w, t in free_at.items() if t <= clock and w not in scheduler.running]
        for worker, unit in scheduler.assign(idle):
            started[worker], free_at[worker] = clock, clock + seconds[unit.model]
        worker = min(scheduler.running, key=lambda w: free_at[w])
        clock = free_at[worker]
        unit = scheduler.complete(worker)
        scheduler.record_cost(unit.model, seconds[unit.model])
        records.append(
            {"model": unit.model, "partition": unit.partition, "worker": worker, "start": started[worker]}
            | {"end": clock}
        )
    return records


def test_no_worker_waits_behind_a_model_running_elsewhere() -> None:
    """Two partitions: starting the models with both units left first leaves no worker idle
    (the plain first-in-the-shuffled-queue rule idles a worker at the end of many epochs)."""
    models = [f"m{i}" for i in range(8)]
    for seed in range(40):
        rng = random.Random(seed)
        seconds = {m: rng.uniform(0.5, 3.0) for m in models}
        scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0", "w1"]), seed=seed)
        for _ in range(2):  # the second epoch also orders by the measured unit times
            records = _epoch(scheduler, models, seconds)
            check_invariants(records, models, ["p0", "p1"])
            assert idle_fraction(records) < 1e-9, (seed, records)


def test_the_longest_model_goes_first_among_equals() -> None:
    scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0"]), seed=0)
    scheduler.record_cost("slow", 5.0)
    scheduler.record_cost("fast", 1.0)
    scheduler.start_epoch(["fast", "slow"])
    assert scheduler.assign(["w0"]) == [("w0", Unit("slow", "p0"))]
    scheduler.complete("w0")
    # "fast" has two units left, "slow" one: the model with more left goes first
    assert scheduler.assign(["w0"]) == [("w0", Unit("fast", "p0"))]
