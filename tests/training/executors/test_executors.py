from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from mopflow.training.compute.workers import cluster_workers, worker_addresses
from mopflow.training.executors import DataRef, EpochReport, ModelOutcome, ModelSpec
from mopflow.training.executors.base import TrainAll
from mopflow.training.executors.gantt import check_invariants, gantt_png, idle_fraction
from mopflow.training.executors.mop import MopExecutor, cluster_size, partition_shards
from mopflow.training.executors.scheduler import MopScheduler, fixed_plan, round_robin
from mopflow.training.executors.task import TaskExecutor

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}


def _simulate(scheduler: MopScheduler, models: list[str], seed: int) -> list[dict]:
    """Drive the scheduler with random unit durations; return the unit records of one epoch."""
    rng = random.Random(seed)
    scheduler.start_epoch(models)
    clock, free_at, records, started = 0.0, {w: 0.0 for w in set(scheduler.placement.values())}, [], {}
    while not scheduler.epoch_finished:
        idle = [w for w, t in free_at.items() if t <= clock and w not in scheduler.running]
        for worker, _unit in scheduler.assign(idle):
            started[worker] = clock
            free_at[worker] = clock + rng.uniform(1, 3)
        worker = min((w for w in scheduler.running), key=lambda w: free_at[w])
        clock = free_at[worker]
        unit = scheduler.complete(worker)
        records.append(
            {
                "model": unit.model,
                "partition": unit.partition,
                "worker": worker,
                "start": started[worker],
                "end": clock,
            }
        )
    return records


@pytest.mark.parametrize("schedule", ["fixed", "greedy"])
def test_scheduler_keeps_the_mop_invariants_and_is_seeded(schedule: str) -> None:
    placement = round_robin(["p0", "p1", "p2"], ["w0", "w1", "w2"])
    models = ["a", "b", "c", "d"]
    first = _simulate(MopScheduler(dict(placement), seed=7, schedule=schedule), models, seed=1)
    check_invariants(first, models, placement)
    again = _simulate(MopScheduler(dict(placement), seed=7, schedule=schedule), models, seed=1)
    assert [(r["model"], r["partition"]) for r in first] == [(r["model"], r["partition"]) for r in again]
    other = _simulate(MopScheduler(dict(placement), seed=8, schedule=schedule), models, seed=1)
    assert [(r["model"], r["partition"]) for r in first] != [(r["model"], r["partition"]) for r in other]


def test_check_invariants_catches_violations() -> None:
    ok = [
        {"model": "a", "partition": "p0", "worker": "w0", "start": 0, "end": 1},
        {"model": "a", "partition": "p1", "worker": "w1", "start": 1, "end": 2},
    ]
    check_invariants(ok, ["a"], ["p0", "p1"])
    overlap = [dict(ok[0]), dict(ok[1], start=0.5)]
    with pytest.raises(AssertionError, match="model a ran two units at once"):
        check_invariants(overlap, ["a"], ["p0", "p1"])
    with pytest.raises(AssertionError, match="differ"):
        check_invariants(ok[:1], ["a"], ["p0", "p1"])


def test_lost_worker_requeues_its_unit_and_moves_its_partitions() -> None:
    scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0", "w1"]), seed=0)
    scheduler.start_epoch(["a", "b"])
    assigned = dict(scheduler.assign(["w0", "w1"]))
    lost = scheduler.lose_worker("w1", ["w0"])
    assert lost == assigned["w1"] and lost in scheduler.queue
    assert set(scheduler.placement.values()) == {"w0"}
    scheduler.complete("w0")
    while not scheduler.epoch_finished:
        for worker, _ in scheduler.assign(["w0"]):
            scheduler.complete(worker)
    assert sorted((u.model, u.partition) for u in scheduler.done) == [
        ("a", "p0"),
        ("a", "p1"),
        ("b", "p0"),
        ("b", "p1"),
    ]


