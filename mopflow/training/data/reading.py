"""Reading a sharded dataset: its manifest, its shards and splits, each verified against the
manifest's hashes (streaming, on the workers when a client is given)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mopflow.base import storage
from mopflow.base.hosts import storage_options_here
from mopflow.training.data.examples import decode_examples
from mopflow.training.data.manifest import MANIFEST_VERSION, SPLITS, ShardIntegrityError
from mopflow.training.data.rules import manifest_hash


def load_manifest(manifest_uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read a manifest and check that it is one and that its hash matches its content."""
    try:
        manifest: Any = storage.read_json(manifest_uri, storage_options)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"manifest {manifest_uri} does not exist") from exc
    except ValueError as exc:  # not JSON text (a UnicodeDecodeError is a ValueError too)
        raise ShardIntegrityError(
            f"{manifest_uri} is not a mopflow manifest: it is not JSON ({exc})"
        ) from exc
    if not isinstance(manifest, dict):
        raise ShardIntegrityError(
            f"{manifest_uri} is not a mopflow manifest: it holds a JSON {type(manifest).__name__}, not an object"
        )
    if manifest.get("version") != MANIFEST_VERSION or "splits" not in manifest:
        raise ShardIntegrityError(
            f"{manifest_uri} is not a mopflow manifest (version {MANIFEST_VERSION}): it has version "
            f"{manifest.get('version')!r} and {'a' if 'splits' in manifest else 'no'} 'splits' entry"
        )
    if manifest_hash(manifest) != manifest.get("manifest_hash"):
        raise ShardIntegrityError(
            f"manifest {manifest_uri} was modified: its hash does not match its content"
        )
    return manifest


def _manifest_dir(manifest_uri: str) -> str:
    return manifest_uri.rsplit("/", 1)[0]


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _fetch_shard(
    url: str, entry: Mapping[str, Any], storage_options: Mapping[str, Any] | None, cache_dir: str | None
) -> bytes:
    """A shard's bytes; remote shards are cached on local disk under their sha256 (re-verified on use)."""
    cached = None
    if cache_dir and not _is_local(url):
        cached = Path(cache_dir) / f"{entry['sha256']}.parquet"
        if cached.exists():
            data = cached.read_bytes()
            if storage.sha256_bytes(data) == entry["sha256"]:
                return data
            cached.unlink()  # a damaged cache entry is fetched again
    try:
        data = storage.read_bytes(url, storage_options)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"shard {entry['name']} is missing ({url})") from exc
    if cached is not None and storage.sha256_bytes(data) == entry["sha256"]:
        storage.write_bytes_atomic(str(cached), data)
    return data


def read_shard(
    manifest_uri: str,
    manifest: Mapping[str, Any],
    entry: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
) -> pd.DataFrame:
    """Read one shard, verifying its checksum and schema; errors name the shard."""
    url = storage.join(_manifest_dir(manifest_uri), str(entry["name"]))
    data = _fetch_shard(url, entry, storage_options, cache_dir)
    digest = storage.sha256_bytes(data)
    if digest != entry["sha256"]:
        raise ShardIntegrityError(
            f"shard {entry['name']} is corrupt: sha256 {digest[:12]}… does not match the manifest's {str(entry['sha256'])[:12]}…"
        )
    frame = pd.read_parquet(io.BytesIO(data))
    schema = {c: str(t) for c, t in frame.dtypes.items()}
    if schema != manifest["schema"]:
        raise ShardIntegrityError(f"shard {entry['name']} has schema {schema}, expected {manifest['schema']}")
    return frame


def load_split(
    manifest_uri: str,
    split: str,
    storage_options: Mapping[str, Any] | None = None,
    shard_names: Sequence[str] | None = None,
    cache_dir: str | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32) and labels (int64) of a split, read from its verified shards.

    ``shard_names`` restricts reading to the shards a worker holds; memory is bounded by those.
    ``manifest`` is the one at ``manifest_uri`` when the caller has read it already.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    if manifest is None:
        manifest = load_manifest(manifest_uri, storage_options)
    entries = [e for e in manifest["splits"][split] if shard_names is None or e["name"] in shard_names]
    frames = [read_shard(manifest_uri, manifest, e, storage_options, cache_dir) for e in entries]
    return shard_arrays(pd.concat(frames, ignore_index=True), manifest)


