"""A DataRef travels to workers (pickled by Dask, as JSON in a DDP job) and comes back the same."""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, fields

import pytest

from mopflow.training.data.ref import DataRef
from mopflow.training.models.families import DataSpec

REF = DataRef(
    "s3://bucket/data/datasets/abc/manifest.json",
    DataSpec(12, 3, (3, 2, 2), "image"),
    {"client_kwargs": {"endpoint_url": "http://minio:9000"}},
    "flip",
)


def test_a_ref_round_trips_through_a_ddp_jobs_json_and_a_pickle() -> None:
    assert DataRef.from_dict(json.loads(json.dumps(asdict(REF)))) == REF
    assert pickle.loads(pickle.dumps(REF)) == REF


def test_a_ref_carries_no_folder_of_the_coordinators_host() -> None:
    """Where shards are cached is each worker's own setting (mopflow.base.hosts)."""
    assert "cache_dir" not in {f.name for f in fields(DataRef)}
    assert "cache_dir" not in asdict(REF)


def test_a_ddp_job_written_with_a_cache_folder_is_still_read() -> None:
    """A job description of an older coordinator named its cache folder: it is ignored."""
    older = asdict(REF) | {"cache_dir": "/tmp/coordinator-cache"}
    assert DataRef.from_dict(json.loads(json.dumps(older))) == REF
    without_augment = {k: v for k, v in asdict(REF).items() if k != "augment"}
    assert DataRef.from_dict(without_augment).augment == "none"


def test_a_ref_is_read_with_this_workers_own_storage_options_when_it_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MOPFLOW_STORAGE_OPTIONS", raising=False)
    assert REF.options_here() == REF.storage_options
    monkeypatch.setenv("MOPFLOW_STORAGE_OPTIONS", '{"endpoint_url": "http://10.0.0.7:9000"}')
    assert REF.options_here() == {"endpoint_url": "http://10.0.0.7:9000"}
    assert REF.storage_options == {"client_kwargs": {"endpoint_url": "http://minio:9000"}}  # as sent