def test_a_models_records_are_found_as_the_records_grow(small_manifest: str, dask_client: object) -> None:
    executor = TaskExecutor(dask_client, DataRef.open(small_manifest), [])
    executor.records += [{"model": "a", "n": 0}, {"model": "b", "n": 1}]
    assert executor.records_of("a") == [{"model": "a", "n": 0}]
    executor.records.append({"model": "a", "n": 2})
    assert [r["n"] for r in executor.records_of("a")] == [0, 2]
    assert executor.records_of("b") == [{"model": "b", "n": 1}] and executor.records_of("c") == []


def _shards(manifest: str) -> list[str]:
    from mopflow.training.data import load_manifest

    return [e["name"] for e in load_manifest(manifest)["splits"]["train"]]


def test_mop_on_dask_trains_every_model_on_every_partition(
    small_manifest: str, dask_client: object, tmp_path: Path
) -> None:
    data = DataRef.open(small_manifest)
    models = [ModelSpec(f"m{i}", CNN | {"width": 6 + 2 * i}, seed=i) for i in range(3)]
    executor = MopExecutor(dask_client, data, _shards(small_manifest), str(tmp_path / "ckpt"), seed=3)
    outcomes = executor.run(models, epochs=2)
    # two workers: one training shard each
    assert executor.partitions == {"p0": ["train-00000.parquet"], "p1": ["train-00001.parquet"]}
    for epoch, records in executor.epoch_records.items():
        check_invariants(records, [m.model_id for m in models], executor.partitions)
        assert len({r["worker"] for r in records}) == 2, epoch
        # the fixed schedule (the default): each model hops in its row's order of the round's plan
        plan = fixed_plan(3, [m.model_id for m in models], executor.partitions)
        for model in models:
            planned = [u.partition for units in plan for u in units if u.model == model.model_id]
            ran = sorted((r["start"], r["partition"]) for r in records if r["model"] == model.model_id)
            assert [p for _, p in ran] == planned, (epoch, model.model_id)
    for outcome in outcomes.values():
        assert [r.epoch for r in outcome.history] == [0, 1] and outcome.state
        assert Path(str(outcome.checkpoint_uri)).exists()
    png = gantt_png(executor.epoch_records[1], str(tmp_path / "gantt.png"))
    assert Path(png).stat().st_size > 1000
    assert 0.0 <= idle_fraction(executor.epoch_records[1]) < 1.0


class StopAndAdd(TrainAll):
    """Stops m0 after its first epoch and adds one model once; keeps what it is told, in order."""

    def __init__(self) -> None:
        self.reports: list[EpochReport] = []
        self.events: list[tuple[str, str]] = []  # ("epoch", model) / ("done", model) / ("added", model)
        self.added = False

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.reports.append(report)
        self.events.append(("epoch", report.model_id))
        return not (report.model_id == "m0" and report.epoch == 0)

    def on_model_done(self, outcome: ModelOutcome) -> None:
        self.events.append(("done", outcome.spec.model_id))
        assert outcome.state is not None, outcome.spec.model_id  # told with its final state

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        if self.added or free_slots == 0:
            return []
        self.added = True
        self.events.append(("added", "late"))
        return [ModelSpec("late", CNN, seed=9)]


@pytest.mark.parametrize("strategy", ["task", "mop"])
def test_caller_can_stop_and_add_models_between_epochs(
    strategy: str, small_manifest: str, dask_client: object
) -> None:
    data, shards = DataRef.open(small_manifest), _shards(small_manifest)
    executor = (
        TaskExecutor(dask_client, data, shards)
        if strategy == "task"
        else MopExecutor(dask_client, data, shards)
    )
    controller = StopAndAdd()
    outcomes = executor.run(
        [ModelSpec("m0", CNN, 0), ModelSpec("m1", CNN, 1)], epochs=2, controller=controller
    )
    assert outcomes["m0"].stopped_early and outcomes["m0"].epochs_done == 1
    assert outcomes["m1"].epochs_done == 2
    assert "late" in outcomes and outcomes["late"].epochs_done == 2  # a late model still trains every epoch
    # Each model is told done once, when it is (whichever worker is faster): m0 right after the
    # epoch it was stopped on, m1 after its last epoch, and "late" only once a slot was freed.
    events = controller.events
    done = [m for kind, m in events if kind == "done"]
    assert sorted(done) == ["late", "m0", "m1"]
    assert [e for e in events if e[1] == "m0"] == [("epoch", "m0"), ("done", "m0")]
    last_epoch = max(i for i, e in enumerate(events) if e == ("epoch", "m1"))
    assert events.index(("done", "m1")) > last_epoch
    first_done = min(i for i, e in enumerate(events) if e[0] == "done")
    assert events.index(("added", "late")) > first_done


