"""One rank of a DDP trial, run as a task in a Dask worker process.

A trial's W ranks are W tasks on W distinct workers (a gang: ``training/executors/ddp_workers.py``);
they form their own process group with a rendezvous at rank 0's worker (``main_address`` and a
port that worker picked). Each epoch is one pass of the trainable unit
(``training/trainable/unit.py``) over the rank's share of the rows, under Lightning's DDP
strategy with :class:`DaskRankEnvironment`, which tells it the processes exist already (nothing
is launched; the process group made for the first epoch serves the rest). Rank 0 alone
validates, writes the epoch checkpoint, reports the epoch (a Dask ``Queue`` the coordinator
reads) and waits for the coordinator's decision, which it broadcasts: every rank stops at the
epoch the decision was made on, and none trains past it.

After every batch the ranks agree on whether any of them got a spot notice (one all-reduce of a
flag); if so, all stop at that batch, rank 0 writes the state there, and the job returns to be
continued from it. A collective that waits longer than ``collective_timeout_s`` (a rank died)
fails the rank.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_fabric.plugins.environments import ClusterEnvironment

if TYPE_CHECKING:
    from mopflow.training.data.ref import DataRef
    from mopflow.training.trainable.unit import TrainableUnit

log = logging.getLogger(__name__)

GO, STOP = "go", "stop"  # the coordinator's answer to each epoch report


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

    from mopflow.base import ports

    host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
    return host, ports.free_port(host)


def run_rank(job: dict[str, Any], rank: int, address: str, port: int) -> dict[str, Any]:
    """Train ``job``'s model as rank ``rank`` of ``job["world_size"]``: the trainable unit, one
    pass per epoch over this rank's share of the data under a DDP strategy. Rank 0 returns the
    final state; ``preempted`` (the batch) when every rank stopped on a spot notice."""
    import os

    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import DDPStrategy

    from mopflow.training.compute.interfaces import use_worker_interface
    from mopflow.training.trainable.lit import quiet_lightning
    from mopflow.training.trainable.unit import PassInterrupted

    torch.set_num_threads(1)
    quiet_lightning()
    # before any process group: left alone, gloo and nccl take the address the hostname resolves
    # to, a loopback one on Debian, which peers on other hosts cannot reach
    interfaces = use_worker_interface()
    world, epochs = int(job["world_size"]), int(job["epochs"])
    unit, tensors, data = _rank_unit(job)
    rank0 = _RankZero(job, unit, data) if rank == 0 else None  # validates, checkpoints, reports
    comm = _CommHook(bool(job.get("bf16_compress")))
    timeout = timedelta(seconds=float(job.get("collective_timeout_s", 120)))
    backend = unit.spec.device.ddp_backend()  # nccl between GPUs, gloo on CPU
    result: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "preempted": 0,
        "interface": interfaces.get(f"{backend.upper()}_SOCKET_IFNAME", ""),  # "": the backend's own pick
    }
    epoch = start = int(job.get("start_epoch", 0))
    forget_failed_groups()
    try:
        for epoch in range(start, epochs):
            strategy = DDPStrategy(
                cluster_environment=DaskRankEnvironment(address, port, rank, world),
                process_group_backend=backend,
                timeout=timeout,
            )
            unit.meta["epoch"] = epoch - 1  # a state taken mid-pass continues this epoch
            try:
                record = unit.train_pass(
                    tensors,
                    epoch,
                    stop=_AgreedNotice(unit.spec.device.torch_device()),
                    callbacks=[comm.callback(pl)],
                    shard=(rank, world),
                    trainer_kwargs={
                        "strategy": strategy,
                        "num_nodes": world,
                        "use_distributed_sampler": False,
                    },
                )
            except PassInterrupted as stopped:  # every rank, at the same batch
                if rank0 is not None:
                    rank0.save(stopped.state)
                result |= {"preempted": stopped.batches}
                break
            loss = torch.tensor([record.train_loss], dtype=torch.float64)
            torch.distributed.all_reduce(loss)  # the epoch's loss over every rank's rows
            stop = [rank0.end_epoch(epoch, float(loss.item() / world), record.lr_end) if rank0 else False]
            torch.distributed.broadcast_object_list(stop, src=0)
            if stop[0]:
                break
    finally:
        if torch.distributed.is_initialized():  # the worker trains other ranks and trials later
            torch.distributed.destroy_process_group()
    return result | {
        "epoch": epoch,
        "state": rank0.last_state if rank0 else None,
        "reports": rank0.reports if rank0 else [],
        "allreduce_bytes": comm.bytes,
    }


def forget_failed_groups() -> None:
    """Name this process's next process group as a fresh process would.

    torch names an unnamed process group by a per-process counter, taken before the rendezvous
    and reset only when a group is destroyed. An ``init_process_group`` that failed (a rendezvous
    port taken, a peer lost before it joined) leaves the counter raised, so the next trial's
    ranks in that worker would prefix their keys with another name than their peers' and wait
    for each other until the collective timeout, attempt after attempt."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0


