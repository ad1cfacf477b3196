"""MOP's lookahead: a model's next epoch starts before the round's decisions, and is adopted or dropped."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, EpochReport, ModelSpec
from mopflow.training.executors.base import TrainAll
from mopflow.training.executors.mop import MopExecutor
from mopflow.training.executors.mop_lookahead import Lookahead, Speculative
from mopflow.training.executors.scheduler import MopScheduler, Unit, fixed_plan, round_robin

MLP = {"family": "mlp", "width": 16, "depth": 1, "lr": 3e-3, "weight_decay": 0.0, "batch_size": 32}
PARTITIONS = ["p0", "p1"]


@dataclass
class Models:
    """A run's models as the lookahead reads them (``MopModels``)."""

    epochs: int
    active: dict[str, Any]
    states: dict[str, bytes] = field(default_factory=dict)
    visited: dict[str, list[str]] = field(default_factory=dict)
    next_epoch: dict[str, int] = field(default_factory=dict)
    joining: dict[str, Any] = field(default_factory=dict)

    def epoch_complete(self, model_id: str) -> bool:
        return len(self.visited.get(model_id, [])) >= len(PARTITIONS)

    def next_round(self) -> list[str]:
        return sorted({*self.active, *self.joining})


def _round_ending(models: list[str]) -> tuple[MopScheduler, Models]:
    """A round of ``models`` over two workers whose every unit has run but ``models[0]``'s last,
    which runs on its worker."""
    scheduler = MopScheduler(round_robin(PARTITIONS, ["w0", "w1"]), seed=4)
    scheduler.start_epoch(models)
    plan = fixed_plan(4, models, PARTITIONS)
    last = next(u for u in plan[-1] if u.model == models[0])
    scheduler.queue = [u for u in scheduler.queue if u == last]
    worker = scheduler.placement[last.partition]
    assert scheduler.assign([worker]) == [(worker, last)]
    run = Models(
        3, dict.fromkeys(models), {m: m.encode() for m in models}, {m: list(PARTITIONS) for m in models}
    )
    return scheduler, run


def _future(done: bool) -> concurrent.futures.Future[Any]:
    """A unit's call: answered (``done``) or still running on its worker."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    if done:
        future.set_result(None)
    return future


def _openings(models: list[str]) -> dict[str, str]:
    """Where the plan starts each model's epoch."""
    return {u.model: u.partition for u in fixed_plan(4, models, PARTITIONS)[0]}


def test_a_worker_the_round_has_no_unit_for_starts_next_epochs_where_the_plan_starts_them() -> None:
    models = ["a", "b", "c", "d"]
    scheduler, run = _round_ending(models)
    busy = next(iter(scheduler.running))  # the worker running models[0]'s last unit
    offers = Lookahead().offers(run, scheduler, ["w0", "w1"])
    opening = _openings(models)
    # every model but the one still running, at most two per worker (the running one counts),
    # each on the worker holding the partition its next epoch starts on, in its next epoch
    assert models[0] not in {u.model for _, u, _ in offers}
    assert all(
        scheduler.placement[opening[u.model]] == w and u.partition == opening[u.model] for w, u, _ in offers
    )
    assert all(epoch == 1 and u.epoch == 0 for _, u, epoch in offers)
    per_worker = {w: sum(1 for g, _, _ in offers if g == w) for w in ("w0", "w1")}
    assert per_worker[busy] <= 1 and all(n <= 2 for n in per_worker.values())
    assert len({u.model for _, u, _ in offers}) == len(offers) > 0


def test_a_worker_with_a_unit_of_the_round_left_starts_nothing_ahead() -> None:
    scheduler = MopScheduler(round_robin(PARTITIONS, ["w0", "w1"]), seed=4)
    scheduler.start_epoch(["a", "b"])
    run = Models(3, {"a": None, "b": None}, {"a": b"a", "b": b"b"}, {"a": list(PARTITIONS)})
    assert Lookahead().offers(run, scheduler, ["w0", "w1"]) == []  # b's units and a's next are queued