def shard_arrays(frame: pd.DataFrame, manifest: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """A shard's rows as features (float32; examples decoded, images resized) and labels (int64)."""
    layout = manifest.get("example")
    if layout is not None:  # one example column: decoded (images resized) into flat rows
        x = decode_examples(frame[layout["column"]].to_numpy(), layout)
    else:  # writable and C-ordered (torch takes it without a copy; a read-only view of Arrow's is copied)
        x = np.require(frame[manifest["feature_columns"]].to_numpy(dtype=np.float32), requirements=["C", "W"])
    y = np.require(frame[manifest["label_column"]].to_numpy(dtype=np.int64), requirements=["W"])
    return x, y


def stored_images(
    manifest_uri: str, split: str, count: int, storage_options: Mapping[str, Any] | None = None
) -> list[bytes]:
    """The first ``count`` examples of a split of encoded images, as stored (the bytes a client
    sends a served model); empty for other data."""
    manifest = load_manifest(manifest_uri, storage_options)
    layout = manifest.get("example")
    if layout is None or layout["encoding"] != "image":
        return []
    found: list[bytes] = []
    for entry in manifest["splits"][split]:
        frame = read_shard(manifest_uri, manifest, entry, storage_options)
        found += [bytes(v) for v in frame[layout["column"]].iloc[: count - len(found)]]
        if len(found) >= count:
            break
    return found


def split_shards(
    manifest_uri: str,
    split: str,
    storage_options: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A split's features and labels one verified shard at a time (memory: one shard); ``manifest``
    is the one at ``manifest_uri`` when the caller has read it already."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    if manifest is None:  # read and verified once, not per shard
        manifest = load_manifest(manifest_uri, storage_options)
    for entry in manifest["splits"][split]:
        yield shard_arrays(read_shard(manifest_uri, manifest, entry, storage_options), manifest)


def shard_problem(
    manifest_uri: str,
    entry: Mapping[str, Any],
    schema: Mapping[str, str],
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """What is wrong with one shard (missing, corrupt, another schema), or None. The bytes are
    hashed as they stream (1 MiB at a time) and only the parquet footer is decoded, so the memory
    it takes does not grow with the shard."""
    import pyarrow.parquet as pq

    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    url = storage.join(_manifest_dir(manifest_uri), str(entry["name"]))
    try:
        digest = storage.sha256_url(url, storage_options)
    except FileNotFoundError:
        return f"shard {entry['name']} is missing ({url})"
    if digest != entry["sha256"]:
        return (
            f"shard {entry['name']} is corrupt: sha256 {digest[:12]}… does not match the manifest's "
            f"{str(entry['sha256'])[:12]}…"
        )
    fs, path = storage.filesystem(url, storage_options)
    with fs.open(path, "rb") as handle:
        found = {c: str(t) for c, t in pq.read_schema(handle).empty_table().to_pandas().dtypes.items()}
    if found != dict(schema):
        return f"shard {entry['name']} has schema {found}, expected {dict(schema)}"
    return None


def verify_manifest(
    manifest_uri: str, storage_options: Mapping[str, Any] | None = None, client: Any = None
) -> dict[str, Any]:
    """Check every shard of a manifest before any training starts; raise naming the first bad
    shard. With a Dask ``client`` the shards are checked on the workers (one task per shard, the
    answers are short strings), else here; either way each is hashed as it streams."""
    manifest = load_manifest(manifest_uri, storage_options)
    entries = [entry for split in SPLITS for entry in manifest["splits"][split]]
    schema, options = manifest["schema"], dict(storage_options or {})
    if client is None:
        problems = [shard_problem(manifest_uri, e, schema, options) for e in entries]
    else:
        futures = client.map(
            shard_problem,
            [manifest_uri] * len(entries),
            entries,
            [schema] * len(entries),
            [options] * len(entries),
            pure=False,
            key=[f"verify-{e['name'].replace('/', '-')}-{time.monotonic_ns()}" for e in entries],
        )
        problems = client.gather(futures)
    for problem in problems:
        if problem is not None:
            raise ShardIntegrityError(problem)
    return manifest
