"""One DDP training job, run by ``torchrun`` (one process per rank): ``python -m torch.distributed.run
--standalone --nproc-per-node=W -m training.executors.ddp_main --job job.json``.

Lightning detects torchelastic and does not relaunch anything. Rank 0 alone writes the
per-epoch report and the checkpoint; the stop decision (a STOP file the caller writes) is read
by rank 0 and broadcast, so every rank stops at the same epoch boundary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text())

    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from training.data import load_manifest, load_split
    from training.executors.units import DataRef, ModelSpec, _build, pack_state, unpack_state
    from training.lit import Classifier, quiet_trainer_kwargs
    from training.schedule import steps_per_epoch
    from training.trial import quiet_lightning

    torch.set_num_threads(1)
    quiet_lightning()
    spec = ModelSpec.from_dict(job["spec"])
    data = DataRef(**job["data"])
    out = Path(job["out_dir"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    manifest = load_manifest(data.manifest_uri, data.storage_options)
    pl.seed_everything(spec.seed, workers=False, verbose=False)
    _, model = _build(spec, manifest)
    start_epoch = int(job.get("start_epoch", 0))
    resume = Path(job["resume_state"]).read_bytes() if job.get("resume_state") else None
    if resume is not None:  # safetensors: nothing unpickled
        unpack_state(resume, model, None)
    x, y = load_split(data.manifest_uri, "train", data.storage_options)
    # One-cycle over the whole training in global steps (training/schedule.py); a rank's epoch is
    # its share of the rows (DistributedSampler pads to equal shares) in per-rank batches. A
    # resumed job continues the schedule and the optimizer moments where the checkpoint left them.
    epoch_steps = steps_per_epoch([math.ceil(len(x) / world)], int(job["batch_per_rank"]))

    class DDPModule(Classifier):
        def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
            if resume is not None:
                unpack_state(resume, self.model, optimizer)

    module = DDPModule(
        model,
        lr=float(spec.params["lr"]),
        weight_decay=float(spec.params["weight_decay"]),
        total_steps=int(job["epochs"]) * epoch_steps,
        start_step=start_epoch * epoch_steps,
    )
    xv, yv = load_split(data.manifest_uri, "validation", data.storage_options)
    # Per-rank batch b: the global batch is world x b (Lightning adds a DistributedSampler).
    train = DataLoader(
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        batch_size=int(job["batch_per_rank"]),
        shuffle=True,
    )
    val = DataLoader(TensorDataset(torch.from_numpy(xv), torch.from_numpy(yv)), batch_size=4096)

    class Report(pl.Callback):
        def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            stop = False
            if trainer.is_global_zero:
                epoch = start_epoch + trainer.current_epoch
                record = {
                    "model_id": spec.model_id,
                    "epoch": epoch,
                    "val_acc": float(trainer.callback_metrics["val_acc"]),
                    "train_loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
                    "world_size": world,
                    "lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
                }
                optimizer = trainer.optimizers[0]  # moments kept: a resumed job continues them
                state = pack_state(model, optimizer, {"epoch": epoch, "model_id": spec.model_id})
                tmp = out / "last.safetensors.tmp"
                tmp.write_bytes(state)
                tmp.replace(out / "last.safetensors")
                with (out / "epochs.jsonl").open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
                stop = (out / "STOP").exists()
            if trainer.strategy.broadcast(stop, src=0):
                trainer.should_stop = True

    hook = None
    if job.get("bf16_compress"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook
    kwargs = quiet_trainer_kwargs(spec.device) | {"devices": world}
    backend = spec.device.ddp_backend()  # nccl between GPUs, gloo on CPU
    trainer = pl.Trainer(
        max_epochs=int(job["epochs"]) - start_epoch,
        strategy=DDPStrategy(process_group_backend=backend, ddp_comm_hook=hook, timeout=_timeout(job)),
        callbacks=[Report()],
        **kwargs,
    )
    trainer.fit(module, train, val)
    return 0


def _timeout(job: dict[str, Any]) -> Any:
    from datetime import timedelta

    # A collective that waits longer than this (a rank died) fails instead of hanging.
    return timedelta(seconds=float(job.get("collective_timeout_s", 120)))


if __name__ == "__main__":
    sys.exit(main())
