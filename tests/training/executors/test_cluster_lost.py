"""A coordinator that loses its Dask scheduler (its host cut off from the cluster) ends its attempt
with :class:`ClusterLost`, failing no trial: Dask cancelled the futures, the models did nothing wrong,
and the attempt's retry resumes them from their checkpoints."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import CancelledError

import pytest

from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.base import ClusterLost, ModelOutcome, TrainAll, raise_if_cluster_lost
from mopflow.training.executors.task import TaskExecutor

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}


class Watch(TrainAll):
    """Every model trains every epoch; the models told done are kept."""

    def __init__(self) -> None:
        self.done: list[ModelOutcome] = []

    def on_model_done(self, outcome: ModelOutcome) -> None:
        self.done.append(outcome)


def test_a_lost_scheduler_ends_the_attempt_and_fails_no_model(small_manifest: str) -> None:
    from distributed import Client, LocalCluster

    from mopflow.training.data import load_manifest

    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None)
    client = Client(cluster, timeout="2s")  # how long it tries to reconnect before closing
    try:
        executor = TaskExecutor(client, data, shards)
        watch = Watch()
        started = threading.Event()

        def lose_the_scheduler() -> None:
            while not client.processing() or not any(client.processing().values()):
                time.sleep(0.05)
            started.set()
            time.sleep(0.5)
            cluster.sync(cluster.scheduler.close)

        threading.Thread(target=lose_the_scheduler, daemon=True).start()
        with pytest.raises(ClusterLost, match="connection to the Dask scheduler was lost"):
            executor.run([ModelSpec("m0", CNN, 0)], epochs=30, controller=watch)
        assert started.is_set()
        assert watch.done == []  # no model was told finished or failed
    finally:
        for close in (client.close, cluster.close):  # neither has a scheduler to tell any more
            with contextlib.suppress(TimeoutError):
                close(timeout=2)


def test_only_a_cancel_for_a_lost_scheduler_is_the_clusters_loss() -> None:
    from distributed.client import FutureCancelledError

    with pytest.raises(ClusterLost):
        raise_if_cluster_lost(FutureCancelledError("k", "scheduler-connection-lost"))
    raise_if_cluster_lost(FutureCancelledError("k", "scheduler-restart"))  # judged as the unit's error
    raise_if_cluster_lost(CancelledError())
    raise_if_cluster_lost(RuntimeError("scheduler-connection-lost"))


class _Client:
    def __init__(self, status: str) -> None:
        self.status = status


def test_a_cancel_with_no_reason_from_a_client_without_its_scheduler_is_the_clusters_loss() -> None:
    """A client that gave up reconnecting closes and cancels what it held, naming no reason: a
    cancel seen then is the cluster's loss; the same cancel from a running client is not."""
    from distributed.client import FutureCancelledError

    for status in ("connecting", "closing", "closed"):
        with pytest.raises(ClusterLost):
            raise_if_cluster_lost(FutureCancelledError("k", "unknown"), _Client(status))
    raise_if_cluster_lost(FutureCancelledError("k", "unknown"), _Client("running"))
    raise_if_cluster_lost(RuntimeError("boom"), _Client("closed"))  # not a cancel: the unit's own error
