"""A rendezvous port taken between its choice and rank 0's bind: another port, not a lost rank."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from mopflow.base.ports import port_was_taken
from mopflow.training.compute.workers import worker_addresses
from mopflow.training.executors.ddp_job import DDPJob, MasterPortTaken, RankLost


def _listen_on_a_taken_port() -> None:
    """What rank 0's TCPStore does when another process holds its port first."""
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        dist.TCPStore("127.0.0.1", holder.getsockname()[1], 1, True, timeout=timedelta(seconds=5))


def test_rank_zero_on_a_taken_port_is_told_apart_from_a_lost_rank(dask_client: object) -> None:
    """Fault: rank 0's TCPStore finds its port bound by another process (torch's real error, on
    a real Dask worker). Expected: MasterPortTaken (no interruption counted); the same error on
    rank 1, or a peer's connection error, stays RankLost."""
    from distributed import wait

    client = dask_client
    worker = worker_addresses(client)[0]
    future = client.submit(_listen_on_a_taken_port, workers=[worker], pure=False)  # type: ignore[attr-defined]
    wait([future])
    assert future.status == "error" and port_was_taken(future.exception())
    job = SimpleNamespace(client=client)
    with pytest.raises(MasterPortTaken, match="EADDRINUSE"):
        DDPJob._check_ranks(job, {future: (0, worker)}, {future})  # type: ignore[arg-type]
    with pytest.raises(RankLost):
        DDPJob._check_ranks(job, {future: (1, worker)}, {future})  # type: ignore[arg-type]
    assert not port_was_taken(ConnectionResetError("Connection reset by peer"))