def test_the_driver_pauses_for_a_tell_only_while_no_worker_can_run_dry() -> None:
    """The driver tells a finished trial (milliseconds of journal writes) only while every worker
    has a unit waiting behind the one it runs (the round's, or one started ahead), or the round
    has no unit left that a worker could be waiting for."""
    scheduler = MopScheduler(round_robin(PARTITIONS, ["w0", "w1"]), seed=4)
    scheduler.start_epoch(["a", "b", "c", "d"])
    lookahead = Lookahead()
    assert len(scheduler.assign(["w0", "w1"])) == 2
    assert not lookahead.driver_may_pause(scheduler, ["w0", "w1"])  # one unit runs on each, none waits
    assert len(scheduler.assign_ahead(["w0"])) == 1
    assert lookahead.driver_may_pause(scheduler, ["w0"])
    assert not lookahead.driver_may_pause(scheduler, ["w0", "w1"])
    (unit,) = scheduler.units_on("w1")  # a unit started ahead on w1 takes its second place
    lookahead.note_sent(_future(done=False), Speculative("w1", unit, 1, b"", token="ahead"))
    assert lookahead.driver_may_pause(scheduler, ["w0", "w1"])

    models = ["a", "b", "c", "d"]
    ending, _ = _round_ending(models)  # the round's last unit runs: nothing left to queue
    assert not ending.queue and Lookahead().driver_may_pause(ending, ["w0", "w1"])


def test_the_next_round_adopts_a_unit_started_ahead_only_as_its_plan_has_it() -> None:
    models = ["a", "b", "c", "d"]
    scheduler, run = _round_ending(models)
    lookahead = Lookahead()
    offers = lookahead.offers(run, scheduler, ["w0", "w1"])
    for worker, unit, epoch in offers:
        state = run.states[unit.model]
        lookahead.note_sent(_future(done=False), Speculative(worker, unit, epoch, state, token=unit.model))
    kept, stopped = offers[0][1].model, offers[-1][1].model
    scheduler.complete(next(iter(scheduler.running)))
    # the round ends: every model's epoch is reported; one is stopped
    del run.active[stopped]
    for mid in models:
        run.next_epoch[mid], run.visited[mid] = 1, []
    scheduler.start_epoch(list(run.active), epoch=1)
    adopted, dropped = lookahead.take(run, scheduler, ["w0", "w1"])
    assert kept in {s.unit.model for _, s in adopted} and stopped not in {s.unit.model for _, s in adopted}
    # the dropped ones still running are named to their workers, by their tokens
    stopped_on = next(w for w, u, _ in offers if u.model == stopped)
    assert stopped in dropped[stopped_on]
    assert sorted(t for tokens in dropped.values() for t in tokens) == sorted(
        u.model for _, u, _ in offers if u.model not in {s.unit.model for _, s in adopted}
    )
    assert lookahead.adopted == len(adopted) and lookahead.dropped == len(offers) - len(adopted)
    for _, spec in adopted:  # taken out of the queue, as sent to its worker
        assert spec.unit not in scheduler.queue and spec.unit in scheduler.units_on(spec.worker)
    # the round's plan without the stopped model: an adopted unit opens its model's epoch there
    opening = _openings(sorted(run.active))
    assert all(opening[s.unit.model] == s.unit.partition for _, s in adopted)
    assert lookahead.sent == {}


def test_a_unit_started_ahead_from_another_state_is_dropped() -> None:
    scheduler, run = _round_ending(["a", "b", "c"])
    lookahead = Lookahead()
    for worker, unit, epoch in lookahead.offers(run, scheduler, ["w0", "w1"]):
        lookahead.note_sent(_future(done=True), Speculative(worker, unit, epoch, b"an earlier state", "t"))
    scheduler.complete(next(iter(scheduler.running)))
    run.next_epoch, run.visited = dict.fromkeys(run.active, 1), {}
    scheduler.start_epoch(list(run.active), epoch=1)
    # dropped, and not named to their workers: they have answered already
    assert lookahead.take(run, scheduler, ["w0", "w1"]) == ([], {}) and lookahead.dropped > 0
    assert sorted(scheduler.queue) == sorted(Unit(m, p) for m in run.active for p in PARTITIONS)


