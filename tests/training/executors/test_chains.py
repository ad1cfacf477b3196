"""Where a chain run again after its worker died goes on from (no training: packed states made here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from mopflow.training.executors.base import CHECKPOINT_FILE, STAGED_FILE
from mopflow.training.executors.chains import STAGED_RECORD, STAGED_UNHEARD, newest_state_within
from mopflow.training.trainable.state import read_meta


def _state(epoch: int, **meta: Any) -> bytes:
    return bytes(
        save(
            {"model.w": torch.full((2,), float(epoch))},
            metadata={"meta": json.dumps({"epoch": epoch, **meta})},
        )
    )


def _stage(folder: Path, epoch: int) -> None:
    record = {"epoch": epoch, "val_acc": 0.5 + epoch / 100}
    (folder / STAGED_FILE.format(epoch=epoch)).write_bytes(_state(epoch, **{STAGED_RECORD: record}))


def test_a_chain_goes_on_from_the_newest_whole_epoch_staged_or_checkpointed_within_it(tmp_path: Path) -> None:
    """Expected: nothing within the chain (a first attempt, or only the checkpoint it started
    from): None. States staged by an earlier attempt: the newest, with the staged epochs' records
    (the coordinator may not have heard them). Staged states already made the checkpoint (moved):
    the checkpoint. A checkpoint stopped mid-epoch, or past the chain, is not a place to go on from."""
    folder = tmp_path / "trial-0000"
    folder.mkdir()
    assert newest_state_within(str(folder), 3, 8, {}) is None
    (folder / CHECKPOINT_FILE).write_bytes(_state(2))  # the state the chain started from
    assert newest_state_within(str(folder), 3, 8, {}) is None

    _stage(folder, 3)
    _stage(folder, 4)
    state, epoch, records = newest_state_within(str(folder), 3, 8, {}) or (b"", -1, [])
    assert epoch == 4 and read_meta(state)["epoch"] == 4
    assert [(r["epoch"], r["recovered"]) for r in records] == [(3, True), (4, True)]

    (folder / STAGED_FILE.format(epoch=3)).replace(folder / CHECKPOINT_FILE)  # the coordinator took 3
    (folder / STAGED_FILE.format(epoch=4)).replace(folder / CHECKPOINT_FILE)  # and 4
    state, epoch, records = newest_state_within(str(folder), 3, 8, {}) or (b"", -1, [])
    assert (epoch, records) == (4, []) and read_meta(state)["epoch"] == 4

    (folder / CHECKPOINT_FILE).write_bytes(_state(5, partial={"epoch": 5, "batches": 3}))
    assert newest_state_within(str(folder), 3, 8, {}) is None
    (folder / CHECKPOINT_FILE).write_bytes(_state(8))  # the chain's last epoch (3 to 8): no record of it
    assert newest_state_within(str(folder), 3, 8, {}) is None


def test_a_state_staged_after_epochs_not_heard_yet_carries_their_records(tmp_path: Path) -> None:
    """A chain tells the coordinator of an epoch no decision waits for only with a later one;
    the state it stages after such epochs replaces the one before and carries the records of
    every epoch not heard yet. Expected: a chain run again goes on from it with all their
    records, in order, only the newest state's own epoch marked as still staged (to be made the
    checkpoint when told)."""
    folder = tmp_path / "trial-0000"
    folder.mkdir()
    unheard = [{"epoch": e, "val_acc": 0.5, "staged": False} for e in (3, 4)]
    record = {"epoch": 5, "val_acc": 0.55, "staged": False}
    meta = {STAGED_RECORD: record, STAGED_UNHEARD: unheard}
    (folder / STAGED_FILE.format(epoch=5)).write_bytes(_state(5, **meta))
    state, epoch, records = newest_state_within(str(folder), 3, 8, {}) or (b"", -1, [])
    assert epoch == 5 and read_meta(state)["epoch"] == 5
    assert [(r["epoch"], r["staged"], r["recovered"]) for r in records] == [
        (3, False, True),
        (4, False, True),
        (5, True, True),
    ]


class _Executor:
    """What a run's bookkeeping asks of its executor when an epoch comes in."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.promoted: list[int] = []

    def promote_staged(self, model_id: str, epoch: int) -> None:
        self.promoted.append(epoch)

    def report_epoch(self, outcome: Any, report: Any, controller: Any) -> bool:
        outcome.history.append(report)
        return True


