"""MOP's scheduling replayed in the pure scheduler, each unit lasting its model's seconds.

The MOP driver (``mopflow.training.executors.mop``) hands an idle worker its schedule's unit
and, with ``ahead``, queues one more unit behind each busy worker's running one, which starts the
moment the running one ends; a round of ``round_epochs`` epochs ends with its last unit. The
replay does the same with ``MopScheduler`` and nothing else: no dispatch, no set-up, no
coordinator. ``benchmarks/mop_schedule.py`` uses it for the seconds its schedules' plans cost
without the noise, ``benchmarks/mop_bound.py`` for the utilisation the schedule allows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Replayed:
    """A replay's wall seconds and the seconds its units ran, summed over the workers."""

    wall_s: float
    busy_s: float
    workers: int

    @property
    def utilisation(self) -> float:
        """Units' seconds over workers x wall seconds."""
        return self.busy_s / (self.wall_s * self.workers)


def replay(
    unit_s: Mapping[str, float],
    workers: int,
    rounds: int,
    round_epochs: int = 1,
    seed: int = 0,
    schedule: str = "fixed",
    ahead: bool = True,
) -> Replayed:
    """``rounds`` rounds of ``round_epochs`` epochs of these models over one partition per worker
    (``workers`` of them), each unit lasting its model's ``unit_s``, scheduled as the MOP driver
    does (``ahead``: with a unit queued behind each running one)."""
    from mopflow.training.executors.scheduler import MopScheduler, round_robin

    names = [f"w{i}" for i in range(workers)]
    scheduler = MopScheduler(round_robin([f"p{i}" for i in range(workers)], names), seed, schedule)
    clock = busy = 0.0
    for index in range(rounds):
        scheduler.start_epoch(unit_s, epoch=index * round_epochs, epochs=round_epochs)
        ends: dict[str, float] = {}  # worker -> when its running unit ends
        while not scheduler.epoch_finished:
            idle = [w for w in names if w not in scheduler.running]
            for worker, unit in scheduler.assign(idle):
                ends[worker] = clock + unit_s[unit.model]
            if ahead:
                scheduler.assign_ahead(names)
            worker = min(scheduler.running, key=lambda w: ends[w])
            clock = ends[worker]
            unit = scheduler.complete(worker)
            busy += unit_s[unit.model]
            scheduler.record_cost(unit.model, unit_s[unit.model])
            if worker in scheduler.running:  # its unit ahead starts at once
                ends[worker] = clock + unit_s[scheduler.running[worker].model]
    return Replayed(clock, busy, workers)


def replay_without_rounds(
    unit_s: Mapping[str, float], workers: int, units_each: int = 40, any_order: bool = False
) -> Replayed:
    """MOP's partition rule with no rounds: a model visits every partition once an epoch and is on
    one worker at a time, but starts its next epoch as soon as its last ends, whatever the others
    do. A free worker takes, of the idle models with its partition still to visit this epoch, the
    one with the fewest units done. ``any_order``: a model may visit the partitions in any order
    within an epoch (else in a fixed cycle, as the fixed plan's rows do). Replayed until every model
    has run ``units_each`` units."""
    models = list(unit_s)
    to_visit = {m: set(range(workers)) for m in models}  # partitions left in the model's epoch
    cycle_next = {m: i % workers for i, m in enumerate(models)}  # the cycle's next partition
    done = dict.fromkeys(models, 0)
    running: dict[int, tuple[float, str]] = {}  # worker (= its partition) -> (end, model)
    clock = busy = 0.0
    while min(done.values()) < units_each:
        busy_models = {m for _, m in running.values()}
        for worker in range(workers):
            if worker in running:
                continue
            ready = [
                m
                for m in models
                if m not in busy_models and (worker in to_visit[m] if any_order else cycle_next[m] == worker)
            ]
            if ready:
                model = min(ready, key=lambda m: (done[m], models.index(m)))
                running[worker] = (clock + unit_s[model], model)
                busy_models.add(model)
        worker = min(running, key=lambda w: running[w][0])
        clock, model = running.pop(worker)
        busy += unit_s[model]
        done[model] += 1
        cycle_next[model] = (worker + 1) % workers
        to_visit[model].discard(worker)
        if not to_visit[model]:
            to_visit[model] = set(range(workers))
    return Replayed(clock, busy, workers)
