"""Training rows streamed from the parquet shards, for partitions larger than the memory budget.

A partition whose rows do not fit ``MOPFLOW_TRAIN_MEMORY_MB`` is not loaded: each pass reads it
block by block (a block is one parquet row group of one shard) in a seeded order, through a
bounded shuffle buffer, and cuts the rows into batches. Memory stays at about the buffer plus one
block, whatever the partition's size. The order is a function of (seed, epoch, pass) alone, so a
pass stopped at batch k and resumed reads the same stream again and goes on at batch k with
exactly the batches it had left. A shard that cannot be read mid-stream (deleted, corrupted)
raises :class:`~mopflow.training.data.ShardIntegrityError` naming it.

Partitions within the budget are held in memory and shuffled by a whole permutation, as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TRAIN_MEMORY_ENV = "MOPFLOW_TRAIN_MEMORY_MB"
DEFAULT_TRAIN_MEMORY_MB = 2048.0
SHUFFLE_ROWS_ENV = "MOPFLOW_SHUFFLE_BUFFER_ROWS"
DEFAULT_SHUFFLE_ROWS = 65_536
SHUFFLE_BUFFER_BYTES = 128 * 2**20  # the default buffer's bound for wide rows (stored bytes)


def memory_budget_bytes(name: str, default_mb: float, environ: Mapping[str, str] = os.environ) -> float:
    """A memory budget setting (megabytes in the environment variable ``name``), in bytes."""
    raw = environ.get(name, "").strip()
    try:
        megabytes = float(raw) if raw else default_mb
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} must be a number of megabytes") from exc
    if megabytes <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return megabytes * 1024 * 1024


def train_memory_bytes(environ: Mapping[str, str] = os.environ) -> float:
    """The training-data memory budget of one worker process (bytes); a partition above it streams."""
    return memory_budget_bytes(TRAIN_MEMORY_ENV, DEFAULT_TRAIN_MEMORY_MB, environ)


def shuffle_buffer_rows(environ: Mapping[str, str] = os.environ, row_bytes: float = 0.0) -> int:
    """Rows the shuffle buffer of a streamed pass holds: the setting, else the default, fewer for
    rows over ``SHUFFLE_BUFFER_BYTES / DEFAULT_SHUFFLE_ROWS`` bytes (images), so the buffer's
    memory does not grow with the rows' size."""
    raw = environ.get(SHUFFLE_ROWS_ENV, "").strip()
    by_bytes = max(1024, int(SHUFFLE_BUFFER_BYTES // max(1.0, row_bytes)))
    rows = int(raw) if raw.isdigit() else min(DEFAULT_SHUFFLE_ROWS, by_bytes)
    if rows < 1:
        raise ValueError(f"{SHUFFLE_ROWS_ENV}={raw!r} must be a positive number of rows")
    return rows


@dataclass(frozen=True)
class Block:
    """One parquet row group of one shard: the unit a streamed pass reads."""

    shard: str
    row_group: int
    rows: int


Chunk = tuple[np.ndarray, ...]  # rows' arrays: features and labels (and soft targets, for a student)
Reader = Callable[[Block], Chunk]


def _join(a: Chunk | None, b: Chunk) -> Chunk:
    return b if a is None else tuple(np.concatenate([u, v]) for u, v in zip(a, b, strict=True))


def _take(chunk: Chunk, index: Any) -> Chunk:
    return tuple(a[index] for a in chunk)


def stream_rows(
    blocks: Sequence[Block], read: Reader, seed: int, epoch: int, pass_index: int, buffer_rows: int
) -> Iterator[Chunk]:
    """The rows of one pass, in chunks: the blocks in a seeded order, each mixed into a buffer of
    ``buffer_rows`` rows from which as many rows leave, at random, as the block brought in; the
    rest leaves shuffled at the end. Deterministic for (seed, epoch, pass_index)."""
    rng = np.random.default_rng([seed, epoch, pass_index])
    held: Chunk | None = None
    for index in rng.permutation(len(blocks)):
        held = _join(held, read(blocks[int(index)]))
        leaving = len(held[0]) - buffer_rows
        if leaving > 0:
            mixed = rng.permutation(len(held[0]))
            yield _take(held, mixed[:leaving])
            held = _take(held, mixed[leaving:])
    if held is not None and len(held[0]):
        yield _take(held, rng.permutation(len(held[0])))


def rank_batches(
    chunks: Iterable[Chunk], batch_size: int, rank_rows: int, shard: tuple[int, int] = (0, 1)
) -> Iterator[Chunk]:
    """Rank ``rank`` of ``world`` (``shard``)'s batches of a pass's stream of ``chunks``: every
    ``world``-th row of the stream, cut after ``rank_rows`` rows, in batches of ``batch_size``
    (the last one shorter when the rows do not fill it)."""
    rank, world = shard
    position, taken = 0, 0
    carry: Chunk | None = None
    for chunk in chunks:
        if world > 1:  # this rank's rows: stream positions = rank (mod world)
            mine = (np.arange(position, position + len(chunk[0])) % world) == rank
            position += len(chunk[0])
            chunk = _take(chunk, mine)
        chunk = _take(chunk, slice(0, rank_rows - taken))  # the cut
        taken += len(chunk[0])
        if carry is not None and len(carry[0]):
            chunk = _join(carry, chunk)
        full = len(chunk[0]) // batch_size * batch_size
        for start in range(0, full, batch_size):
            yield _take(chunk, slice(start, start + batch_size))
        carry = _take(chunk, slice(full, None))
        if taken == rank_rows:
            break
    if carry is not None and len(carry[0]):
        yield carry


class StreamedBatches:
    """The batches of one streamed pass, as a loader (``len`` and iteration, tensors on
    ``device``): :func:`rank_batches` of the stream ``chunks`` opens, the first ``skip`` read,
    not yielded (a resumed pass). Made by :meth:`StreamedRows.batches`."""

    def __init__(
        self,
        chunks: Callable[[], Iterable[Chunk]],
        rank_rows: int,
        batch_size: int,
        skip: int,
        shard: tuple[int, int],
        device: str,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.chunks, self.rank_rows, self.batch_size = chunks, rank_rows, batch_size
        self.skip, self.shard, self.device, self.decode = skip, shard, device, decode

    def __len__(self) -> int:
        return max(0, -(-self.rank_rows // self.batch_size) - self.skip)

    def __iter__(self) -> Iterator[list[Any]]:
        import torch

        batches = rank_batches(self.chunks(), self.batch_size, self.rank_rows, self.shard)
        for index, batch in enumerate(batches):
            if index >= self.skip:
                if self.decode is not None:  # encoded examples: decoded a batch at a time
                    batch = (self.decode(batch[0]), *batch[1:])
                yield [torch.from_numpy(a).to(self.device) for a in batch]


class StreamedRows:
    """A training partition read from its shards pass by pass instead of held in memory
    (``decode``: what turns a batch's encoded examples into rows, when the reader keeps them
    encoded)."""

    def __init__(
        self,
        blocks: Sequence[Block],
        read: Reader,
        buffer_rows: int,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.blocks, self.read, self.buffer_rows, self.decode = list(blocks), read, buffer_rows, decode
        self.n_rows = sum(b.rows for b in self.blocks)

    def __len__(self) -> int:
        return self.n_rows

    def batches(
        self,
        seed: int,
        epoch: int,
        pass_index: int,
        batch_size: int,
        skip: int = 0,
        shard: tuple[int, int] = (0, 1),
        device: str = "cpu",
    ) -> StreamedBatches:
        """The batches of one pass (``len`` and iteration, as a loader): the rows in the order of
        :func:`stream_rows`; rank ``rank`` of ``world`` (``shard``) takes every ``world``-th row
        of the stream (the stream cut to a multiple of ``world``, so every rank takes as many
        steps); the first ``skip`` batches are read, not yielded (a resumed pass)."""
        world = shard[1]
        rank_rows = self.n_rows // world if world > 1 else self.n_rows

        def chunks() -> Iterator[Chunk]:
            return stream_rows(self.blocks, self.read, seed, epoch, pass_index, self.buffer_rows)

        return StreamedBatches(chunks, rank_rows, batch_size, skip, shard, device, self.decode)


def shard_blocks(
    manifest_uri: str,
    manifest: Mapping[str, Any],
    shard_names: Sequence[str],
    storage_options: Mapping[str, Any],
) -> list[Block]:
    """The row groups of these training shards (read from the parquet footers only)."""
    import pyarrow.parquet as pq

    from mopflow.base import storage
    from mopflow.training.data import ShardIntegrityError

    blocks = []
    base = manifest_uri.rsplit("/", 1)[0]
    for name in sorted(shard_names):
        url = storage.join(base, name)
        try:
            fs, path = storage.filesystem(url, storage_options)
            with fs.open(path, "rb") as handle:
                meta = pq.ParquetFile(handle).metadata
        except Exception as exc:
            raise ShardIntegrityError(
                f"shard {name} cannot be read ({url}): {type(exc).__name__}: {exc}"
            ) from exc
        blocks += [Block(name, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]
    return blocks


def cache_shards(
    manifest_uri: str,
    manifest: Mapping[str, Any],
    shard_names: Sequence[str],
    storage_options: Mapping[str, Any],
    cache_dir: str,
) -> dict[str, str]:
    """Copy remote shards to ``cache_dir`` on this worker's disk (streamed, verified against the
    manifest's sha256, named by it: a copy is reused by every pass and every later task); the
    local paths by shard name. Local shards are read where they are."""
    from pathlib import Path

    from mopflow.base import storage
    from mopflow.training.data import ShardIntegrityError

    base = manifest_uri.rsplit("/", 1)[0]
    if "://" not in base or base.startswith("file://") or not cache_dir:
        return {}
    sha = {e["name"]: e["sha256"] for e in manifest["splits"]["train"]}
    local: dict[str, str] = {}
    for name in shard_names:
        target = Path(cache_dir) / f"{sha[name]}.parquet"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.part")
            fs, path = storage.filesystem(storage.join(base, name), storage_options)
            fs.get(path, str(partial))
            if storage.sha256_url(str(partial)) != sha[name]:
                partial.unlink(missing_ok=True)
                raise ShardIntegrityError(
                    f"shard {name} is corrupt: its sha256 does not match the manifest's"
                )
            partial.replace(target)
        local[name] = str(target)
    return local


def block_reader(
    manifest_uri: str,
    manifest: Mapping[str, Any],
    storage_options: Mapping[str, Any],
    local: Mapping[str, str] | None = None,
) -> Reader:
    """A function reading one block's features (float32; encoded images stay encoded, see
    :func:`~mopflow.training.data.examples.batch_decoder`) and labels (int64), from the shard's
    local copy when ``local`` has one; a shard that fails mid-stream raises
    :class:`~mopflow.training.data.ShardIntegrityError` naming it."""
    import pyarrow.parquet as pq

    from mopflow.base import storage
    from mopflow.training.data import ShardIntegrityError
    from mopflow.training.data.examples import read_examples

    base = manifest_uri.rsplit("/", 1)[0]
    features, label = list(manifest["feature_columns"]), str(manifest["label_column"])
    options = dict(storage_options)
    copies = dict(local or {})

    def read(block: Block) -> tuple[np.ndarray, np.ndarray]:
        url = copies.get(block.shard) or storage.join(base, block.shard)
        try:
            fs, path = storage.filesystem(url, options if url not in copies.values() else None)
            with fs.open(path, "rb") as handle:
                table = pq.ParquetFile(handle).read_row_group(block.row_group, columns=[*features, label])
        except Exception as exc:
            raise ShardIntegrityError(
                f"shard {block.shard} failed mid-stream (row group {block.row_group}, {url}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if table.num_rows != block.rows:
            raise ShardIntegrityError(
                f"shard {block.shard} changed mid-stream: row group {block.row_group} has "
                f"{table.num_rows} rows, its footer said {block.rows}"
            )
        x = read_examples(table, manifest, decode=False)
        return x, np.require(table.column(label).to_numpy().astype(np.int64), requirements=["W"])

    return read