def test_epochs_reach_the_controller_once_and_in_order_however_they_arrive() -> None:
    """A chain run again from states an earlier attempt staged tells their epochs only with its
    result, after the events of the epochs it trains: an epoch heard early waits for the ones
    before it, and one heard twice is told once; each staged state becomes the checkpoint in
    order (the checkpoint never runs ahead of the history)."""
    from mopflow.training.executors.base import ModelOutcome
    from mopflow.training.executors.task_run import TaskRun
    from mopflow.training.trainable.unit import ModelSpec

    executor = _Executor()
    run = TaskRun(executor, epochs=6, controller=None, waiting=[])  # type: ignore[arg-type]
    spec = ModelSpec("m", {})
    run.outcomes["m"], run.told["m"] = ModelOutcome(spec), 2
    run.active.add("m")

    def record(epoch: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "val_acc": 0.5,
            "train_loss": 1.0,
            "lr_end": 0.1,
            "worker": "w",
            "staged": True,
        }

    run.take_epoch("m", record(4))  # heard first: waits for epoch 3
    assert run.outcomes["m"].history == [] and executor.promoted == []
    for epoch in (3, 4):  # the result: the recovered epoch 3, then 4 again
        run.take_epoch("m", record(epoch))
    run.take_epoch("m", record(5), staged=False)  # the chain's last: its state is in hand
    assert [r.epoch for r in run.outcomes["m"].history] == [3, 4, 5]
    assert executor.promoted == [3, 4] and run.told["m"] == 5


def test_a_chain_whose_task_is_cancelled_stops_at_its_next_batch(
    small_manifest: str, dask_client: Any, tmp_path: Path
) -> None:
    """A coordinator that dies, or lets a chain's future go, leaves no chain training on for
    nobody: Dask cannot interrupt a running task, but the chain sees its task cancelled on its
    worker and ends at its next batch (here long before the 30 epochs it was given)."""
    import time

    from mopflow.training.data import load_manifest
    from mopflow.training.executors.chains import train_chain
    from mopflow.training.executors.units import DataRef, ModelSpec, init_state

    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    spec = ModelSpec(
        "m", {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}
    )
    folder = tmp_path / "m"
    args = (spec, init_state(spec, data), data, shards, 0, 30, 30, "no-one-listens", str(folder))
    future = dask_client.submit(train_chain, *args, pure=False)
    deadline = time.monotonic() + 120
    while not list(folder.glob("staged-*")) and time.monotonic() < deadline:  # its first epoch is done
        time.sleep(0.05)
    future.cancel()

    def running(dask_worker: Any) -> int:
        return int(dask_worker.state.executing_count)

    while sum(dask_client.run(running).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sum(dask_client.run(running).values())
    assert 1 <= len(list(folder.glob("staged-*"))) < 10


def test_a_chain_tells_a_decisions_epoch_at_once_and_the_others_with_it(
    small_manifest: str, dask_client: Any, tmp_path: Path
) -> None:
    """A chain of five epochs whose controller may stop the model only after the third, the
    others heard at most once a minute. Expected: two events, as the first epoch ends (a chain's
    first is heard at once) and as the third does, with the second's record; the first's and the
    third's states left staged for the coordinator (the second's removed as the third's was
    staged, the fourth's when the chain ended); the result's records say which are staged."""
    import threading

    from mopflow.training.data import load_manifest
    from mopflow.training.executors.chains import EPOCH_TOPIC, train_chain
    from mopflow.training.executors.units import DataRef, ModelSpec, init_state

    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    spec = ModelSpec(
        "m", {"family": "mlp", "width": 8, "depth": 1, "lr": 0.01, "weight_decay": 0.0, "batch_size": 64}
    )
    folder = tmp_path / "m"
    heard: list[dict[str, Any]] = []
    third_heard = threading.Event()

    def hear(event: tuple[float, dict[str, Any]]) -> None:
        if event[1].get("run") == "told-at-decisions":
            heard.append(event[1])
            if event[1]["records"][-1]["epoch"] == 2:
                third_heard.set()

    dask_client.subscribe_topic(EPOCH_TOPIC, hear)
    try:
        args = (
            spec,
            init_state(spec, data),
            data,
            shards,
            0,
            5,
            5,
            "told-at-decisions",
            str(folder),
            [2],
            60.0,
        )
        state, records = dask_client.submit(train_chain, *args, pure=False).result(timeout=120)
        assert third_heard.wait(timeout=30)
    finally:
        dask_client.unsubscribe_topic(EPOCH_TOPIC)
    assert [[r["epoch"] for r in event["records"]] for event in heard] == [[0], [1, 2]]
    assert [r["staged"] for r in heard[1]["records"]] == [False, True]
    assert sorted(p.name for p in folder.glob("staged-*")) == [STAGED_FILE.format(epoch=e) for e in (0, 2)]
    assert read_meta((folder / STAGED_FILE.format(epoch=2)).read_bytes())[STAGED_RECORD]["epoch"] == 2
    assert [(r["epoch"], r.get("staged")) for r in records] == [
        (0, True),
        (1, False),
        (2, True),
        (3, False),
        (4, None),  # the chain's last: its state is the result
    ]
    assert read_meta(state)["epoch"] == 4
