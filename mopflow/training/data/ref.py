"""A reference to sharded data: where the shards are and what the data is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mopflow.base.hosts import storage_options_here
from mopflow.training.data.reading import load_manifest
from mopflow.training.models.families import DataSpec


@dataclass(frozen=True)
class DataRef:
    """Where the shards are and what the data is (passed to workers; small). Made from the
    manifest once (:meth:`open`); what is known of the data travels with it. Nothing of the
    coordinator's host travels: each worker caches shards in its own folder
    (:func:`mopflow.base.hosts.shard_cache_here`) and may reach storage its own way
    (:meth:`options_here`)."""

    manifest_uri: str
    spec: DataSpec
    storage_options: dict[str, Any] = field(default_factory=dict)  # the coordinator's
    augment: str = "none"  # the training batches' augmentation spec (training.trainable.augment)

    @classmethod
    def open(cls, manifest_uri: str, storage_options: Mapping[str, Any] | None = None) -> DataRef:
        """The ref of the shards of ``manifest_uri``, with the data spec its manifest gives."""
        manifest = load_manifest(manifest_uri, storage_options)
        return cls(manifest_uri, DataSpec.from_manifest(manifest), dict(storage_options or {}))

    def options_here(self) -> dict[str, Any]:
        """The storage options this process reads and writes the data with: on a worker that
        sets its own ``MOPFLOW_STORAGE_OPTIONS``, those; else the coordinator's
        (:func:`mopflow.base.hosts.worker_storage_options`)."""
        return storage_options_here(self.storage_options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataRef:
        """The ref as ``dataclasses.asdict`` wrote it (a DDP job's JSON). A ``cache_dir`` entry,
        which refs once carried (the coordinator's cache folder), is ignored."""
        return cls(
            str(data["manifest_uri"]),
            DataSpec(**data["spec"]),
            dict(data["storage_options"]),
            str(data.get("augment", "none")),
        )
