"""The MOP scheduler's choice among the units an idle worker can take: the fixed plan (each
model's order of partitions a function of the seed and the epoch) and the greedy queue (most
units left first)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable

import pytest

from mopflow.training.executors.gantt import check_invariants, idle_fraction
from mopflow.training.executors.scheduler import (
    SCHEDULES,
    MopScheduler,
    Unit,
    fixed_plan,
    round_robin,
)


def _epoch(
    scheduler: MopScheduler,
    models: list[str],
    seconds: dict[str, float],
    epoch: int = 0,
    on_start: Callable[[MopScheduler, int], None] | None = None,
    jitter: random.Random | None = None,
) -> list[dict]:
    """Drive one epoch, a unit of model m lasting ``seconds[m]`` (times 0.5 to 1.5 drawn from
    ``jitter``); return its unit records. ``on_start`` is called with the number of units started
    so far, after each assignment (to lose or add workers)."""
    scheduler.start_epoch(models, epoch=epoch)
    clock, started, records = 0.0, {}, []
    free_at = {w: 0.0 for w in set(scheduler.placement.values())}
    count = 0
    while not scheduler.epoch_finished:
        idle = [w for w in sorted(set(scheduler.placement.values())) if w not in scheduler.running]
        for worker, unit in scheduler.assign(w for w in idle if free_at.get(w, 0.0) <= clock):
            factor = jitter.uniform(0.5, 1.5) if jitter is not None else 1.0
            started[worker], free_at[worker] = clock, clock + seconds[unit.model] * factor
            count += 1
            if on_start is not None:
                on_start(scheduler, count)
        if not scheduler.running:
            continue  # a worker was lost: its unit went back to the queue
        worker = min(scheduler.running, key=lambda w: free_at[w])
        clock = free_at[worker]
        unit = scheduler.complete(worker)
        scheduler.record_cost(unit.model, clock - started[worker])
        records.append(
            {"model": unit.model, "partition": unit.partition, "worker": worker, "start": started[worker]}
            | {"end": clock}
        )
    return records


def _orders(records: list[dict]) -> dict[str, list[str]]:
    """Each model's partitions in the order it visited them."""
    orders: dict[str, list[str]] = {}
    for r in sorted(records, key=lambda r: r["start"]):
        orders.setdefault(r["model"], []).append(r["partition"])
    return orders


def _planned_orders(plan: list[list[Unit]]) -> dict[str, list[str]]:
    orders: dict[str, list[str]] = {}
    for units in plan:
        for unit in units:
            orders.setdefault(unit.model, []).append(unit.partition)
    return orders


@pytest.mark.parametrize(("n_models", "n_partitions"), [(4, 4), (7, 3), (2, 5), (1, 1)])
def test_the_fixed_plan_is_a_function_of_the_seed_and_visits_every_unit_once(
    n_models: int, n_partitions: int
) -> None:
    models = [f"trial-{i:04d}" for i in range(n_models)]
    partitions = [f"p{i}" for i in range(n_partitions)]
    plan = fixed_plan(11, models, partitions)
    fixed_plan(12, models, partitions)  # no state is carried from one call to the next
    assert fixed_plan(11, list(reversed(models)), list(reversed(partitions))) == plan
    assert len(plan) == n_partitions
    units = [u for sub_epoch in plan for u in sub_epoch]
    assert sorted(units) == sorted(Unit(m, p) for m in models for p in partitions)  # each once
    for sub_epoch in plan:  # no model twice in one sub-epoch; the partitions evenly loaded
        assert len({u.model for u in sub_epoch}) == len(sub_epoch) == n_models
        load = Counter(u.partition for u in sub_epoch)
        if n_models <= n_partitions:
            assert set(load.values()) == {1}
        else:  # every partition has its share of the models, give or take one
            assert len(load) == n_partitions
            assert max(load.values()) - min(load.values()) <= 1
    if n_models * n_partitions > 1:  # another seed, another plan
        assert any(fixed_plan(s, models, partitions) != plan for s in range(4))


def test_under_a_fixed_schedule_a_model_goes_round_its_cycle_of_partitions_epoch_after_epoch() -> None:
    """Four models on two workers over five epochs: every model alternates between the
    partitions (a pass never follows a pass on the same one, across epochs too), and a model
    that joins takes a place in the cycle while the others keep theirs."""
    models, partitions = [f"trial-{i:04d}" for i in range(4)], ["p0", "p1"]
    scheduler = MopScheduler(round_robin(partitions, ["w0", "w1"]), seed=7, schedule="fixed")
    seconds = {m: 1.0 + 0.3 * i for i, m in enumerate(models)}
    epochs = [_orders(_epoch(scheduler, models, seconds, epoch)) for epoch in range(5)]
    for model in models:
        order = [partition for orders in epochs for partition in orders[model]]
        assert all(a != b for a, b in itertools.pairwise(order)), (model, order)
    before = _planned_orders(fixed_plan(7, models, partitions))
    after = _planned_orders(fixed_plan(7, [*models[1:], "trial-0004"], partitions))
    kept = [m for m in models[1:] if after[m] == before[m]]
    assert len(kept) >= 2, (before, after)


