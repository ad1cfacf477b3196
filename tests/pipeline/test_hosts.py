"""The stages' check of their Dask cluster (mopflow.pipeline.hosts): workers asked over
``client.run``, on a real LocalCluster and on stand-ins for workers on other hosts."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from mopflow.base.hosts import AcrossHostsError, WorkerHost
from mopflow.base.settings import Settings
from mopflow.pipeline.context import permanent_errors
from mopflow.pipeline.hosts import check_cluster_hosts


class _OtherHosts:
    """A client whose workers answer as from other hosts (``run`` of their ``WorkerHost``)."""

    def __init__(self, *hosts: WorkerHost) -> None:
        self.hosts, self.asked = hosts, 0

    def run(self, function: Callable[[], Any]) -> dict[str, Any]:
        self.asked += 1
        return {f"tcp://10.0.0.{i}:40000": host for i, host in enumerate(self.hosts)}


def _settings(tmp_path: Any, **env: str) -> Settings:
    return Settings.from_env({"MOPFLOW_HOME": str(tmp_path), **env})


def test_an_embedded_run_asks_its_local_cluster_nothing(tmp_path: Any) -> None:
    client = _OtherHosts(WorkerHost("gpu-1"))
    check_cluster_hosts(client, _settings(tmp_path))  # no MOPFLOW_DASK_ADDRESS: a LocalCluster
    assert client.asked == 0


def test_a_scheduler_whose_workers_share_this_host_passes(tmp_path: Any, dask_client: Any) -> None:
    """The scale-out profile on one machine: local roots are fine when every worker is here."""
    check_cluster_hosts(dask_client, _settings(tmp_path, MOPFLOW_DASK_ADDRESS=dask_client.scheduler.address))


def test_workers_on_other_hosts_with_a_local_root_are_refused_permanently(tmp_path: Any) -> None:
    settings = _settings(tmp_path, MOPFLOW_DASK_ADDRESS="tcp://scheduler:8786")
    with pytest.raises(AcrossHostsError, match="MOPFLOW_DATA_ROOT=") as refused:
        check_cluster_hosts(_OtherHosts(WorkerHost("gpu-1"), WorkerHost("gpu-2")), settings)
    assert isinstance(refused.value, permanent_errors())  # the task is not retried
    assert f"than this one ({socket.gethostname()})" in str(refused.value)