def test_mop_resumes_from_its_sub_epoch_checkpoints(
    small_manifest: str, dask_client: object, tmp_path: Path
) -> None:
    data, shards = DataRef.open(small_manifest), _shards(small_manifest)
    spec = ModelSpec("m", CNN, seed=0)
    first = MopExecutor(dask_client, data, shards, str(tmp_path), seed=0).run([spec], epochs=1)
    assert first["m"].epochs_done == 1
    resumed = MopExecutor(dask_client, data, shards, str(tmp_path), seed=0)
    outcome = resumed.run([spec], epochs=3)["m"]
    # epoch 0 was not redone (2 rounds), and its report came back from beside the checkpoint
    assert [r.epoch for r in outcome.history] == [0, 1, 2]
    assert outcome.history[0] == first["m"].history[0]
    assert len(resumed.epoch_records) == 2


@pytest.mark.slow
def test_ddp_over_two_workers_matches_one_worker_at_the_global_batch(
    small_manifest: str, dask_client: object
) -> None:
    from mopflow.training.executors.ddp import DDPExecutor

    spec = ModelSpec("d", CNN | {"width": 16, "depth": 3, "batch_size": 64, "lr": 0.02}, seed=0)
    two = DDPExecutor(dask_client, DataRef.open(small_manifest), world_size=2).run([spec], epochs=5)["d"]
    one = DDPExecutor(dask_client, DataRef.open(small_manifest), world_size=1).run([spec], epochs=5)["d"]
    assert two.error is None and one.error is None, (two.error, one.error)
    assert [r.epoch for r in two.history] == list(range(5)) and two.state
    assert two.history[-1].val_acc > 0.2 and one.history[-1].val_acc > 0.2  # both learned (chance is 0.1)
    # The validation split of this small set has ~80 rows: 0.15 is about a dozen rows.
    assert abs(two.history[-1].val_acc - one.history[-1].val_acc) <= 0.15


@pytest.mark.slow
def test_ddp_resumes_from_its_epoch_checkpoint(
    small_manifest: str, dask_client: object, tmp_path: Path
) -> None:
    from mopflow.training.executors.ddp import DDPExecutor

    spec = ModelSpec("d", CNN, seed=0)
    first = DDPExecutor(
        dask_client, DataRef.open(small_manifest), world_size=2, checkpoint_root=str(tmp_path)
    ).run([spec], epochs=1)
    assert [r.epoch for r in first["d"].history] == [0]
    resumed = DDPExecutor(
        dask_client, DataRef.open(small_manifest), world_size=2, checkpoint_root=str(tmp_path)
    ).run([spec], epochs=3)
    assert resumed["d"].error is None
    # epoch 0 was not redone: its report came back from beside the checkpoint
    assert [r.epoch for r in resumed["d"].history] == [0, 1, 2]
    assert resumed["d"].history[0] == first["d"].history[0]


@pytest.mark.slow
def test_ddp_job_stops_between_epochs_when_the_caller_says_so(
    small_manifest: str, dask_client: object
) -> None:
    from mopflow.training.executors.ddp import DDPExecutor

    class StopAfterFirst(TrainAll):
        def on_epoch_end(self, report: EpochReport) -> bool:
            return False

    outcome = DDPExecutor(dask_client, DataRef.open(small_manifest), world_size=2).run(
        [ModelSpec("d", CNN, seed=0)], epochs=8, controller=StopAfterFirst()
    )["d"]
    assert outcome.error is None and outcome.stopped_early
    assert 1 <= outcome.epochs_done < 8  # every rank stopped together, long before the end


