"""Data sharding on Dask: generate or read a dataset, split it, write parquet shards + manifest.

Output is content-addressed: the folder name is a hash of the source and the shard config,
so a rerun with the same input reuses the shards (the manifest is written last, so its
presence means the shards are complete).
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from infra import storage
from training.config import DataConfig

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
LABEL_COLUMN = "label"
SPLITS = ("train", "validation", "test")


class ShardIntegrityError(RuntimeError):
    """A shard is missing, corrupt or has the wrong schema. Never retried: rerunning cannot fix it."""


@dataclass(frozen=True)
class ShardResult:
    """Where the sharded dataset is, and whether an existing one was reused."""

    manifest_uri: str
    manifest_hash: str
    reused: bool


# ---------------------------------------------------------------------------------------------
# Pure helpers


def row_unit_interval(features: np.ndarray, labels: np.ndarray, salt: str) -> np.ndarray:
    """A number in [0, 1) per row from a hash of its content: the split does not move when rows are appended."""
    feats = np.ascontiguousarray(features, dtype=np.float32)
    labs = np.asarray(labels, dtype=np.int64)
    out = np.empty(len(feats), dtype=np.float64)
    salt_b = salt.encode()
    for i in range(len(feats)):
        digest = hashlib.blake2b(feats[i].tobytes() + labs[i].tobytes(), digest_size=8, key=salt_b).digest()
        out[i] = int.from_bytes(digest, "big") / 2.0**64
    return out


def feature_columns(n_features: int) -> list[str]:
    """Column names of the generated datasets' features."""
    return [f"x{i:03d}" for i in range(n_features)]


def shard_key(source: Mapping[str, Any], cfg: DataConfig) -> str:
    """Content address of a sharded dataset: the source fingerprint plus the shard config."""
    return storage.canonical_hash(
        {
            "source": dict(source),
            "n_shards": cfg.n_shards,
            "val_fraction": cfg.val_fraction,
            "v": MANIFEST_VERSION,
        }
    )[:16]


