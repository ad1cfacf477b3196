"""One rank of a DDP trial, run as a task in a Dask worker process.

A trial's W ranks are W tasks on W distinct workers (those with the resources the trial needs);
they form their own process group with a rendezvous at rank 0's worker (``main_address`` and a
port that worker picked). Lightning trains through :class:`DaskRankEnvironment`, which tells it
the processes exist already (nothing is launched). Rank 0 alone reports each epoch (a Dask
``Queue`` the coordinator reads), writes the epoch checkpoint and reads the coordinator's stop
decision (a Dask ``Event``), which it broadcasts, so every rank stops at the same epoch boundary.
A collective that waits longer than ``collective_timeout_s`` (a rank died) fails the rank.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from datetime import timedelta
from typing import Any

from lightning_fabric.plugins.environments import ClusterEnvironment

log = logging.getLogger(__name__)


class DaskRankEnvironment(ClusterEnvironment):
    """Lightning's view of one rank in a Dask worker: one process per node, created by Dask."""

    def __init__(self, address: str, port: int, rank: int, world_size: int) -> None:
        self._address, self._port, self._rank, self._world = address, port, rank, world_size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._address

    @property
    def main_port(self) -> int:
        return self._port

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the coordinator

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0  # the worker's only device (its CUDA_VISIBLE_DEVICES), or the CPU

    def node_rank(self) -> int:
        return self._rank


def free_port() -> tuple[str, int]:
    """A free TCP port on this worker's host, and the host's address as the cluster knows it."""
    from distributed import get_worker

    host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])


def run_rank(job: dict[str, Any], rank: int, address: str, port: int) -> dict[str, Any]:
    """Train ``job``'s model as rank ``rank`` of ``job["world_size"]``; rank 0 returns the final
    state and its reports, the others an empty result."""
    import os

    import pytorch_lightning as pl
    import torch
    from distributed import Event, Queue
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from infra import storage
    from training.data import load_manifest, load_split
    from training.lit import Classifier, quiet_trainer_kwargs
    from training.schedule import steps_per_epoch
    from training.trial import quiet_lightning
    from training.unit import DataRef, ModelSpec, TrainableUnit

    torch.set_num_threads(1)
    quiet_lightning()
    world = int(job["world_size"])
    spec = ModelSpec.from_dict(job["spec"])
    data = DataRef(**job["data"])
    manifest = load_manifest(data.manifest_uri, data.storage_options)
    pl.seed_everything(spec.seed, workers=False, verbose=False)
    x, y = load_split(data.manifest_uri, "train", data.storage_options)
    xv, yv = load_split(data.manifest_uri, "validation", data.storage_options)
    batch = int(job["batch_per_rank"])
    # One-cycle over the whole training in global steps (training/schedule.py); a rank's epoch is
    # its share of the rows (DistributedSampler pads to equal shares) in per-rank batches. A
    # resumed job continues the schedule and the optimizer moments where the checkpoint left them.
    epoch_steps = steps_per_epoch([math.ceil(len(x) / world)], batch)
    unit = TrainableUnit.build(spec, manifest, int(job["epochs"]) * epoch_steps)
    model = unit.model
    start_epoch = int(job.get("start_epoch", 0))
    if job.get("resume_uri"):  # safetensors: nothing unpickled
        unit.import_state(storage.read_bytes(job["resume_uri"], data.storage_options))

    class RankModule(Classifier):
        def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
            unit.restore_moments(optimizer)

    module = RankModule(
        model,
        lr=float(spec.params["lr"]),
        weight_decay=float(spec.params["weight_decay"]),
        total_steps=unit.total_steps,
        start_step=start_epoch * epoch_steps,
    )
    train = DataLoader(
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch, shuffle=True
    )
    val = DataLoader(TensorDataset(torch.from_numpy(xv), torch.from_numpy(yv)), batch_size=4096)
    reports: list[dict[str, Any]] = []
    last_state: dict[str, bytes] = {}

    class Report(pl.Callback):
        def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            stop = False
            if trainer.is_global_zero:
                epoch = start_epoch + trainer.current_epoch
                optimizer = trainer.optimizers[0]
                record = {
                    "model_id": spec.model_id,
                    "epoch": epoch,
                    "val_acc": float(trainer.callback_metrics["val_acc"]),
                    "train_loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
                    "lr": float(optimizer.param_groups[0]["lr"]),
                    "world_size": world,
                    "pid": os.getpid(),
                }
                unit.capture(optimizer, (epoch + 1) * epoch_steps)
                state = unit.export_state({"epoch": epoch})
                last_state["state"] = state
                if job.get("checkpoint_uri"):  # before the report: a report means a checkpoint
                    storage.write_bytes_atomic(job["checkpoint_uri"], state, data.storage_options)
                reports.append(record)
                Queue(job["queue"]).put(json.dumps(record))
                stop = Event(job["stop_event"]).is_set()
            if trainer.strategy.broadcast(stop, src=0):
                trainer.should_stop = True

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    reduced = {"bytes": 0}
    compress = bool(job.get("bf16_compress"))
    inner = default_hooks.bf16_compress_hook if compress else default_hooks.allreduce_hook

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks the hook's annotations
        """DDP's gradient all-reduce (bf16-compressed or not), counting the bytes it sends."""
        reduced["bytes"] += bucket.buffer().numel() * (2 if compress else bucket.buffer().element_size())
        return inner(state, bucket)

    class CommHook(pl.Callback):
        """Register the hook on the wrapped model before the first backward, on any device
        (Lightning's ``ddp_comm_hook`` argument registers it on CUDA only)."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            trainer.strategy.model.register_comm_hook(None, hook)  # type: ignore[union-attr,operator]

    strategy = DDPStrategy(
        cluster_environment=DaskRankEnvironment(address, port, rank, world),
        process_group_backend=spec.device.ddp_backend(),  # nccl between GPUs, gloo on CPU
        timeout=timedelta(seconds=float(job.get("collective_timeout_s", 120))),
    )
    trainer = pl.Trainer(
        max_epochs=int(job["epochs"]) - start_epoch,
        strategy=strategy,
        num_nodes=world,
        callbacks=[CommHook(), Report()],
        **quiet_trainer_kwargs(spec.device),
    )
    try:
        trainer.fit(module, train, val)
    finally:
        if torch.distributed.is_initialized():  # the worker trains other ranks and trials later
            torch.distributed.destroy_process_group()
    return {
        "rank": rank,
        "pid": os.getpid(),
        "state": last_state.get("state"),
        "reports": reports,
        "allreduce_bytes": reduced["bytes"],
    }