def test_packed_state_that_is_a_pickle_is_refused() -> None:
    """A checkpoint replaced by a pickle payload: refused with a clear error, never unpickled."""
    import pickle

    from mopflow.training.trainable.state import StateFormatError, read_meta

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("executed!",))

    with pytest.raises(StateFormatError, match="not a safetensors blob"):
        read_meta(pickle.dumps(Payload()))
    with pytest.raises(StateFormatError):
        read_meta(b"\x00" * 4)


def test_partition_shards_deals_the_sorted_shards_round_robin() -> None:
    assert partition_shards(["c", "a", "e", "b", "d"], 2) == {"p0": ["a", "c", "e"], "p1": ["b", "d"]}
    assert partition_shards(["b", "a", "c"], 3) == {"p0": ["a"], "p1": ["b"], "p2": ["c"]}
    # never an empty partition, and at least one
    assert partition_shards(["b", "a"], 5) == {"p0": ["a"], "p1": ["b"]}
    assert partition_shards(["b", "a"], 0) == {"p0": ["a", "b"]}


def test_a_worker_away_still_counts_toward_the_partitions() -> None:
    """A LocalCluster's spec is its size: a worker away after a spot notice (or slow to start on a
    loaded machine) still gets its partition; without a cluster object the connected workers count."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=2, processes=False, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        workers = worker_addresses(client)
        assert cluster_size(client, workers) == 2
        client.retire_workers([workers[1]], close_workers=True)  # it leaves; nothing restarts it
        deadline = time.monotonic() + 60
        while len(cluster_workers(client)) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        left = worker_addresses(client)
        assert left == workers[:1]
        assert cluster_size(client, left) == 2
        with Client(cluster.scheduler_address) as by_address:  # no cluster object
            assert cluster_size(by_address, left) == 1


def test_an_untrained_state_handed_back_by_a_stop_is_not_resumed_from(
    small_manifest: str, dask_client: object, tmp_path: Path
) -> None:
    """A stop as a fresh model's first unit began hands its initial state back untouched and MOP
    checkpoints it; that checkpoint holds no epoch, so a resumed run starts the model afresh (it
    once resumed it at epoch -1, and the search's report of that epoch failed the stage)."""
    from mopflow.training.executors.units import init_state

    data, shards = DataRef.open(small_manifest), _shards(small_manifest)
    spec = ModelSpec("m", CNN, seed=0)
    fresh = MopExecutor(dask_client, data, shards, str(tmp_path / "fresh"), seed=0).run([spec], epochs=1)
    stopped = MopExecutor(dask_client, data, shards, str(tmp_path / "stopped"), seed=0)
    stopped.save_checkpoint("m", init_state(spec, data))
    assert stopped.load_checkpoint("m") is None  # nothing trained: nothing to resume
    outcome = stopped.run([spec], epochs=1)["m"]
    assert [r.epoch for r in outcome.history] == [0] and "m" not in stopped.resumed
    assert outcome.history == fresh["m"].history


def test_pass_seconds_add_the_training_loops_and_the_validations_of_timed_records() -> None:
    from mopflow.training.executors.base import pass_seconds

    records = [{"loop_s": 1.5, "val_s": 0.25}, {"loop_s": 2.0}, {"worker": "a DDP gang, untimed"}]
    assert pass_seconds(records) == 3.75
    assert pass_seconds([{"worker": "untimed"}]) is None


def test_task_seconds_add_the_spans_of_timed_records() -> None:
    from mopflow.training.executors.base import task_seconds

    records = [{"loop_s": 1.5, "start": 10.0, "end": 12.0}, {"loop_s": 2.0, "start": 12.5, "end": 15.0}]
    assert task_seconds(records + [{"start": 0.0, "end": 100.0}]) == 4.5  # an untimed loop: not counted
    assert task_seconds([{"worker": "untimed"}]) is None


def test_task_parts_split_the_seconds_around_the_loops() -> None:
    from mopflow.training.executors.base import task_parts

    records = [
        {"loop_s": 1.0, "fit_s": 1.25, "setup_s": 0.5, "pack_s": 0.25},
        {"loop_s": 2.0, "fit_s": 2.5, "setup_s": 0.0},  # a chain's epoch before its last: not packed
        {"loop_s": 3.0},  # recorded before the parts were timed: left out
    ]
    assert task_parts(records) == {"setup": 0.5, "fit": 0.75, "pack": 0.25}
    assert task_parts([{"loop_s": 1.0}]) == {}


def test_an_epoch_checkpointed_but_never_told_is_told_from_the_checkpoint(
    small_manifest: str, dask_client: object, tmp_path: Path
) -> None:
    """An attempt made a chain's last state the checkpoint and was cut off before it told that
    epoch (the saved history lacks it). The retry tells it from the record the state carries:
    every epoch reaches the controller, the last one with the value the attempt measured."""
    import json

    data = DataRef.open(small_manifest)
    spec = ModelSpec("m", CNN, seed=0)
    shards = _shards(small_manifest)
    first = TaskExecutor(dask_client, data, shards, checkpoint_root=str(tmp_path)).run([spec], epochs=2)["m"]
    history = tmp_path / "m" / "history.jsonl"
    first_line = history.read_text().splitlines()[0]
    assert json.loads(first_line)["epoch"] == 0
    history.write_text(first_line + "\n")  # the cut-off attempt's history: epoch 0 alone
    heard: list[EpochReport] = []

    class Hear(TrainAll):
        def on_epoch_end(self, report: EpochReport) -> bool:
            heard.append(report)
            return True

    again = TaskExecutor(dask_client, data, shards, checkpoint_root=str(tmp_path)).run([spec], 2, Hear())["m"]
    assert [r.epoch for r in heard] == [0, 1] and heard == first.history
    assert again.history == first.history and again.state is not None


def test_a_history_is_written_whole_once_then_appended_and_read_back_by_epoch(
    small_manifest: str, tmp_path: Path
) -> None:
    """Each epoch appends one line; a new history list of the model (another attempt) writes the
    file whole again. Read back: the last line of each epoch up to the one asked for, a
    half-written last line passed over, and an earlier version's JSON list still read."""
    import json

    from mopflow.training.executors.base import HISTORY_FILE, LEGACY_HISTORY_FILE, Executor

    class Bare(Executor):
        def _train(self, models: Any, epochs: int, controller: Any) -> dict[str, ModelOutcome]:
            return {}

    executor = Bare(DataRef.open(small_manifest), checkpoint_root=str(tmp_path))
    reports = [EpochReport("m", epoch, 0.1 * epoch, 1.0, 0.01) for epoch in range(4)]
    history: list[EpochReport] = []
    for report in reports[:3]:
        history.append(report)
        executor.save_history("m", history)
    path = tmp_path / "m" / HISTORY_FILE
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [0, 1, 2]
    again = [reports[0], EpochReport("m", 1, 0.9, 1.0, 0.01)]  # a retry from epoch 0's checkpoint
    executor.save_history("m", again)
    assert [json.loads(line)["val_acc"] for line in path.read_text().splitlines()] == [0.0, 0.9]
    with path.open("a") as handle:  # an epoch told twice, then an append cut off by a crash
        handle.write(json.dumps(asdict(EpochReport("m", 1, 0.8, 1.0, 0.01))) + "\n" + '{"epoch": 2, "val')
    assert [(r.epoch, r.val_acc) for r in executor.load_history("m", 5)] == [(0, 0.0), (1, 0.8)]
    assert executor.load_history("m", 0) == [reports[0]]
    legacy = tmp_path / "old" / LEGACY_HISTORY_FILE
    legacy.parent.mkdir()
    legacy.write_text(json.dumps([asdict(r) for r in reports]))
    assert executor.load_history("old", 2) == reports[:3]
