"""The stages' check of the Dask cluster they work on: settings that cannot work with workers on
other hosts are refused before any work (the rules are :mod:`mopflow.base.hosts`')."""

from __future__ import annotations

from socket import gethostname
from typing import Any

from mopflow.base.hosts import WorkerHost, check_across_hosts, this_host
from mopflow.base.settings import Settings


def check_cluster_hosts(client: Any, settings: Settings) -> None:
    """Ask every worker of the scheduler at ``MOPFLOW_DASK_ADDRESS`` for its host name and
    whether it sets its own storage options, and raise
    :class:`~mopflow.base.hosts.AcrossHostsError` (a permanent error) when some run on other hosts
    than this one and the settings cannot work there. A LocalCluster (no address) runs on this
    host: nothing is asked."""
    if not settings.dask_address:
        return
    workers: dict[str, WorkerHost] = client.run(this_host)
    check_across_hosts(settings, gethostname(), workers)
