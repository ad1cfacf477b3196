"""What each host decides for itself (mopflow.base.hosts)."""

from __future__ import annotations

import os
import tempfile

import pytest

from mopflow.base.hosts import shard_cache_here, worker_shard_cache


def test_a_worker_caches_shards_where_its_own_variable_says() -> None:
    assert worker_shard_cache({"MOPFLOW_SHARD_CACHE": "/var/cache/shards"}, "/tmp") == "/var/cache/shards"


def test_without_the_variable_a_worker_caches_in_its_own_temporary_folder() -> None:
    expected = os.path.join("/scratch/tmp", "mopflow-shard-cache")
    assert worker_shard_cache({}, "/scratch/tmp") == expected
    assert worker_shard_cache({"MOPFLOW_SHARD_CACHE": " "}, "/scratch/tmp") == expected


def test_this_process_resolves_its_cache_from_its_own_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("MOPFLOW_SHARD_CACHE", "/here/cache")
    assert shard_cache_here() == "/here/cache"
    monkeypatch.delenv("MOPFLOW_SHARD_CACHE")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert shard_cache_here() == os.path.join(str(tmp_path), "mopflow-shard-cache")