@pytest.mark.parametrize(("n_models", "n_partitions"), [(5, 2), (3, 3), (2, 4)])
def test_a_fixed_schedule_trains_each_model_in_its_planned_order_whatever_the_timings(
    n_models: int, n_partitions: int
) -> None:
    models = [f"m{i}" for i in range(n_models)]
    partitions = [f"p{i}" for i in range(n_partitions)]
    workers = [f"w{i}" for i in range(n_partitions)]
    planned = _planned_orders(fixed_plan(5, models, partitions))  # every epoch's
    for timing in range(12):
        rng = random.Random(timing)
        per_model = {m: rng.uniform(0.2, 4.0) for m in models}
        scheduler = MopScheduler(round_robin(partitions, workers), seed=5, schedule="fixed")
        for epoch in range(2):
            records = _epoch(scheduler, models, per_model, epoch, jitter=rng)
            check_invariants(records, models, partitions)
            assert _orders(records) == planned, (timing, epoch)


def test_a_fixed_schedule_keeps_its_plan_through_lost_stopped_and_restarted_workers() -> None:
    """A worker killed (its unit redone), one stopped by a spot notice (its pass finished first)
    and a restarted one: the units run elsewhere or later, each model's order is the plan's."""
    models, partitions = ["a", "b", "c", "d"], ["p0", "p1", "p2"]
    planned = _planned_orders(fixed_plan(2, models, partitions))

    def faults(scheduler: MopScheduler, started: int) -> None:
        if started == 2:  # w1 dies without notice: its unit goes back to the queue
            scheduler.lose_worker("w1", ["w0", "w2"])
        elif started == 5:  # w2 gets a spot notice: its unit saved mid-pass, finished first
            stopped = scheduler.running.get("w2")
            scheduler.lose_worker("w2", ["w0"], saved=True)
            assert stopped is None or scheduler.resume[stopped.model] == stopped.partition
        elif started == 7:  # a restarted worker takes partitions back
            assert scheduler.add_worker("w3")

    scheduler = MopScheduler(round_robin(partitions, ["w0", "w1", "w2"]), seed=2)
    records = _epoch(scheduler, models, {m: 1.0 + ord(m) % 3 for m in models}, on_start=faults)
    check_invariants(records, models, partitions)
    assert _orders(records) == planned
    assert "w3" in set(scheduler.placement.values()) and scheduler.resume == {}


def test_a_greedy_schedule_follows_the_timings() -> None:
    """What the fixed plan is for: under the greedy queue a model's order of partitions depends
    on which worker frees first."""
    models, partitions = ["a", "b", "c", "d"], ["p0", "p1"]
    seen = set()
    for timing in range(8):
        rng = random.Random(timing)
        scheduler = MopScheduler(round_robin(partitions, ["w0", "w1"]), seed=0, schedule="greedy")
        records = _epoch(scheduler, models, {m: rng.uniform(0.5, 3.0) for m in models}, jitter=rng)
        seen.add(tuple(sorted((m, tuple(o)) for m, o in _orders(records).items())))
    assert len(seen) > 1


def test_the_schedules_are_a_registry() -> None:
    assert set(SCHEDULES) == {"fixed", "greedy"}
    assert MopScheduler({"p0": "w0"}).schedule == "fixed"  # the default
    with pytest.raises(ValueError, match="unknown MOP schedule 'fifo'"):
        MopScheduler({"p0": "w0"}, schedule="fifo")


@pytest.mark.parametrize("schedule", ["greedy", "fixed"])
def test_no_worker_waits_behind_a_model_running_elsewhere(schedule: str) -> None:
    """Two partitions, eight models whose unit times differ up to 6x: no worker is ever idle.
    Greedy starts the models with both units left first (the plain first-in-the-shuffled-queue
    rule idles a worker at the end of many epochs); the fixed plan starts half the models on each
    partition (a square plan of eight sub-epochs started seven of them on one and idled a worker
    4 to 12% of each epoch)."""
    models = [f"m{i}" for i in range(8)]
    for seed in range(40):
        rng = random.Random(seed)
        seconds = {m: rng.uniform(0.5, 3.0) for m in models}
        scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0", "w1"]), seed=seed, schedule=schedule)
        for epoch in range(2):  # the second epoch also orders by the measured unit times
            records = _epoch(scheduler, models, seconds, epoch=epoch)
            check_invariants(records, models, ["p0", "p1"])
            assert idle_fraction(records) < 1e-9, (seed, records)


