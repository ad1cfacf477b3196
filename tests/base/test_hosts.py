"""What each host decides for itself (mopflow.base.hosts)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from mopflow.base.hosts import (
    shard_cache_here,
    storage_options_here,
    worker_shard_cache,
    worker_storage_options,
)
from mopflow.base.settings import SettingsError

SENT = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}


def test_a_worker_caches_shards_where_its_own_variable_says() -> None:
    assert worker_shard_cache({"MOPFLOW_SHARD_CACHE": "/var/cache/shards"}, "/tmp") == "/var/cache/shards"


def test_without_the_variable_a_worker_caches_in_its_own_temporary_folder() -> None:
    expected = os.path.join("/scratch/tmp", "mopflow-shard-cache")
    assert worker_shard_cache({}, "/scratch/tmp") == expected
    assert worker_shard_cache({"MOPFLOW_SHARD_CACHE": " "}, "/scratch/tmp") == expected


def test_this_process_resolves_its_cache_from_its_own_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOPFLOW_SHARD_CACHE", "/here/cache")
    assert shard_cache_here() == "/here/cache"
    monkeypatch.delenv("MOPFLOW_SHARD_CACHE")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert shard_cache_here() == os.path.join(str(tmp_path), "mopflow-shard-cache")


def test_a_worker_without_storage_options_of_its_own_uses_the_coordinators() -> None:
    for environ in ({}, {"MOPFLOW_STORAGE_OPTIONS": ""}, {"MOPFLOW_STORAGE_OPTIONS": "  "}):
        options = worker_storage_options(SENT, environ)
        assert options == SENT and options is not SENT
    assert worker_storage_options(None, {}) == {}


def test_a_workers_own_storage_options_replace_the_coordinators_whole() -> None:
    """Its endpoint and its keys go together: nothing of the coordinator's is kept."""
    own = {"client_kwargs": {"endpoint_url": "http://10.0.0.7:9000"}}
    assert worker_storage_options(SENT, {"MOPFLOW_STORAGE_OPTIONS": json.dumps(own)}) == own
    # set to an empty object: the defaults (an instance role, the public endpoint), not the coordinator's
    assert worker_storage_options(SENT, {"MOPFLOW_STORAGE_OPTIONS": "{}"}) == {}


def test_a_workers_storage_options_that_are_no_json_object_are_refused() -> None:
    with pytest.raises(SettingsError, match="MOPFLOW_STORAGE_OPTIONS"):
        worker_storage_options(SENT, {"MOPFLOW_STORAGE_OPTIONS": "endpoint_url=x"})


def test_this_process_uses_its_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOPFLOW_STORAGE_OPTIONS", '{"anon": true}')
    assert storage_options_here(SENT) == {"anon": True}
    monkeypatch.delenv("MOPFLOW_STORAGE_OPTIONS")
    assert storage_options_here(SENT) == SENT