def even_chunks(n_rows: int, n_chunks: int) -> list[tuple[int, int]]:
    """Split ``range(n_rows)`` into ``n_chunks`` contiguous ranges whose sizes differ by at most one."""
    if n_chunks > n_rows:
        raise ValueError(f"cannot cut {n_rows} rows into {n_chunks} shards: more shards than rows")
    base, extra = divmod(n_rows, n_chunks)
    bounds, start = [], 0
    for i in range(n_chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def combine_stats(parts: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """Feature mean/std from per-shard sums and sums of squares (one pass over the data)."""
    count = sum(int(p["rows"]) for p in parts)
    total = np.sum([np.asarray(p["sum"]) for p in parts], axis=0)
    total_sq = np.sum([np.asarray(p["sumsq"]) for p in parts], axis=0)
    mean = total / count
    var = np.maximum(total_sq / count - mean**2, 0.0)
    return mean.tolist(), np.sqrt(var).tolist()


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    """Hash of a manifest's content (everything but its timestamps and its own hash)."""
    return storage.canonical_hash(
        {k: v for k, v in manifest.items() if k not in {"created_at", "manifest_hash"}}
    )


# ---------------------------------------------------------------------------------------------
# Tasks that run on Dask workers


def generate_mnist1d(num_samples: int, seed: int, val_fraction: float) -> pd.DataFrame:
    """MNIST-1D from the ``mnist1d`` package (defaults + seed), with a ``split`` column."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    data = make_dataset(args)
    cols = feature_columns(data["x"].shape[1])
    train = pd.DataFrame(np.asarray(data["x"], dtype=np.float32), columns=cols)
    train[LABEL_COLUMN] = np.asarray(data["y"], dtype=np.int64)
    u = row_unit_interval(train[cols].to_numpy(), train[LABEL_COLUMN].to_numpy(), salt=f"val-{seed}")
    train["split"] = np.where(u < val_fraction, "validation", "train")
    test = pd.DataFrame(np.asarray(data["x_test"], dtype=np.float32), columns=cols)
    test[LABEL_COLUMN] = np.asarray(data["y_test"], dtype=np.int64)
    test["split"] = "test"
    return pd.concat([train, test], ignore_index=True)


def write_shard(
    frame: pd.DataFrame,
    split: str,
    start: int,
    stop: int,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write rows [start, stop) of ``split`` as one parquet shard; return its stats for the manifest."""
    part = frame[frame["split"] == split].iloc[start:stop].drop(columns=["split"]).reset_index(drop=True)
    buffer = io.BytesIO()
    part.to_parquet(buffer, index=False)
    data = buffer.getvalue()
    storage.write_bytes_atomic(url, data, storage_options)
    feats = part.drop(columns=[LABEL_COLUMN]).to_numpy(dtype=np.float64)
    counts = part[LABEL_COLUMN].value_counts().sort_index()
    return {
        "rows": len(part),
        "bytes": len(data),
        "sha256": storage.sha256_bytes(data),
        "class_counts": {str(int(k)): int(v) for k, v in counts.items()},
        "sum": feats.sum(axis=0).tolist(),
        "sumsq": (feats**2).sum(axis=0).tolist(),
        "schema": {c: str(t) for c, t in part.dtypes.items()},
    }


# ---------------------------------------------------------------------------------------------
# The stage


def shard_dataset(
    cfg: DataConfig,
    data_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardResult:
    """Generate ``cfg.dataset`` on the Dask cluster and write shards + manifest under ``data_root``.

    Reuses an existing, complete output with the same content address.
    """
    source = {
        "dataset": cfg.dataset,
        "num_samples": cfg.num_samples,
        "seed": cfg.seed,
        "generator": "mnist1d-0.0.2",
    }
    key = shard_key(source, cfg)
    out_dir = storage.join(data_root, "datasets", f"{cfg.dataset}-{key}")
    manifest_uri = storage.join(out_dir, MANIFEST_NAME)
    if storage.exists(manifest_uri, storage_options):
        existing = storage.read_json(manifest_uri, storage_options)
        log.info(
            "shard: reusing existing shards at %s (manifest %s)", out_dir, existing["manifest_hash"][:12]
        )
        return ShardResult(manifest_uri, existing["manifest_hash"], reused=True)

    started = time.monotonic()
    log.info("shard: generating %s (%d samples, seed %d) on Dask", cfg.dataset, cfg.num_samples, cfg.seed)
    frame = client.submit(generate_mnist1d, cfg.num_samples, cfg.seed, cfg.val_fraction, pure=False)
    counts = client.submit(lambda f: f["split"].value_counts().to_dict(), frame).result()
    per_split_chunks = {"train": cfg.n_shards, "validation": 1, "test": 1}
    futures: dict[str, list[Any]] = {}
    names: dict[str, list[str]] = {}
    for split, n_chunks in per_split_chunks.items():
        n_rows = int(counts.get(split, 0))
        futures[split], names[split] = [], []
        for i, (start, stop) in enumerate(even_chunks(n_rows, n_chunks)):
            name = f"{split}-{i:05d}.parquet"
            names[split].append(name)
            futures[split].append(
                client.submit(
                    write_shard, frame, split, start, stop, storage.join(out_dir, name), storage_options
                )
            )
    results = {split: client.gather(fs) for split, fs in futures.items()}
    n_features = len(results["train"][0]["schema"]) - 1
    mean, std = combine_stats(results["train"])
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "dataset": cfg.dataset,
        "source": source,
        "config": cfg.model_dump(),
        "feature_columns": feature_columns(n_features),
        "label_column": LABEL_COLUMN,
        "num_classes": 10,
        "schema": results["train"][0]["schema"],
        "normalization": {"mean": mean, "std": std},
        "splits": {
            split: [
                {k: v for k, v in r.items() if k not in {"sum", "sumsq", "schema"}} | {"name": n}
                for n, r in zip(names[split], results[split], strict=True)
            ]
            for split in SPLITS
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest["manifest_hash"] = manifest_hash(manifest)
    storage.write_json_atomic(manifest_uri, manifest, storage_options)
    rows = {s: sum(e["rows"] for e in manifest["splits"][s]) for s in SPLITS}
    log.info(
        "shard: wrote %d train shards (%s rows per split) to %s in %.1fs",
        cfg.n_shards,
        rows,
        out_dir,
        time.monotonic() - started,
    )
    return ShardResult(manifest_uri, manifest["manifest_hash"], reused=False)


# ---------------------------------------------------------------------------------------------
# Reading


def load_manifest(manifest_uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read a manifest and check that it is one and that its hash matches its content."""
    try:
        manifest: dict[str, Any] = storage.read_json(manifest_uri, storage_options)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"manifest {manifest_uri} does not exist") from exc
    if manifest.get("version") != MANIFEST_VERSION or "splits" not in manifest:
        raise ShardIntegrityError(f"{manifest_uri} is not a mopflow manifest (version {MANIFEST_VERSION})")
    if manifest_hash(manifest) != manifest.get("manifest_hash"):
        raise ShardIntegrityError(
            f"manifest {manifest_uri} was modified: its hash does not match its content"
        )
    return manifest


def _manifest_dir(manifest_uri: str) -> str:
    return manifest_uri.rsplit("/", 1)[0]


def read_shard(
    manifest_uri: str,
    manifest: Mapping[str, Any],
    entry: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """Read one shard, verifying its checksum and schema; errors name the shard."""
    url = storage.join(_manifest_dir(manifest_uri), str(entry["name"]))
    try:
        data = storage.read_bytes(url, storage_options)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"shard {entry['name']} is missing ({url})") from exc
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
) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32) and labels (int64) of a split, read from its verified shards."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    manifest = load_manifest(manifest_uri, storage_options)
    entries = [e for e in manifest["splits"][split] if shard_names is None or e["name"] in shard_names]
    frames = [read_shard(manifest_uri, manifest, e, storage_options) for e in entries]
    frame = pd.concat(frames, ignore_index=True)
    x = frame[manifest["feature_columns"]].to_numpy(dtype=np.float32)
    y = frame[manifest["label_column"]].to_numpy(dtype=np.int64)
    return x, y


def verify_manifest(manifest_uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check every shard of a manifest before any training starts; raise naming the first bad shard."""
    manifest = load_manifest(manifest_uri, storage_options)
    for split in SPLITS:
        for entry in manifest["splits"][split]:
            read_shard(manifest_uri, manifest, entry, storage_options)
    return manifest
