"""The distillation transfer set, made on the Dask workers shard by shard and written as blocks.

Each training shard becomes, on a worker, its real rows plus ``munge_multiplier`` synthetic
points per row (MUNGE among the shard's rows of the same class for tables, mixup of shifted
examples for images and sequences: :func:`mopflow.compression.distill.distill.transfer_set`), every row with a
hard label (the true one for real rows, the teacher's class for synthetic ones) and the teacher's
probabilities at the distillation temperature (the soft targets). The rows are written in blocks
of at most :data:`BLOCK_ROWS` (``.npz``: ``x``, ``y``, ``soft``) under the run's outputs, keyed
by the shard's checksum, the teacher and the settings, so a rerun reuses them.

The student then reads the blocks on a worker (:mod:`mopflow.compression.distill.student_job`): all at once when
they fit ``MOPFLOW_DISTILL_MEMORY_MB``, else streamed pass by pass
(:class:`mopflow.training.data.streaming.StreamedRows`, a seeded block order through a shuffle buffer), so no
process holds the transfer set beyond that budget.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mopflow.base import storage
from mopflow.base.hosts import storage_options_here
from mopflow.base.storage import canonical_hash
from mopflow.training.data.examples import batch_decoder, decoded_row_bytes, stored_row_bytes
from mopflow.training.data.streaming import Block

log = logging.getLogger(__name__)

BLOCK_ROWS = 32_768  # rows per transfer block: what a streamed pass reads at a time
DISTILL_MEMORY_ENV = "MOPFLOW_DISTILL_MEMORY_MB"
DEFAULT_DISTILL_MEMORY_MB = 256.0


def distill_memory_bytes() -> float:
    """The training rows a process training a student may hold (bytes); more streams."""
    from mopflow.training.data.streaming import memory_budget_bytes

    return memory_budget_bytes(DISTILL_MEMORY_ENV, DEFAULT_DISTILL_MEMORY_MB)


@dataclass(frozen=True)
class TransferSet:
    """Where a transfer set's blocks are and how big it is."""

    blocks: list[Block]  # ``shard`` is the block file's URI
    real_rows: int
    synthetic_rows: int
    row_bytes: int  # features, label and soft targets of one row

    @property
    def rows(self) -> int:
        return self.real_rows + self.synthetic_rows


def _teacher(bundle_uri: str, stacked: bool, storage_options: Mapping[str, Any] | None) -> Any:
    from mopflow.training.models.bundle import StackedEnsemble, load_bundle

    module = load_bundle(bundle_uri, storage_options).module.eval()
    return StackedEnsemble(module).eval() if stacked else module


def transfer_shard(
    manifest_uri: str,
    shard: str,
    seed: int,
    teacher_uri: str,
    stacked: bool,
    distill: Mapping[str, Any],
    out_prefix: str,
    storage_options: Mapping[str, Any] | None = None,
) -> list[tuple[str, int, int]]:
    """On a worker: one training shard's transfer rows, written as blocks ``{out_prefix}-NNN.npz``
    (reused when an earlier attempt wrote them all). Returns ``(uri, rows, real rows)`` per block."""
    import torch

    from mopflow.compression.config import DistillConfig
    from mopflow.compression.distill.distill import soft_targets, transfer_set
    from mopflow.training.data import load_manifest, load_split
    from mopflow.training.models.families import DataSpec

    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    index_uri = f"{out_prefix}.json"
    if storage.exists(index_uri, storage_options):
        return [tuple(b) for b in storage.read_json(index_uri, storage_options)]  # type: ignore[misc]
    torch.set_num_threads(1)
    cfg = DistillConfig.model_validate(dict(distill))
    data = DataSpec.from_manifest(load_manifest(manifest_uri, storage_options))
    x, y = load_split(manifest_uri, "train", storage_options, shard_names=[shard])
    teacher = _teacher(teacher_uri, stacked, storage_options)
    x_all, y_all = transfer_set(x, y, teacher, cfg, seed, data)
    soft = soft_targets(teacher, x_all, cfg.temperature).numpy().astype(np.float32)
    blocks = []
    for number, start in enumerate(range(0, len(x_all), BLOCK_ROWS)):
        end = min(start + BLOCK_ROWS, len(x_all))
        buffer = io.BytesIO()
        np.savez(buffer, x=x_all[start:end], y=y_all[start:end], soft=soft[start:end])
        uri = f"{out_prefix}-{number:03d}.npz"
        storage.write_bytes_atomic(uri, buffer.getvalue(), storage_options)
        blocks.append((uri, end - start, max(0, min(end, len(x)) - start)))
    storage.write_json_atomic(index_uri, blocks, storage_options)
    return blocks


