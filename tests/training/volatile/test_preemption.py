"""Spot notices on real Dask workers: SIGTERM makes the running pass stop at the next batch and
hand its state back; it goes on from that batch on the restarted worker, not from the epoch start."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.base import CHECKPOINT_FILE
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.study import checkpoint_folder
from mopflow.training.search.sweep import run_strategy_search
from mopflow.training.trainable.state import global_step
from mopflow.training.volatile.preempt import (
    PreemptionPlugin,
    UnitPreempted,
    lost_spans,
    redone_seconds,
    register_preemption,
)
from tests.dask_waits import wait_until_fit_batches
from tests.spaces import fixed_cnn_space

CNN_PARAMS = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}
SPACE = fixed_cnn_space(batch_size=32)


def test_grace_period_setting_is_validated() -> None:
    """The plugin reaches every worker with the grace period set; a bad setting is refused and
    installs nothing. (Threaded workers: the plugin installs no SIGTERM handler off the main
    thread, so this process keeps its own.)"""
    from distributed import Client, LocalCluster

    def grace_on_workers(dask_worker: Any) -> float | None:
        plugin = dask_worker.plugins.get(PreemptionPlugin.name)
        return None if plugin is None else float(plugin.grace_s)

    with (
        LocalCluster(n_workers=2, processes=False, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        for bad, needle in [("soon", "MOPFLOW_PREEMPT_GRACE_S='soon'"), ("0", "must be in")]:
            with pytest.raises(ValueError, match=needle):
                register_preemption(client, {"MOPFLOW_PREEMPT_GRACE_S": bad})
        assert list(client.run(grace_on_workers).values()) == [None, None]
        assert register_preemption(client, {"MOPFLOW_PREEMPT_GRACE_S": "12"}) == 12.0
        assert list(client.run(grace_on_workers).values()) == [12.0, 12.0]


@pytest.mark.slow
def test_sigterm_checkpoints_mid_epoch_and_the_trial_resumes_there(
    small_manifest: str, tmp_path: Path
) -> None:
    """Fault: the worker training a trial gets SIGTERM (a spot notice) mid-epoch.
    Expected: the trial checkpoints at the next batch, the worker leaves, and the trial resumes
    on the restarted worker from the checkpoint written on the notice, with the full history."""
    from mopflow.training.compute.cluster import dask_client

    storage_url, art, epochs = str(tmp_path / "journal.log"), str(tmp_path / "art"), 8
    # batches of 4 through a wide CNN: an epoch is a pass of some 200 slow steps (about a second),
    # long beside the wait between seeing it start and sending the signal
    space = fixed_cnn_space(batch_size=4, width=64, depth=4)
    cfg = SearchConfig(n_trials=1, epochs=epochs, parallel_trials=1, space=space, pruner="none")
    ckpt = Path(checkpoint_folder(art, "pre", 0)) / CHECKPOINT_FILE
    with dask_client("", 1) as client:
        outcome: dict[str, object] = {}
        runner = threading.Thread(
            target=lambda: outcome.update(
                result=run_strategy_search(cfg, small_manifest, "pre", storage_url, art, client)
            )
        )
        runner.start()
        deadline = time.monotonic() + 180
        while not ckpt.exists() and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.05)
        assert ckpt.exists(), "the trial should have finished an epoch"
        # the signal must land inside a pass past its first batch: not in the gap between two
        # epoch tasks, nor while the pass sets up (a notice then hands the epoch back at its start)
        assert wait_until_fit_batches(client, 1, runner.is_alive), "the second epoch should be training"
        (pid,) = client.run(os.getpid).values()
        os.kill(pid, signal.SIGTERM)
        runner.join(timeout=300)
        assert not runner.is_alive()
        (new_pid,) = client.run(os.getpid).values()
    assert new_pid != pid  # the preempted worker left; a fresh one finished the trial
    (result,) = outcome["result"].results  # type: ignore[attr-defined]
    assert result.state == "COMPLETE" and result.number == 0
    train_rows = sum(e["rows"] for e in load_manifest(small_manifest)["splits"]["train"])
    steps_per_epoch = -(-train_rows // 4)  # ceil(train rows / batch size)
    # it resumed from the state handed back on the notice, at the step where it was stopped
    assert result.resumed_from_step is not None and result.resumed_from_step > steps_per_epoch
    assert result.resumed_from_step % steps_per_epoch != 0  # mid-epoch, not at its start
    assert [h["epoch"] for h in result.history] == list(range(epochs))


class _NoticeAfter:
    """A notice flag that is raised at the ``n``-th batch-boundary check."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


