"""What differs from host to host: where a Dask worker caches shards.

The coordinator (the process running a stage and its Dask client) sends every task what it needs
to find the data, but a local folder is a property of the host that uses it: a worker resolves its
own, from its own environment, so that each host of a cluster can keep its cache where it has room.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

SHARD_CACHE_ENV = "MOPFLOW_SHARD_CACHE"
SHARD_CACHE_FOLDER = "mopflow-shard-cache"  # under the temporary folder, when the variable is unset


def worker_shard_cache(environ: Mapping[str, str], temp_dir: str) -> str:
    """Where a worker caches remote shards: its ``MOPFLOW_SHARD_CACHE``, else a folder in its
    temporary folder ``temp_dir``."""
    return environ.get(SHARD_CACHE_ENV, "").strip() or os.path.join(temp_dir, SHARD_CACHE_FOLDER)


def shard_cache_here() -> str:
    """:func:`worker_shard_cache` of this process (called on the worker that reads the shards)."""
    return worker_shard_cache(os.environ, tempfile.gettempdir())
