"""Which workers a Dask cluster has, asked of its scheduler at the moment of asking.

``Client.scheduler_info()`` does not return what it fetched: it fetches into the client's cached
identity and returns the cache, which the client's periodic refresh (every
``distributed.client.scheduler-info-interval``) also writes, asking for no workers. Read from
any thread but the client's event loop, its ``workers`` is now and then empty while every worker
is connected: a DDP rank or a MOP partition would be taken for lost. Everything here that needs
the workers asks through :func:`cluster_workers` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def cluster_workers(client: Any) -> dict[str, dict[str, Any]]:
    """Each worker connected to ``client``'s scheduler now: address -> its identity (``name``,
    ``nthreads``, ``resources``, ...), read in one call to the scheduler, never from a cache."""
    identity = client.sync(client.scheduler.identity, n_workers=-1)
    return dict(identity.get("workers") or {})


def worker_addresses(client: Any) -> list[str]:
    """Addresses of the workers connected to ``client``'s scheduler now, sorted."""
    return sorted(cluster_workers(client))


def declares(identity: Mapping[str, Any], resources: Mapping[str, float]) -> bool:
    """Whether a worker (its identity, as :func:`cluster_workers` gives it) declares at least
    ``resources`` (Dask resources, e.g. ``{"GPU": 1}``)."""
    held = identity.get("resources") or {}
    return all(float(held.get(name, 0)) >= float(amount) for name, amount in resources.items())


def workers_with(client: Any, resources: Mapping[str, float]) -> list[str]:
    """The workers connected now that declare ``resources``, sorted."""
    return sorted(a for a, w in cluster_workers(client).items() if declares(w, resources))


def joined_worker_addresses(client: Any, timeout_s: float = 120.0) -> list[str]:
    """:func:`worker_addresses`, once at least one worker has joined: where none has yet (a
    cluster still starting, or its only worker restarting under load), wait up to ``timeout_s``."""
    workers = worker_addresses(client)
    if not workers:
        client.wait_for_workers(1, timeout=timeout_s)
        workers = worker_addresses(client)
    return workers