class StopFirst(TrainAll):
    """Stops ``m0`` after its first epoch; every report is kept."""

    def __init__(self) -> None:
        self.reports: list[EpochReport] = []

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.reports.append(report)
        return not (report.model_id == "m0" and report.epoch == 0)


def test_a_sweep_trains_the_same_with_and_without_units_started_ahead(
    small_manifest: str, dask_client: object
) -> None:
    """Expected: the units started ahead that a round adopts are the units the model would have
    trained anyway (same partition order, same state), so every report is the same to the bit,
    and at least one was adopted over the run's two round ends."""
    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    models = [ModelSpec(f"m{i}", MLP | {"width": 8 + 4 * i}, seed=i) for i in range(3)]
    runs: dict[bool, tuple[MopExecutor, list[EpochReport]]] = {}
    for lookahead in (False, True):
        executor = MopExecutor(dask_client, data, shards, seed=2, lookahead=lookahead)
        controller = StopFirst()
        executor.run(models, epochs=3, controller=controller)
        runs[lookahead] = (executor, sorted(controller.reports, key=lambda r: (r.model_id, r.epoch)))
    assert runs[False][0].lookahead is None
    assert runs[True][1] == runs[False][1]
    assert [(r.model_id, r.epoch) for r in runs[True][1]] == [
        ("m0", 0), ("m1", 0), ("m1", 1), ("m1", 2), ("m2", 0), ("m2", 1), ("m2", 2),
    ]  # fmt: skip
    ahead = runs[True][0].lookahead
    assert ahead is not None and ahead.adopted >= 1 and ahead.sent == {}


class Cohorts(TrainAll):
    """Hands out ``queued`` models as slots free; records what it hears and does, in order."""

    def __init__(self, queued: list[ModelSpec]) -> None:
        self.queued = list(queued)
        self.reports: list[EpochReport] = []
        self.events: list[tuple[str, str]] = []

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.reports.append(report)
        self.events.append(("report", report.model_id))
        return True

    def on_model_done(self, outcome: Any) -> None:
        self.events.append(("done", outcome.spec.model_id))

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        given, self.queued = self.queued[:free_slots], self.queued[free_slots:]
        self.events.extend(("asked", spec.model_id) for spec in given)
        return given


def test_a_cohorts_successors_are_asked_and_started_before_its_models_are_told(
    small_manifest: str, dask_client: object
) -> None:
    """Expected: the models that take the slots of models in their last epoch are asked as that
    round starts, and their first units, started ahead on workers the round has no more units
    for, are adopted; the finished models are told afterwards. Every report is the same to the
    bit as without the lookahead (asked after the tells)."""
    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    models = [ModelSpec(f"m{i}", MLP | {"width": 8 + 4 * i}, seed=i) for i in range(4)]
    runs: dict[bool, tuple[MopExecutor, Cohorts]] = {}
    for lookahead in (False, True):
        executor = MopExecutor(dask_client, data, shards, seed=2, slots=2, lookahead=lookahead)
        controller = Cohorts(models[2:])
        executor.run(models[:2], epochs=1, controller=controller)
        runs[lookahead] = (executor, controller)
    (_, plain), (ahead, early) = runs[False], runs[True]
    assert sorted(early.reports, key=lambda r: r.model_id) == sorted(plain.reports, key=lambda r: r.model_id)
    assert [r.model_id for r in early.reports] == ["m0", "m1", "m2", "m3"]
    assert plain.events.index(("asked", "m2")) > plain.events.index(("done", "m1"))
    assert early.events.index(("asked", "m2")) < early.events.index(("report", "m0"))
    assert early.events.index(("done", "m1")) < early.events.index(("report", "m2"))
    assert ahead.lookahead is not None and ahead.lookahead.adopted >= 1  # only successors could be