def build_transfer_set(
    client: Any,
    manifest_uri: str,
    teacher_uri: str,
    stacked: bool,
    distill: Any,
    seed: int,
    out_dir: str,
    storage_options: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> TransferSet:
    """The transfer set of every training shard, made on the workers (one task per shard);
    ``manifest`` is the one at ``manifest_uri`` when the caller has read it already."""
    from mopflow.training.data import load_manifest
    from mopflow.training.models.families import DataSpec

    if manifest is None:
        manifest = load_manifest(manifest_uri, storage_options)
    entries = manifest["splits"]["train"]
    settings = distill.model_dump(mode="json")
    key = canonical_hash({"teacher": teacher_uri, "distill": settings, "seed": seed})[:12]
    futures = [
        client.submit(
            transfer_shard,
            manifest_uri,
            str(entry["name"]),
            seed * 100_003 + index,  # each shard's synthetic points from its own stream
            teacher_uri,
            stacked,
            settings,
            storage.join(out_dir, f"{key}-{entry['sha256'][:12]}"),
            dict(storage_options or {}),
            key=f"transfer-{key}-{index}",
        )
        for index, entry in enumerate(entries)
    ]
    written: list[list[tuple[str, int, int]]] = client.gather(futures)
    blocks = [Block(uri, 0, rows) for shard in written for uri, rows, _ in shard]
    real = sum(r for shard in written for _, _, r in shard)
    classes = DataSpec.from_manifest(manifest).num_classes
    row_bytes = decoded_row_bytes(manifest) + 4 * classes
    total = sum(b.rows for b in blocks)
    return TransferSet(blocks, real, total - real, row_bytes)


def read_block(block: Block, storage_options: Mapping[str, Any] | None = None) -> tuple[np.ndarray, ...]:
    """A transfer block's features, labels and soft targets; a block that cannot be read (deleted,
    damaged) raises :class:`~mopflow.training.data.ShardIntegrityError` naming it."""
    from mopflow.training.data import ShardIntegrityError

    try:
        with np.load(io.BytesIO(storage.read_bytes(block.shard, storage_options))) as saved:
            x, y, soft = saved["x"], saved["y"], saved["soft"]
    except Exception as exc:
        raise ShardIntegrityError(
            f"transfer block {block.shard} cannot be read: {type(exc).__name__}: {exc}"
        ) from exc
    if not len(x) == len(y) == len(soft) == block.rows:
        raise ShardIntegrityError(f"transfer block {block.shard} holds {len(x)} rows, expected {block.rows}")
    return x, y, soft


def student_rows(transfer: TransferSet, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The transfer rows for training: ``(x, y, soft)`` tensors when they fit the distill stage's
    budget (``MOPFLOW_DISTILL_MEMORY_MB``), else a :class:`~mopflow.training.data.streaming.StreamedRows` over
    the blocks."""
    import torch

    from mopflow.training.data.streaming import StreamedRows, shuffle_buffer_rows

    held, budget = transfer.rows * transfer.row_bytes, distill_memory_bytes()
    if held > budget:
        log.info(
            "distill: the transfer set (%d rows, %.0f MB) exceeds the %.0f MB budget: streaming it from %d block(s)",
            transfer.rows,
            held / 2**20,
            budget / 2**20,
            len(transfer.blocks),
        )
        options = dict(storage_options or {})
        return StreamedRows(transfer.blocks, lambda b: read_block(b, options), shuffle_buffer_rows())
    parts = [read_block(b, storage_options) for b in transfer.blocks]
    return [torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in range(3)]


def train_split_rows(manifest_uri: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The real training rows (the hard-label baseline's): ``(x, y)`` tensors within the memory
    budget, else streamed from the shards' row groups."""
    import torch

    from mopflow.training.data import load_manifest, load_split
    from mopflow.training.data.streaming import (
        StreamedRows,
        block_reader,
        shard_blocks,
        shuffle_buffer_rows,
    )

    manifest = load_manifest(manifest_uri, storage_options)
    names = [str(e["name"]) for e in manifest["splits"]["train"]]
    rows = sum(int(e["rows"]) for e in manifest["splits"]["train"])
    held = rows * decoded_row_bytes(manifest)
    if held <= distill_memory_bytes():
        x, y = load_split(manifest_uri, "train", storage_options)
        return [torch.from_numpy(x), torch.from_numpy(y)]
    log.info(
        "distill: the training split (%d rows, %.0f MB) exceeds the budget: streaming it", rows, held / 2**20
    )
    options = dict(storage_options or {})
    return StreamedRows(
        shard_blocks(manifest_uri, manifest, names, options),
        block_reader(manifest_uri, manifest, options),
        shuffle_buffer_rows(row_bytes=stored_row_bytes(manifest)),
        batch_decoder(manifest),
    )


def calibration_rows(
    manifest_uri: str,
    rows: int,
    storage_options: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> Any:
    """The first ``rows`` training rows (of the first shard): static quantization's calibration;
    ``manifest`` is the one at ``manifest_uri`` when the caller has read it already."""
    from mopflow.training.data import load_manifest, load_split

    if manifest is None:
        manifest = load_manifest(manifest_uri, storage_options)
    first = manifest["splits"]["train"][0]["name"]
    x, _ = load_split(manifest_uri, "train", storage_options, shard_names=[first], manifest=manifest)
    return x[:rows]
