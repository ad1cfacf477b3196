"""Storage at the edge: fsspec URLs (local paths, s3://...) with atomic writes and checksums."""

from __future__ import annotations

import hashlib
import json
import posixpath
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """Return the filesystem for ``url`` and the path inside it."""
    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, path


def join(base: str, *parts: str) -> str:
    """Join URL parts with '/', keeping the scheme of ``base``."""
    return posixpath.join(base.rstrip("/"), *parts)


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of a byte string."""
    return hashlib.sha256(data).hexdigest()


def sha256_url(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Stream a file and return its hex sha256."""
    fs, path = filesystem(url, storage_options)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes_atomic(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``data`` so that readers see either the old file or the whole new one.

    Local files are written to a temporary name and renamed; object stores publish an object
    only when its upload completes, so a plain put is already atomic there.
    """
    fs, path = filesystem(url, storage_options)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if "file" in _protocols(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with fs.open(tmp, "wb") as handle:
                handle.write(data)
            fs.mv(tmp, path)
        finally:
            if fs.exists(tmp):
                fs.rm(tmp)
    else:
        with fs.open(path, "wb") as handle:
            handle.write(data)


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Read a whole (small) file."""
    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as handle:
        data: bytes = handle.read()
    return data


def exists(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` exists."""
    fs, path = filesystem(url, storage_options)
    return bool(fs.exists(path))


def write_json_atomic(url: str, obj: Any, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    write_bytes_atomic(url, json.dumps(obj, indent=2, sort_keys=True).encode(), storage_options)


def read_json(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Read a JSON file."""
    return json.loads(read_bytes(url, storage_options))


def canonical_hash(obj: Any) -> str:
    """sha256 of the canonical JSON form of ``obj`` (sorted keys, no whitespace)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