class _AgreedNotice:
    """Asked after every batch by every rank: whether any rank got a spot notice (or the run's
    stop), agreed by an all-reduce so that all stop at the same batch."""

    def __init__(self, device: Any) -> None:
        import torch

        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    def __call__(self) -> bool:
        import torch

        from mopflow.training.volatile.preempt import notice_received

        self.flag.fill_(1 if notice_received() else 0)
        torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX)
        return bool(self.flag.item())


def _rank_unit(job: dict[str, Any]) -> tuple[TrainableUnit, Any, DataRef]:
    """The rank's trainable unit (resumed from the job's checkpoint, if any), its training rows
    (in memory when within the worker's budget, else streamed: every rank reads its share) and
    the data's :class:`DataRef`."""
    from mopflow.base import storage
    from mopflow.training.data import load_manifest
    from mopflow.training.data.ref import DataRef
    from mopflow.training.executors.units import training_rows
    from mopflow.training.trainable.augment import augmenter
    from mopflow.training.trainable.schedule import steps_per_epoch
    from mopflow.training.trainable.unit import ModelSpec, TrainableUnit

    world, epochs = int(job["world_size"]), int(job["epochs"])
    spec = ModelSpec.from_dict(job["spec"])
    # a rank's batches are its share of the trial's batch (the global batch stays batch_size)
    spec = replace(spec, params={**spec.params, "batch_size": int(job["batch_per_rank"])})
    data = DataRef.from_dict(job["data"])
    manifest = load_manifest(data.manifest_uri, data.options_here())
    tensors = training_rows(data, [e["name"] for e in manifest["splits"]["train"]])
    streamed = not isinstance(tensors, tuple)
    n_rows = len(tensors) if streamed else len(tensors[0])
    # One-cycle over the whole training in global steps (training/trainable/schedule.py); a rank's epoch is
    # its share of the rows (padded to equal shares in memory, cut to them when streamed) in
    # per-rank batches. A resumed job continues the schedule and the optimizer moments where the
    # checkpoint left them.
    share = n_rows // world if streamed else math.ceil(n_rows / world)
    epoch_steps = steps_per_epoch([share], int(spec.params["batch_size"]))
    unit = TrainableUnit.build(spec, manifest, epochs * epoch_steps)
    unit.augment = augmenter(data.augment, data.spec.modality, data.spec.input_shape)  # as every unit
    if job.get("resume_uri"):  # safetensors: nothing unpickled
        unit.import_state(storage.read_bytes(job["resume_uri"], data.options_here()))
    return unit, tensors, data


class _RankZero:
    """What rank 0 alone does after each epoch: validate the whole split, write the checkpoint,
    report to the coordinator and wait for its decision."""

    def __init__(self, job: dict[str, Any], unit: TrainableUnit, data: DataRef) -> None:
        self.job, self.unit, self.data = job, unit, data
        self.reports: list[dict[str, Any]] = []
        self.last_state: bytes | None = None

    def save(self, state: bytes) -> None:
        """Write ``state`` as the trial's checkpoint (when it keeps one)."""
        from mopflow.base import storage

        if self.job.get("checkpoint_uri"):
            storage.write_bytes_atomic(self.job["checkpoint_uri"], state, self.data.options_here())

    def end_epoch(self, epoch: int, train_loss: float, lr: float) -> bool:
        """Report ``epoch`` (its loss over every rank); True when the coordinator says stop."""
        import os

        from distributed import Queue

        from mopflow.training.executors.units import load_eval_split

        report = {
            "model_id": self.unit.spec.model_id,
            "epoch": epoch,
            "val_acc": self.unit.evaluate(*load_eval_split(self.data, "validation")),
            "train_loss": train_loss,
            "lr": lr,
            "world_size": int(self.job["world_size"]),
            "pid": os.getpid(),
        }
        state = self.last_state = self.unit.export_state({"epoch": epoch})
        self.save(state)  # before the report: a report means a checkpoint
        self.reports.append(report)
        Queue(self.job["queue"]).put(json.dumps(report))
        # the other ranks wait in the broadcast meanwhile: nobody trains past an undecided epoch
        decisions, deadline = (
            Queue(self.job["decisions"]),
            time.monotonic() + float(self.job.get("collective_timeout_s", 120)),
        )
        while not decisions.qsize():  # qsize, then get: a get timing out as the answer arrives could lose it
            if time.monotonic() > deadline:
                raise TimeoutError(f"no decision on epoch {epoch + 1} from the coordinator")
            time.sleep(0.01)
        return bool(decisions.get(timeout=5) == STOP)


class _CommHook:
    """DDP's gradient all-reduce (bf16-compressed or not), counting the bytes it sends."""

    def __init__(self, compress: bool) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.compress, self.bytes = compress, 0
        self.inner = default_hooks.bf16_compress_hook if compress else default_hooks.allreduce_hook

    def callback(self, pl: Any) -> Any:
        """A Lightning callback registering the hook on the wrapped model before the first
        backward, on any device (Lightning's ``ddp_comm_hook`` argument does so on CUDA only)."""
        counter = self

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks the hook's annotations
            buffer = bucket.buffer()
            counter.bytes += buffer.numel() * (2 if counter.compress else buffer.element_size())
            return counter.inner(state, bucket)

        class Register(pl.Callback):  # type: ignore[misc,name-defined]
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                trainer.strategy.model.register_comm_hook(None, hook)

        return Register()
