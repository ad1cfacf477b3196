"""Reading a sharded dataset refuses a manifest that is missing or is not one, and a split it
does not have, naming the file or the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mopflow.training.data import (
    MANIFEST_VERSION,
    ShardIntegrityError,
    load_manifest,
    load_split,
    manifest_hash,
    split_shards,
)


def _hashed(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its own (matching) hash: only what it holds is wrong."""
    return manifest | {"manifest_hash": manifest_hash(manifest)}


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            json.dumps(_hashed({"version": MANIFEST_VERSION + 1, "splits": {}})),
            f"has version {MANIFEST_VERSION + 1} and a 'splits' entry",
        ),
        (
            json.dumps(_hashed({"version": MANIFEST_VERSION})),
            f"has version {MANIFEST_VERSION} and no 'splits'",
        ),
        (json.dumps({"study": "s1", "trials": 4}), "has version None and no 'splits'"),
        (json.dumps([1, 2]), "it holds a JSON list, not an object"),
        ("shard_count: 4", "it is not JSON"),
        (b"PAR1\x15\x04\xff\xfe", "it is not JSON"),  # a parquet file's bytes
    ],
)
def test_a_file_that_is_not_a_manifest_is_refused_naming_it(
    tmp_path: Path, content: str | bytes, needle: str
) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ShardIntegrityError) as info:
        load_manifest(str(path))
    message = str(info.value)
    assert f"{path} is not a mopflow manifest" in message and needle in message


def test_a_missing_manifest_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "datasets" / "manifest.json"
    with pytest.raises(ShardIntegrityError) as info:
        load_manifest(str(missing))
    assert f"manifest {missing} does not exist" in str(info.value)


@pytest.mark.parametrize("read", [load_split, lambda uri, split: next(split_shards(uri, split))])
def test_an_unknown_split_is_refused_naming_it(tmp_path: Path, read: Any) -> None:
    with pytest.raises(
        ValueError, match=r"unknown split 'valid'; expected one of \['train', 'validation', 'test'\]"
    ):
        read(str(tmp_path / "manifest.json"), "valid")
