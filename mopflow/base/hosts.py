"""What differs from host to host: where a Dask worker caches shards, and how it reaches storage.

The coordinator (the process running a stage and its Dask client) sends every task what it needs
to find the data, but some of it belongs to the host that uses it. A local folder is one: a worker
resolves its own cache folder from its own environment. An endpoint can be another: the same
object store may be reached at another address from another host (a gateway per host, a private
network), so a worker that sets its own ``MOPFLOW_STORAGE_OPTIONS`` opens storage with those.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

from mopflow.base.settings import parse_storage_options

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