def test_the_longest_model_goes_first_among_equals() -> None:
    scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0"]), seed=0, schedule="greedy")
    scheduler.record_cost("slow", 5.0)
    scheduler.record_cost("fast", 1.0)
    scheduler.start_epoch(["fast", "slow"])
    assert scheduler.assign(["w0"]) == [("w0", Unit("slow", "p0"))]
    scheduler.complete("w0")
    # "fast" has two units left, "slow" one: the model with more left goes first
    assert scheduler.assign(["w0"]) == [("w0", Unit("fast", "p0"))]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_unit_ahead_keeps_the_plan_and_never_puts_a_model_in_two_places(schedule: str) -> None:
    """Each busy worker is given one unit ahead; the ahead unit runs next when its worker frees, a
    model never has two units on workers, and a fixed schedule still trains each model in its
    planned order."""
    models, seconds = ["a", "b", "c", "d"], {"a": 1.0, "b": 2.0, "c": 1.5, "d": 0.5}
    partitions = ["p0", "p1"]
    scheduler = MopScheduler(round_robin(partitions, ["w0", "w1"]), seed=3, schedule=schedule)
    scheduler.start_epoch(models, epoch=2)
    clock, free_at, records, ahead_seen = 0.0, {"w0": 0.0, "w1": 0.0}, [], 0
    while not scheduler.epoch_finished:
        idle = [w for w in ("w0", "w1") if w not in scheduler.running]
        for worker, unit in scheduler.assign(idle):
            free_at[worker] = clock + seconds[unit.model]
        ahead_seen += len(scheduler.assign_ahead(["w0", "w1"]))
        on_workers = [u.model for w in ("w0", "w1") for u in scheduler.units_on(w)]
        assert len(on_workers) == len(set(on_workers)), f"a model on two workers: {on_workers}"
        worker = min(scheduler.running, key=lambda w: free_at[w])
        clock = free_at[worker]
        queued = scheduler.ahead.get(worker)
        unit = scheduler.complete(worker)
        records.append({"model": unit.model, "partition": unit.partition, "worker": worker, "start": clock})
        if queued is not None:  # the worker starts its unit ahead at once
            assert scheduler.running[worker] == queued and worker not in scheduler.ahead
            free_at[worker] = clock + seconds[queued.model]
    assert ahead_seen >= 4
    assert Counter((r["model"], r["partition"]) for r in records) == Counter(
        (m, p) for m in models for p in partitions
    )
    if schedule == "fixed":
        assert _orders(records) == _planned_orders(fixed_plan(3, models, partitions))


def test_a_lost_worker_gives_back_its_running_unit_and_its_unit_ahead() -> None:
    scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0", "w1"]), seed=0)
    scheduler.start_epoch(["a", "b", "c", "d"])
    scheduler.assign(["w0", "w1"])
    scheduler.assign_ahead(["w0", "w1"])
    running, ahead = scheduler.running["w1"], scheduler.ahead["w1"]
    scheduler.lose_worker("w1", ["w0"], saved=True)
    assert {running, ahead} <= set(scheduler.queue)
    assert scheduler.resume == {running.model: running.partition}  # only the running one was saved
    assert scheduler.units_on("w1") == [] and set(scheduler.placement.values()) == {"w0"}
    # a unit that failed on a worker still there goes back alone; the one ahead moves up
    first, second = scheduler.running["w0"], scheduler.ahead["w0"]
    assert scheduler.requeue("w0", unit=first) == first
    assert scheduler.running["w0"] == second and "w0" not in scheduler.ahead


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_round_of_several_epochs_keeps_each_models_epochs_in_order(schedule: str) -> None:
    """A round of 3 epochs: a model starts its next epoch as soon as its own epoch is done (not
    when every model's is), each epoch visits every partition once, and a fixed schedule trains
    each epoch in the order of that epoch's plan."""
    models, partitions = ["a", "b", "c"], ["p0", "p1", "p2"]
    scheduler = MopScheduler(round_robin(partitions, ["w0", "w1", "w2"]), seed=5, schedule=schedule)
    seconds = {"a": 1.0, "b": 3.0, "c": 0.7}
    scheduler.start_epoch(models, epoch=4, epochs=3)
    clock, free_at, finished = 0.0, {"w0": 0.0, "w1": 0.0, "w2": 0.0}, []
    while not scheduler.epoch_finished:
        for worker, unit in scheduler.assign(w for w in free_at if w not in scheduler.running):
            free_at[worker] = clock + seconds[unit.model]
        worker = min(scheduler.running, key=lambda w: free_at[w])
        clock = free_at[worker]
        finished.append((clock, scheduler.complete(worker)))
    for model in models:
        units = [u for _, u in finished if u.model == model]
        assert [u.epoch for u in units] == sorted(u.epoch for u in units)  # epoch by epoch
        for e in range(3):
            visited = [u.partition for u in units if u.epoch == e]
            assert sorted(visited) == partitions
            if schedule == "fixed":
                assert visited == _planned_orders(fixed_plan(5, models, partitions))[model]
    # the fast model's second epoch began before the slow one's first was done
    end_of_first = {m: max(t for t, u in finished if u.model == m and u.epoch == 0) for m in models}
    first_of_second_c = min(t for t, u in finished if u.model == "c" and u.epoch == 1)
    assert first_of_second_c < end_of_first["b"]
