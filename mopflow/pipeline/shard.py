"""Stage 1: generate (or read) the dataset and shard it on Dask."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mopflow.base import storage
from mopflow.base.settings import Settings
from mopflow.base.tag_names import MANIFEST_HASH
from mopflow.pipeline.conf_input import check_data_roots
from mopflow.pipeline.context import stage
from mopflow.pipeline.hosts import check_cluster_hosts
from mopflow.pipeline.paths import MANIFEST_ARTIFACT
from mopflow.pipeline.records import RunContext, ShardRecord


def shard_stage(
    conf: Mapping[str, Any] | None, run: RunContext, settings: Settings | None = None
) -> ShardRecord:
    """Shard the dataset on Dask; returns the manifest URI and hash (reused when unchanged)."""
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.data import shard_dataset

    with stage("shard", conf, run, settings) as st:
        settings = st.settings
        # However the run was created (the API's trigger guard, `airflow dags trigger`, a user's
        # DAG), nothing outside the data roots is read: a permanent error, before any read.
        check_data_roots(st.cfg, settings.allowed_data_roots)
        storage.check_output_location(settings.data_root, st.storage_options, "MOPFLOW_DATA_ROOT")
        storage.check_output_location(settings.artifact_root, st.storage_options, "MOPFLOW_ARTIFACT_ROOT")
        with dask_client(settings.dask_address, settings.dask_workers) as client:
            # Workers on other hosts cannot reach this host's disk or loopback: refused at once.
            check_cluster_hosts(client, settings)
            result = shard_dataset(st.cfg.data, settings.data_root, client, st.storage_options)
        manifest = storage.read_json(result.manifest_uri, st.storage_options)
        st.tag_lineage({MANIFEST_HASH: result.manifest_hash})
        st.tracker.log_params(st.run_id, st.cfg.data.model_dump())
        rows = {f"rows_{s}": sum(e["rows"] for e in manifest["splits"][s]) for s in manifest["splits"]}
        st.tracker.log_metrics(st.run_id, rows)
        st.tracker.log_dict(st.run_id, manifest, MANIFEST_ARTIFACT)
    return ShardRecord(
        manifest_uri=result.manifest_uri, manifest_hash=result.manifest_hash, reused=result.reused
    )
