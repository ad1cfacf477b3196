"""How a DDP job reads its ranks' ends: ranks that lost each other at the same moment (a cut link
times both out together) are a lost rank, restarted elsewhere, not the trial's own error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mopflow.training.compute.workers import worker_addresses
from mopflow.training.executors.ddp_job import DDPJob, RankLost

GLOO_TIMEOUT = (
    "Got the following error when running the callback: RuntimeError: [third_party/gloo/gloo/"
    "transport/tcp/unbound_buffer.cc:78] Timed out waiting 45000ms for recv operation to complete"
)


def _collective_timed_out() -> None:
    raise RuntimeError(GLOO_TIMEOUT)


def test_ranks_that_failed_together_on_a_collective_are_a_lost_rank(dask_client: object) -> None:
    from distributed import wait

    client = dask_client
    workers = worker_addresses(client)[:2]
    futures = {
        client.submit(_collective_timed_out, workers=[w], pure=False, key=f"rank-{r}-lost-together"): (r, w)  # type: ignore[attr-defined]
        for r, w in enumerate(workers)
    }
    wait(list(futures))  # both done before the job looks: no check saw one of them still running
    job = SimpleNamespace(client=client, executor=SimpleNamespace(epoch_timeout_s=60.0))
    job._check_ranks = lambda f, d: DDPJob._check_ranks(job, f, d)  # type: ignore[arg-type]
    ranks = SimpleNamespace(futures=futures, reports=SimpleNamespace(qsize=lambda: 0))
    with pytest.raises(RankLost, match="lost its peers"):
        DDPJob._follow(job, ranks)  # type: ignore[arg-type]


def _rank_result() -> dict[str, int]:
    return {"rank": 1, "preempted": 3}


def test_a_rank_that_returned_before_its_worker_left_is_not_lost(dask_client: object) -> None:
    """A worker leaving on a spot notice hands its finished rank's result to another worker and
    goes: the job must read that rank's result, not count a lost rank (it did under load, when the
    other rank's result came in after the worker had left). A rank still running there is lost."""
    from distributed import Event, wait

    client = dask_client
    worker = worker_addresses(client)[0]
    gone = "tcp://192.0.2.1:4000"  # a worker no longer in the cluster
    finished = client.submit(_rank_result, workers=[worker], pure=False)  # type: ignore[attr-defined]
    wait([finished])
    job = SimpleNamespace(client=client)
    DDPJob._check_ranks(job, {finished: (1, gone)}, {finished})  # type: ignore[arg-type]
    release = Event(client=client)  # type: ignore[arg-type]
    running = client.submit(release.wait, 60, workers=[worker], pure=False)  # type: ignore[attr-defined]
    try:
        with pytest.raises(RankLost, match="left the cluster"):
            DDPJob._check_ranks(job, {finished: (1, gone), running: (0, gone)}, {finished})  # type: ignore[arg-type]
    finally:
        release.set()
        wait([running])
