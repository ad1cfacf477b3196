"""What differs from host to host: where a Dask worker caches shards, and how it reaches storage.

The coordinator (the process running a stage and its Dask client) sends every task what it needs
to find the data, but some of it belongs to the host that uses it. A local folder is one: a worker
resolves its own cache folder from its own environment. An endpoint can be another: the same
object store may be reached at another address from another host (a gateway per host, a private
network), so a worker that sets its own ``MOPFLOW_STORAGE_OPTIONS`` opens storage with those.

What a worker cannot fix is refused before a stage works on a cluster across hosts
(:func:`check_across_hosts`): a data or artifact root on the coordinator's disk, and a storage
endpoint on its loopback that the workers on other hosts would not replace with their own.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mopflow.base.settings import Settings, SettingsError, parse_storage_options

SHARD_CACHE_ENV = "MOPFLOW_SHARD_CACHE"
SHARD_CACHE_FOLDER = "mopflow-shard-cache"  # under the temporary folder, when the variable is unset
STORAGE_OPTIONS_ENV = "MOPFLOW_STORAGE_OPTIONS"

# The environment of the workers mopflow starts on the coordinator's own host (a LocalCluster, the
# local stack's workers): no storage options of their own, so they use what the coordinator sends,
# which may come from an Airflow connection they never see.
SAME_HOST_WORKER_ENV: dict[str, str] = {STORAGE_OPTIONS_ENV: ""}


def worker_shard_cache(environ: Mapping[str, str], temp_dir: str) -> str:
    """Where a worker caches remote shards: its ``MOPFLOW_SHARD_CACHE``, else a folder in its
    temporary folder ``temp_dir``."""
    return environ.get(SHARD_CACHE_ENV, "").strip() or os.path.join(temp_dir, SHARD_CACHE_FOLDER)


def shard_cache_here() -> str:
    """:func:`worker_shard_cache` of this process (called on the worker that reads the shards)."""
    return worker_shard_cache(os.environ, tempfile.gettempdir())


def worker_storage_options(sent: Mapping[str, Any] | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """The storage options a worker reads and writes with: its own ``MOPFLOW_STORAGE_OPTIONS``
    (in ``environ``) when it sets one, else ``sent``, the coordinator's. The worker's replace the
    coordinator's whole, keys included (they are not merged: an endpoint and the keys for it go
    together); set empty, the variable counts as unset."""
    own = environ.get(STORAGE_OPTIONS_ENV, "").strip()
    return parse_storage_options(own) if own else dict(sent or {})


def storage_options_here(sent: Mapping[str, Any] | None) -> dict[str, Any]:
    """:func:`worker_storage_options` of this process: what a task run on a worker opens storage
    with. In the coordinator's process the variable is normally what its settings were read from
    (a task sets an Airflow connection's options in it), so there the options come back as sent."""
    return worker_storage_options(sent, os.environ)


# -- a cluster across hosts --------------------------------------------------------------------

HOST_LOCAL_SCHEMES = frozenset({"file", "local", "memory"})  # what a path names: one host's, or one process's
ENDPOINT_KEYS = frozenset({"endpoint_url", "endpoint", "account_url", "host"})  # s3fs, gcsfs, adlfs, others
SHOWN_HOSTS = 5  # host names an error lists before "and N more"


class AcrossHostsError(SettingsError):
    """A setting that cannot work with Dask workers on other hosts than the coordinator's: a
    retry cannot fix it (a permanent error)."""


@dataclass(frozen=True)
class WorkerHost:
    """What a Dask worker says of itself: its host's name, and whether it sets its own
    ``MOPFLOW_STORAGE_OPTIONS``."""

    hostname: str
    own_storage_options: bool = False


def this_host() -> WorkerHost:
    """This process's :class:`WorkerHost` (the coordinator runs it on every worker)."""
    return WorkerHost(socket.gethostname(), bool(os.environ.get(STORAGE_OPTIONS_ENV, "").strip()))


def is_host_local(location: str) -> bool:
    """Whether a location is on one host only: a path (one letter before ``:`` is a Windows
    drive), ``file://``, ``local://`` or ``memory://``; another host sees another folder there."""
    scheme = urlsplit(location).scheme.lower()
    return len(scheme) <= 1 or scheme in HOST_LOCAL_SCHEMES


def endpoints(options: Mapping[str, Any]) -> list[str]:
    """The endpoints storage options name, at any depth: s3fs's ``endpoint_url`` (at the top or
    in ``client_kwargs``), and the ``endpoint``, ``account_url`` or ``host`` of other filesystems."""
    found: list[str] = []
    for key, value in options.items():
        if isinstance(value, Mapping):
            found += endpoints(value)
        elif key in ENDPOINT_KEYS and isinstance(value, str) and value:
            found.append(value)
    return found


def is_loopback(endpoint: str) -> bool:
    """Whether an endpoint (a URL, or ``host[:port]``) is the host that uses it: ``localhost``,
    127.0.0.0/8 or ``::1`` (and 0.0.0.0, which reaches the same)."""
    host = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: another host's, as far as this can tell
        return False
    return address.is_loopback or address.is_unspecified


def across_hosts_problems(
    settings: Settings, coordinator: str, workers: Mapping[str, WorkerHost]
) -> list[str]:
    """What cannot work when some of ``workers`` (by address) run on other hosts than the
    coordinator's (``coordinator``, its host name); empty when every worker is on its host.

    A data or artifact root on the coordinator's disk (:func:`is_host_local`) is one, each named
    with its value. An endpoint of the storage options on loopback (:func:`is_loopback`) is
    another, unless every worker on another host sets its own ``MOPFLOW_STORAGE_OPTIONS`` (which
    it then uses instead: :func:`worker_storage_options`)."""
    remote = [w for w in workers.values() if w.hostname != coordinator]
    if not remote:
        return []
    roots = (("MOPFLOW_DATA_ROOT", settings.data_root), ("MOPFLOW_ARTIFACT_ROOT", settings.artifact_root))
    problems = [
        f"{name}={value!r} is on this host only; expected an s3:// (or another shared) URL that every "
        "worker host reaches"
        for name, value in roots
        if is_host_local(value)
    ]
    loopback = [e for e in endpoints(settings.storage_options) if is_loopback(e)]
    without = [w for w in remote if not w.own_storage_options]
    if loopback and without:
        problems.append(
            f"MOPFLOW_STORAGE_OPTIONS has the endpoint {loopback[0]!r}, on loopback: a worker on another "
            "host would connect to itself; expected an endpoint that every worker host reaches, or "
            f"MOPFLOW_STORAGE_OPTIONS set on each worker host (not set on {host_names(without)})"
        )
    return problems


def check_across_hosts(settings: Settings, coordinator: str, workers: Mapping[str, WorkerHost]) -> None:
    """Raise :class:`AcrossHostsError` naming every :func:`across_hosts_problems` found."""
    problems = across_hosts_problems(settings, coordinator, workers)
    if problems:
        others = host_names(w for w in workers.values() if w.hostname != coordinator)
        where = f"Dask workers run on other hosts ({others}) than this one ({coordinator})"
        raise AcrossHostsError(f"{where}: {'; '.join(problems)}")


def host_names(workers: Iterable[WorkerHost]) -> str:
    """The workers' host names, each once, sorted; the first :data:`SHOWN_HOSTS` and how many more."""
    names = sorted({w.hostname for w in workers})
    more = len(names) - SHOWN_HOSTS
    return ", ".join(names[:SHOWN_HOSTS]) + (f" and {more} more" if more > 0 else "")