@pytest.mark.slow
def test_a_trial_stopped_by_a_notice_resumes_exactly_where_it_stopped(
    small_manifest: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: a spot notice lands mid-epoch, or on (or just around) the last batch of the first
    epoch. Expected: the epoch hands itself back with its state at that batch (or whole, when the
    notice came on its last batch), and continued from that state the model ends exactly as an
    undisturbed one: every epoch once, the same validation accuracies and epoch losses."""
    from mopflow.training.executors.units import train_pass_and_validate
    from mopflow.training.volatile import preempt

    data = DataRef.open(small_manifest)
    shards = sorted(e["name"] for e in load_manifest(small_manifest)["splits"]["train"])
    spec = ModelSpec("trial-0000", CNN_PARAMS, seed=0)
    train_rows = sum(e["rows"] for e in load_manifest(small_manifest)["splits"]["train"])
    steps_per_epoch = -(-train_rows // 32)
    epochs = 3

    def train(state: bytes | None, start: int, history: list) -> tuple[Any, int]:
        """Epochs from ``start``: the final state, or the notice and the epoch it stopped."""
        for epoch in range(start, epochs):
            try:
                state, record, val_acc = train_pass_and_validate(
                    spec, state, data, shards, epoch, epochs, validate=True
                )
            except UnitPreempted as stopped:
                return stopped, epoch
            history.append((val_acc, record["train_loss"]))
        return state, epochs

    calm: list = []
    calm_state, _ = train(None, 0, calm)
    # The flag is read once before each pass and after every batch: the 6th read is mid-epoch;
    # the others fall on the first epoch's second-to-last and last batch, and before the second.
    for n in [6, *range(steps_per_epoch, steps_per_epoch + 3)]:
        history: list = []
        monkeypatch.setattr(preempt, "NOTICE", _NoticeAfter(n))
        stopped, at = train(None, 0, history)
        monkeypatch.undo()
        assert isinstance(stopped, UnitPreempted) and stopped.state is not None, n
        assert 0 < global_step(stopped.state) <= steps_per_epoch, n
        final, _ = train(stopped.state, at, history)
        assert history == calm, n
        assert _same_weights(final, calm_state), n


def _same_weights(a: bytes, b: bytes) -> bool:
    from safetensors.torch import load

    ta, tb = load(a), load(b)
    return sorted(ta) == sorted(tb) and all(bool((ta[k] == tb[k]).all()) for k in ta)


def test_unit_stopped_by_a_notice_continues_in_the_same_data_order(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MOP unit told to stop at batch 5 packs weights, optimizer, position and RNG; continuing
    from that state gives exactly the weights of the pass run without a stop."""
    import torch
    from safetensors.torch import load

    from mopflow.training.executors.units import DataRef, ModelSpec, init_state, train_pass
    from mopflow.training.trainable.state import partial_meta
    from mopflow.training.volatile import preempt
    from mopflow.training.volatile.preempt import UnitPreempted

    data = DataRef.open(small_manifest)
    shards = sorted(e["name"] for e in load_manifest(small_manifest)["splits"]["train"])[:1]
    spec = ModelSpec("m", {**CNN_PARAMS, "batch_size": 16}, seed=3)
    start, _ = train_pass(spec, init_state(spec, data), data, shards, 0, 3, 1)
    whole, record = train_pass(spec, start, data, shards, 1, 3, 1, {"visited": ["p1"]})
    assert record["resumed_at_batch"] == 0
    monkeypatch.setattr(preempt, "NOTICE", _NoticeAfter(6))  # read before the pass, then per batch
    with pytest.raises(UnitPreempted) as stopped:
        train_pass(spec, start, data, shards, 1, 3, 1, {"visited": ["p1"]})
    monkeypatch.undo()
    assert stopped.value.record["batches"] == 5 and stopped.value.state is not None
    assert stopped.value.record["start"] <= stopped.value.record["saved_at"] <= stopped.value.record["end"]
    position = partial_meta(stopped.value.state)
    assert position is not None
    assert {k: position[k] for k in ("epoch", "pass_index", "part", "batches")} == {
        "epoch": 1,
        "pass_index": 1,
        "part": ",".join(shards),
        "batches": 5,
    }
    resumed, record = train_pass(spec, stopped.value.state, data, shards, 1, 3, 1, {"visited": ["p1"]})
    assert record["resumed_at_batch"] == 5 and partial_meta(resumed) is None
    a, b = load(whole), load(resumed)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # a partial state of another pass is not continued (that pass starts from its first batch)
    _, other = train_pass(spec, stopped.value.state, data, shards, 1, 3, 0)
    assert other["resumed_at_batch"] == 0


def test_lost_spans_and_redone_seconds_from_a_scheduler_story() -> None:
    """A task ran on a worker that died (10-14), ran again after a notice checkpoint (20-25, saved
    at 24.5) and finished (30-33). Redone: 4 s (no checkpoint) + 0.5 s after the checkpoint."""
    story = [
        ("k", "released", "waiting", {}, "s", 9.0),
        ("k", "waiting", "processing", {}, "s", 10.0),
        ("k", "processing", "released", {}, "handle-worker-cleanup", 14.0),
        ("k", "released", "waiting", {}, "s", 14.0),
        ("k", "queued", "processing", {}, "s", 20.0),
        ("k", "processing", "waiting", {}, "reschedule", 25.0),
        ("k", "waiting", "processing", {}, "s", 30.0),
        ("k", "processing", "memory", {}, "task-finished", 33.0),
    ]
    assert lost_spans(story) == [(10.0, 14.0), (20.0, 25.0)]
    assert redone_seconds(lost_spans(story), [5.0, 24.5, 31.0]) == pytest.approx(4.5)
    assert redone_seconds([], [1.0]) == 0.0
    erred = [("k", "waiting", "processing", {}, "s", 1.0), ("k", "processing", "erred", {}, "s", 2.0)]
    assert lost_spans(erred) == []  # an error is an answer, not lost work
    result_lost = [  # finished, but the worker died holding the result: computed again
        ("k", "waiting", "processing", {}, "s", 1.0),
        ("k", "processing", "memory", {}, "task-finished", 3.0),
        ("k", "memory", "released", {}, "handle-worker-cleanup", 3.5),
        ("k", "released", "waiting", {}, "s", 3.5),
        ("k", "waiting", "processing", {}, "s", 4.0),
        ("k", "processing", "memory", {}, "task-finished", 6.0),
    ]
    assert lost_spans(result_lost) == [(1.0, 3.0)]
    assert lost_spans(result_lost[:3]) == []  # a result fetched and released is not lost


def test_unit_stopped_by_a_notice_is_its_models_next_unit() -> None:
    """The MOP invariants hold around a notice: the stopped unit goes back to the queue and its
    model runs no other unit before it; a restarted worker takes a partition back."""
    from mopflow.training.executors.scheduler import MopScheduler, round_robin

    scheduler = MopScheduler(round_robin(["p0", "p1"], ["w0", "w1"]), seed=0)
    scheduler.start_epoch(["a", "b"])
    first = dict(scheduler.assign(["w0", "w1"]))
    stopped = first["w0"]
    scheduler.lose_worker("w0", ["w1"], saved=True)  # w0 got the notice and left
    assert scheduler.resume == {stopped.model: stopped.partition}
    assert scheduler.placement == {"p0": "w1", "p1": "w1"}
    scheduler.complete("w1")
    assert scheduler.add_worker("w2") == ["p0"] and scheduler.placement == {"p0": "w2", "p1": "w1"}
    assert scheduler.add_worker("w2") == []  # it holds a partition now
    order = []
    while not scheduler.epoch_finished:
        for worker, unit in scheduler.assign(["w1", "w2"]):
            order.append(unit)
            scheduler.complete(worker)
    mine = [u for u in order if u.model == stopped.model]
    assert mine[0] == stopped  # the model finished the stopped pass before anything else
    assert sorted((u.model, u.partition) for u in [*order, first["w1"]]) == sorted(
        (m, p) for m in "ab" for p in ("p0", "p1")
    )
    assert scheduler.resume == {}


async def _heartbeat_missing_while_leaving(dask_worker: Any) -> str:
    """What a leaving worker does (the plugin's guard), then what Dask's worker does when the
    scheduler answers its heartbeat "missing" after having removed it."""
    from mopflow.training.volatile.preempt import _keep_the_nanny

    _keep_the_nanny(dask_worker)
    dask_worker.loop.add_callback(dask_worker.close, reason="worker-heartbeat-missing")
    return str(dask_worker.address)


def test_a_leaving_worker_closed_on_a_missed_heartbeat_is_restarted_by_its_nanny() -> None:
    """Fault: the scheduler has removed a preempted worker (its graceful close retired it) when
    one of its heartbeats arrives; Dask's worker closes itself, nanny included. Expected: the
    nanny stays and a fresh worker process joins in the leaving one's place."""
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.compute.workers import cluster_workers

    with dask_client("", 1) as client:
        (left,) = client.run(_heartbeat_missing_while_leaving).values()
        deadline = time.monotonic() + 60
        while set(cluster_workers(client)) in (set(), {left}):
            assert time.monotonic() < deadline, "no worker came back"
            time.sleep(0.2)
        assert left not in cluster_workers(client)
