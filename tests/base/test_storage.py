"""Local paths skip fsspec's layers: atomic writes, appends and moves go straight to the OS, with
the same results fsspec gives (and object stores keep fsspec's way)."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from mopflow.base import storage


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_local_write_is_whole_and_leaves_no_temporary_file(tmp_path: Path, scheme: str) -> None:
    target = tmp_path / "deep" / "er" / "state.bin"
    storage.write_bytes_atomic(f"{scheme}{target}", b"first")
    storage.write_bytes_atomic(f"{scheme}{target}", memoryview(b"second"))
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["state.bin"]


def test_a_failed_local_write_keeps_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        storage.write_bytes_atomic(str(target), "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_appends_go_to_local_files_and_object_stores_say_they_cannot(tmp_path: Path) -> None:
    target = tmp_path / "new" / "history.jsonl"
    assert storage.append_bytes(str(target), b"a\n") and storage.append_bytes(str(target), b"b\n")
    assert target.read_bytes() == b"a\nb\n"
    assert storage.append_bytes("memory://mopflow-test/history.jsonl", b"a\n") is False
    assert not fsspec.filesystem("memory").exists("/mopflow-test/history.jsonl")


def test_a_local_move_replaces_its_target_and_a_missing_source_raises(tmp_path: Path) -> None:
    src, dst = tmp_path / "staged.bin", tmp_path / "last.bin"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    storage.move(str(src), str(dst))
    assert dst.read_bytes() == b"new" and not src.exists()
    with pytest.raises(FileNotFoundError):
        storage.move(str(src), str(dst))


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("/a/b", "/a/b"),
        ("rel/b", "rel/b"),
        ("file:///a/b", "/a/b"),
        ("s3://bucket/b", None),
        ("simplecache::/a", None),
    ],
)
def test_only_plain_paths_and_file_urls_are_local(url: str, path: str | None) -> None:
    assert storage.local_path(url) == path
