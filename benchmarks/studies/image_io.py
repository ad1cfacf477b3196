"""Images at real size: shard bytes against the PNG folder's, the shard stage's wall time,
streamed training images/s per worker against a plain ``torch.utils.data.DataLoader`` over the
same PNG files (the same decode and augmentation), and the peak RSS of a worker streaming a pass
at two dataset sizes.

Every figure is measured here; on a shared machine the times are marked as such by the caller.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 64
CLASSES = 10
BATCH = 128
AUGMENT = "flip,shift:4"


def write_png_folder(root: Path, count: int, seed: int = 0) -> int:
    """``count`` RGB ``SIZE`` x ``SIZE`` PNGs under ``root/<class>/`` (a smooth background, a
    class-coloured square at a random place, mild noise); the folder's bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, SIZE, dtype=np.float32)
    total = 0
    for i in range(count):
        label = i % CLASSES
        folder = root / f"c{label}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.uniform(0, 90, 3).astype(np.float32)
        image = np.broadcast_to(
            base + 60 * ramp[None, :, None] * rng.uniform(0, 1, 3), (SIZE, SIZE, 3)
        ).copy()
        top, left, side = *rng.integers(0, SIZE - 20, 2), int(rng.integers(10, 20))
        image[top : top + side, left : left + side] = 120 + 12 * label
        image += rng.normal(0, 4, image.shape)
        path = folder / f"{i:07d}.png"
        Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB").save(path)
        total += path.stat().st_size
    return total


def shard(folder: Path, data_root: Path, workers: int) -> tuple[str, float]:
    """Shard the folder on a LocalCluster of ``workers`` single-threaded processes: the manifest
    URI and the wall seconds."""
    from distributed import Client, LocalCluster

    from mopflow.training.data import shard_dataset
    from mopflow.training.data.config import DataConfig

    cfg = DataConfig(dataset=str(folder), n_shards=max(2, workers), partition_rows=2000)
    with (
        LocalCluster(n_workers=workers, threads_per_worker=1, processes=True) as cluster,
        Client(cluster) as client,
    ):
        started = time.monotonic()
        result = shard_dataset(cfg, str(data_root), client)
        return result.manifest_uri, time.monotonic() - started


def streamed_images_per_s(manifest_uri: str, limit: int) -> dict[str, float]:
    """Images/s of one process streaming a training pass (the encoded images through the shuffle
    buffer, decoded and augmented batch by batch) for at most ``limit`` images."""
    from mopflow.training.data import load_manifest
    from mopflow.training.data.examples import batch_decoder, stored_row_bytes
    from mopflow.training.data.streaming import StreamedRows, block_reader, shard_blocks, shuffle_buffer_rows
    from mopflow.training.trainable.augment import AugmentedBatches, augmenter

    manifest = load_manifest(manifest_uri)
    names = [e["name"] for e in manifest["splits"]["train"]]
    rows = StreamedRows(
        shard_blocks(manifest_uri, manifest, names, {}),
        block_reader(manifest_uri, manifest, {}),
        shuffle_buffer_rows(row_bytes=stored_row_bytes(manifest)),
        batch_decoder(manifest),
    )
    augment = augmenter(AUGMENT, "image", manifest["input_shape"])
    return _time(AugmentedBatches(rows.batches(0, 0, 0, BATCH), augment, 0, 0, 0, 0), limit)


def dataloader_images_per_s(folder: Path, limit: int) -> dict[str, float]:
    """Images/s of a plain DataLoader (in this process) over the PNG files: the same Pillow decode
    and the same augmentation of each batch."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from mopflow.training.data.examples import decode_image, image_values
    from mopflow.training.trainable.augment import AugmentedBatches, augmenter

    files = sorted(folder.rglob("*.png"))

    class Pngs(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            values = image_values(decode_image(files[i].read_bytes(), str(files[i])), (3, SIZE, SIZE))
            return torch.from_numpy(values.reshape(-1)), int(files[i].parent.name[1:])

    loader = DataLoader(Pngs(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    augment = augmenter(AUGMENT, "image", (3, SIZE, SIZE))
    return _time(AugmentedBatches(loader, augment, 0, 0, 0, 0), limit)


def _time(batches: Any, limit: int) -> dict[str, float]:
    """Images/s after the first batch (which pays for imports and, streamed, the buffer's fill)."""
    iterator = iter(batches)
    next(iterator)
    started, seen = time.monotonic(), 0
    for batch in iterator:
        seen += len(batch[0])
        if seen >= limit:
            break
    wall = time.monotonic() - started
    return {"images": seen, "seconds": wall, "images_per_s": seen / wall if wall else 0.0}


def peak_rss_mb(manifest_uri: str, limit: int) -> float:
    """Peak RSS (MB) of a fresh worker process streaming ``limit`` training images."""
    code = (
        "import json, resource;"
        "from studies.image_io import streamed_images_per_s;"
        f"streamed_images_per_s({manifest_uri!r}, {limit});"
        "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))"
    )
    # run in benchmarks/, whose studies package `python -c` finds there
    benchmarks = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=benchmarks
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(root: Path, small: int, large: int, workers: int, limit: int) -> dict[str, Any]:
    """Every figure for ``small`` images, and the peak RSS again for ``large`` images."""
    report: dict[str, Any] = {"sizes": {"small": small, "large": large}, "image": [3, SIZE, SIZE]}
    runs: dict[int, str] = {}
    for count in (small, large):
        folder = root / f"png-{count}"
        folder_bytes = write_png_folder(folder, count)
        manifest_uri, wall = shard(folder, root / f"data-{count}", workers)
        from mopflow.training.data import load_manifest

        manifest = load_manifest(manifest_uri)
        shard_bytes = sum(e["bytes"] for split in manifest["splits"].values() for e in split)
        report[str(count)] = {
            "folder_bytes": folder_bytes,
            "shard_bytes": shard_bytes,
            "shard_over_folder": shard_bytes / folder_bytes,
            "shard_wall_s": wall,
            "columns": len(manifest["schema"]),
            "peak_rss_mb": peak_rss_mb(manifest_uri, min(limit, count)),
        }
        runs[count] = manifest_uri
    report["streamed"] = streamed_images_per_s(runs[small], limit)
    report["dataloader"] = dataloader_images_per_s(root / f"png-{small}", limit)
    report["throughput_ratio"] = report["streamed"]["images_per_s"] / report["dataloader"]["images_per_s"]
    report["rss_ratio"] = report[str(large)]["peak_rss_mb"] / report[str(small)]["peak_rss_mb"]
    return report
