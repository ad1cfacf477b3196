"""Storage at the edge: fsspec URLs (local paths, s3://...) with atomic writes and checksums."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec import AbstractFileSystem


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """Return the filesystem for ``url`` and the path inside it."""
    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, path


def local_path(url: str) -> str | None:
    """The path of ``url`` on this machine's own filesystem: a plain path or a ``file://`` URL
    (None for any other scheme or a chained URL). Writes to such a path go straight to the OS:
    fsspec's layers cost more than the write itself for the small files of every epoch."""
    if "::" in url:
        return None
    if url.startswith("file://"):
        return url[len("file://") :]
    return url if "://" not in url else None


def join(base: str, *parts: str) -> str:
    """Join URL parts with '/', keeping the scheme of ``base``."""
    return posixpath.join(base.rstrip("/"), *parts)


def sha256_bytes(data: bytes | memoryview) -> str:
    """Hex sha256 of a byte string (or a view of bytes)."""
    return hashlib.sha256(data).hexdigest()


def sha256_url(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Stream a file and return its hex sha256."""
    fs, path = filesystem(url, storage_options)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes_atomic(
    url: str, data: bytes | memoryview, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Write ``data`` so that readers see either the old file or the whole new one.

    Local files are written to a temporary name and renamed; object stores publish an object
    only when its upload completes, so a plain put is already atomic there.
    """
    local = local_path(url)
    if local is not None:
        _write_local_atomic(local, data)
        return
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


def _write_local_atomic(path: str, data: bytes | memoryview) -> None:
    """A local file written to a temporary name beside it, then renamed over it."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def append_bytes(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Append ``data`` to a local file (created when missing); False, writing nothing, where the
    storage cannot append (object stores: the caller writes the whole file again). A reader may
    see a half-written last line while an append is under way, or after a crash in one."""
    local = local_path(url)
    if local is None:
        return False
    parent = os.path.dirname(local)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(local, "ab") as handle:
        handle.write(data)
    return True


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Read a whole (small) file."""
    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as handle:
        data: bytes = handle.read()
    return data


def move(src: str, dst: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Move ``src`` over ``dst`` on one filesystem: a rename locally (readers of ``dst`` see the
    old file or the whole new one); a server-side copy, then a delete, on object stores."""
    local_src, local_dst = local_path(src), local_path(dst)
    if local_src is not None and local_dst is not None:
        try:
            os.replace(local_src, local_dst)
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:  # another device: copied, then removed
                raise
        shutil.move(local_src, local_dst)
        return
    fs, src_path = filesystem(src, storage_options)
    _, dst_path = filesystem(dst, storage_options)
    fs.mv(src_path, dst_path)


def remove(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete one file; one already gone is not an error."""
    local = local_path(url)
    with contextlib.suppress(FileNotFoundError):
        if local is not None:
            os.remove(local)
            return
        fs, path = filesystem(url, storage_options)
        fs.rm(path)


def remove_matching(pattern: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Delete the files a glob ``pattern`` matches; how many there were."""
    fs, path = filesystem(pattern, storage_options)
    found = fs.glob(path)
    if found:
        fs.rm(found)
    return len(found)


def exists(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` exists."""
    fs, path = filesystem(url, storage_options)
    return bool(fs.exists(path))


class StorageLocationError(OSError):
    """An output location cannot be used (missing bucket, a file in the way); names the location."""


OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "abfs", "az")


def check_output_location(url: str, storage_options: Mapping[str, Any] | None = None, what: str = "") -> None:
    """Fail early, with the location named, when ``url`` cannot be written: an object store's
    bucket must already exist (mopflow never creates buckets), a local path must not run into a
    file. Called before a stage writes anything, so a failure leaves nothing half-written."""
    label = f"{what} {url!r}" if what else repr(url)
    fs, path = filesystem(url, storage_options)
    if set(_protocols(fs)) & set(OBJECT_STORES):
        bucket = path.split("/", 1)[0]
        try:
            found = fs.exists(bucket)
        except Exception as exc:  # credentials, endpoint, permissions
            raise StorageLocationError(f"cannot reach bucket {bucket!r} of {label}: {exc}") from exc
        if not found:
            raise StorageLocationError(
                f"bucket {bucket!r} of {label} does not exist or is not accessible with the configured "
                "credentials; create it (mopflow does not create buckets) or choose another location"
            )
        return
    parent = path
    while parent and not fs.exists(parent):
        parent = posixpath.dirname(parent.rstrip("/"))
    if parent and not fs.isdir(parent):
        raise StorageLocationError(f"{label} cannot be created: {parent!r} is a file, not a folder")


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


def within_roots(location: str, roots: Sequence[str]) -> bool:
    """Whether ``location`` (a local path, ``file://`` or another fsspec URL) lies under one of
    ``roots``: local paths compared once resolved (``..`` and symbolic links followed), URLs by
    whole path segments of the same scheme and bucket; a URL with ``..`` is under none."""
    target = _rooted(location)
    if target is None:
        return False
    for root in roots:
        base = _rooted(root)
        if base is None or base[0] != target[0]:
            continue
        if target[0] == "":  # local paths
            if os.path.commonpath([base[1], target[1]]) == base[1]:
                return True
        elif target[1] == base[1] or target[1].startswith(base[1].rstrip("/") + "/"):
            return True
    return False


def _rooted(location: str) -> tuple[str, str] | None:
    """(scheme, path) of a location: local paths ("" scheme) absolute and resolved; None for a URL
    that climbs with ``..``."""
    parts = urlsplit(location)
    if len(parts.scheme) > 1 and parts.scheme != "file":  # one letter: a Windows drive
        if ".." in parts.path.split("/"):
            return None
        return parts.scheme, f"{parts.netloc}{parts.path}"
    path = parts.path if parts.scheme == "file" else location
    return "", os.path.realpath(os.path.expanduser(path))
