"""What each host decides for itself (mopflow.base.hosts)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import pytest

from mopflow.base.hosts import (
    AcrossHostsError,
    WorkerHost,
    across_hosts_problems,
    check_across_hosts,
    endpoints,
    host_names,
    is_host_local,
    is_loopback,
    shard_cache_here,
    storage_options_here,
    this_host,
    worker_shard_cache,
    worker_storage_options,
)
from mopflow.base.settings import Settings, SettingsError

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


# -- a cluster across hosts --------------------------------------------------------------------

S3 = {"MOPFLOW_DATA_ROOT": "s3://mopflow/data", "MOPFLOW_ARTIFACT_ROOT": "s3://mopflow/artifacts"}
LOOPBACK = json.dumps({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}})


def _settings(**env: str) -> Settings:
    return Settings.from_env({"MOPFLOW_HOME": "/home/coordinator/.mopflow", **env})


def _workers(*hosts: str, own: bool = False) -> dict[str, WorkerHost]:
    return {f"tcp://{host}-{i}:40000": WorkerHost(host, own) for i, host in enumerate(hosts)}


@pytest.mark.parametrize(
    ("location", "local"),
    [
        ("/home/coordinator/.mopflow/data", True),
        ("relative/data", True),
        ("file:///srv/data", True),
        ("memory://data", True),
        ("C:\\mopflow\\data", True),
        ("s3://mopflow/data", False),
        ("gs://mopflow/data", False),
        ("abfs://container/data", False),
    ],
)
def test_a_location_is_on_one_host_when_it_is_a_path_or_a_files_url(location: str, local: bool) -> None:
    assert is_host_local(location) is local


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("http://127.0.0.1:9000", True),
        ("http://127.0.1.1:9000", True),
        ("https://localhost", True),
        ("http://minio.localhost:9000", True),
        ("http://[::1]:9000", True),
        ("http://0.0.0.0:9000", True),
        ("localhost:9000", True),
        ("http://10.0.0.5:9000", False),
        ("https://s3.eu-west-1.amazonaws.com", False),
        ("http://minio:9000", False),
    ],
)
def test_an_endpoint_is_on_loopback_when_it_names_this_host(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_the_endpoints_of_storage_options_are_found_at_any_depth() -> None:
    options = {
        "key": "k",
        "endpoint_url": "http://a:9000",
        "client_kwargs": {"endpoint_url": "http://b:9000"},
    }
    assert endpoints(options) == ["http://a:9000", "http://b:9000"]
    assert endpoints({"anon": True, "client_kwargs": {"region_name": "eu-west-1"}}) == []


def test_workers_on_the_coordinators_host_accept_anything() -> None:
    """An embedded run, or the scale-out profile on one machine: local roots, loopback endpoint."""
    settings = _settings(MOPFLOW_STORAGE_OPTIONS=LOOPBACK)
    assert across_hosts_problems(settings, "coordinator", _workers("coordinator", "coordinator")) == []
    assert across_hosts_problems(settings, "coordinator", {}) == []


def test_local_roots_are_refused_with_workers_on_other_hosts_naming_setting_value_and_expectation() -> None:
    settings = _settings(MOPFLOW_ARTIFACT_ROOT="file:///srv/artifacts")
    with pytest.raises(AcrossHostsError) as refused:
        check_across_hosts(settings, "coordinator", _workers("coordinator", "gpu-1", "gpu-2"))
    message = str(refused.value)
    assert message.startswith("Dask workers run on other hosts (gpu-1, gpu-2) than this one (coordinator)")
    assert "MOPFLOW_DATA_ROOT='/home/coordinator/.mopflow/data' is on this host only" in message
    assert "MOPFLOW_ARTIFACT_ROOT='file:///srv/artifacts' is on this host only" in message
    assert "expected an s3:// (or another shared) URL that every worker host reaches" in message
    assert "MOPFLOW_STORAGE_OPTIONS" not in message


def test_a_loopback_endpoint_is_refused_unless_every_remote_worker_sets_its_own_options() -> None:
    settings = _settings(**S3, MOPFLOW_STORAGE_OPTIONS=LOOPBACK)
    mixed = _workers("coordinator") | _workers("gpu-1", own=True) | _workers("gpu-2", "gpu-3")
    (problem,) = across_hosts_problems(settings, "coordinator", mixed)
    assert problem.startswith("MOPFLOW_STORAGE_OPTIONS has the endpoint 'http://127.0.0.1:9000', on loopback")
    assert problem.endswith("(not set on gpu-2, gpu-3)")
    everyone = _workers("coordinator") | _workers("gpu-1", "gpu-2", own=True)
    assert across_hosts_problems(settings, "coordinator", everyone) == []


def test_shared_roots_and_a_reachable_endpoint_pass() -> None:
    settings = _settings(**S3, MOPFLOW_STORAGE_OPTIONS='{"endpoint_url": "https://s3.example.com"}')
    check_across_hosts(settings, "coordinator", _workers("gpu-1", "gpu-2"))


def test_the_refusal_is_a_settings_error_and_lists_few_hosts() -> None:
    assert issubclass(AcrossHostsError, SettingsError)
    workers = _workers(*(f"gpu-{i:02d}" for i in range(8)))
    assert host_names(workers.values()) == "gpu-00, gpu-01, gpu-02, gpu-03, gpu-04 and 3 more"


def test_a_worker_says_its_host_and_whether_it_sets_its_own_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOPFLOW_STORAGE_OPTIONS", "")
    assert this_host() == WorkerHost(socket.gethostname(), False)
    monkeypatch.setenv("MOPFLOW_STORAGE_OPTIONS", "{}")
    assert this_host().own_storage_options
