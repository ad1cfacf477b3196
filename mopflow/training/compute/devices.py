"""Where training runs: CPU or GPU, the numeric precision, and the GPU workers of a LocalCluster.

The coordinator resolves the ``accelerator`` setting (``auto`` | ``cpu`` | ``gpu``) once, against
the cluster it trains on, into a :class:`DeviceSpec` that travels with every trial, MOP unit and
DDP job. Workers do not guess: a unit runs on the device its spec names, and a GPU unit is
submitted with the Dask resource ``GPU`` so that it only lands on a worker that declares one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mopflow.base.settings import Accelerator, Precision
from mopflow.training.compute.workers import workers_with

GPU_RESOURCE = "GPU"  # the Dask worker resource a GPU worker declares (dask worker --resources GPU=1)


class DeviceError(ValueError):
    """An accelerator or precision this machine or cluster cannot give; the message says why."""


@dataclass(frozen=True)
class DeviceSpec:
    """The device a unit of training runs on: ``cpu`` or ``gpu`` (one CUDA device), and its precision."""

    accelerator: Literal["cpu", "gpu"] = "cpu"
    precision: Precision = "32"

    @property
    def is_gpu(self) -> bool:
        return self.accelerator == "gpu"

    def torch_device(self) -> Any:
        """The torch device: ``cuda`` (the worker's one visible GPU) or ``cpu``."""
        import torch

        return torch.device("cuda" if self.is_gpu else "cpu")

    def seed(self, seed: int) -> None:
        """Seed the random generator(s) a model on this device draws from: on the CPU its
        generator alone (``torch.manual_seed`` also queues a CUDA seeding, with a stack trace,
        at every call: a noticeable share of a small unit's set-up), on a GPU every device's."""
        import torch

        if self.is_gpu:
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)

    def trainer_kwargs(self) -> dict[str, Any]:
        """Lightning Trainer arguments for one device."""
        return {"accelerator": self.accelerator, "devices": 1, "precision": self.precision}

    def resources(self) -> dict[str, float]:
        """Dask resources a unit on this device needs (none on CPU)."""
        return {GPU_RESOURCE: 1} if self.is_gpu else {}

    def ddp_backend(self) -> str:
        """The torch.distributed backend: nccl between GPUs, gloo on CPU."""
        return "nccl" if self.is_gpu else "gloo"


CPU = DeviceSpec()


def resolve_device(
    accelerator: Accelerator, precision: Precision, gpus_available: int, bf16_supported: bool = True
) -> DeviceSpec:
    """The device to train on: ``auto`` takes a GPU when the cluster has GPU workers.

    ``gpus_available`` counts the GPU workers (or visible GPUs) the training can use. ``gpu``
    without any, or ``bf16-mixed`` on a GPU without bfloat16, is refused with the reason.
    """
    if accelerator == "gpu" and gpus_available == 0:
        raise DeviceError(
            "accelerator 'gpu' but no GPU worker: no CUDA device is visible to the LocalCluster "
            "(install the CUDA build of torch) and no Dask worker declares the resource "
            f"{GPU_RESOURCE!r} (dask worker --resources {GPU_RESOURCE}=1)"
        )
    on_gpu = accelerator == "gpu" or (accelerator == "auto" and gpus_available > 0)
    if on_gpu and precision == "bf16-mixed" and not bf16_supported:
        raise DeviceError("precision 'bf16-mixed' needs a GPU with bfloat16 (compute capability 8.0+)")
    return DeviceSpec("gpu" if on_gpu else "cpu", precision)


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The CUDA devices this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else every one
    torch sees (none without a CUDA build of torch)."""
    import os

    try:
        import torch

        if not torch.cuda.is_available():  # a CPU build of torch, or no driver
            return []
        count = torch.cuda.device_count()
    except Exception:  # a broken driver: no GPU, not a crash
        return []
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(count)]


def bf16_supported() -> bool:
    """Whether this process's CUDA device computes in bfloat16 (True on CPU: Lightning supports it)."""
    try:
        import torch

        return not torch.cuda.is_available() or bool(torch.cuda.is_bf16_supported())
    except Exception:
        return False


def cuda_uuid() -> str | None:
    """The UUID of the CUDA device this process trains on (``torch.device("cuda")``, the first
    it sees), unique across hosts; None where torch sees no CUDA device."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid) or None
    except Exception:  # a broken driver: no identity, not a crash
        return None


def all_bf16(answers: Mapping[str, object]) -> bool:
    """Whether every worker that answered (address -> its :func:`bf16_supported`) computes in
    bfloat16: only a True counts (an error in its place does not); no worker at all (no GPU
    worker) is the CPU's answer, True."""
    return all(answer is True for answer in answers.values())


@dataclass(frozen=True)
class WorkerSpec:
    """One LocalCluster worker process: its environment and its Dask resources."""

    name: str
    env: dict[str, str]
    resources: dict[str, float]


def gpu_worker_plan(gpus: Sequence[str], trials_per_gpu: int) -> list[WorkerSpec]:
    """``trials_per_gpu`` worker processes per GPU, each seeing only its GPU and declaring
    ``GPU=1`` (one trial or unit at a time): small models share a device, large ones get it whole."""
    if trials_per_gpu < 1:
        raise DeviceError(f"trials_per_gpu={trials_per_gpu} must be at least 1")
    return [
        WorkerSpec(f"gpu{gpu}-{slot}", {"CUDA_VISIBLE_DEVICES": gpu}, {GPU_RESOURCE: 1})
        for gpu in gpus
        for slot in range(trials_per_gpu)
    ]


def gpu_worker_addresses(client: Any) -> list[str]:
    """The workers of a running cluster that declare a whole GPU (what a unit on a GPU needs,
    :meth:`DeviceSpec.resources`), sorted."""
    return workers_with(client, {GPU_RESOURCE: 1})


def gpu_workers(client: Any) -> int:
    """How many workers of a running cluster declare the GPU resource."""
    return len(gpu_worker_addresses(client))


def gpu_workers_bf16(
    client: Any, workers: Sequence[str], probe: Callable[..., bool] = bf16_supported
) -> bool:
    """Whether every one of ``workers`` computes in bfloat16, asked of each (``probe`` runs in
    the worker's process, on the GPU its trials get, as ``client.run`` calls it); True for no
    workers."""
    if not workers:
        return True
    return all_bf16(client.run(probe, workers=list(workers), on_error="return"))


def local_device(accelerator: Accelerator, precision: Precision) -> DeviceSpec:
    """Resolve the accelerator for training in this process (the distillation student): ``auto``
    takes this process's GPU when one is visible."""
    return resolve_device(accelerator, precision, len(visible_gpus()), bf16_supported())


def device_for_cluster(client: Any, accelerator: Accelerator, precision: Precision) -> DeviceSpec:
    """Resolve the accelerator against the cluster the training runs on: bfloat16 is asked of
    the GPU workers, where the training runs, not of this process's host (which may have no
    GPU, or another one); only when ``bf16-mixed`` on a GPU is in question."""
    gpus = gpu_worker_addresses(client)
    device = resolve_device(accelerator, precision, len(gpus))
    if device.is_gpu and precision == "bf16-mixed":  # asked only then: a worker sets CUDA up to answer
        device = resolve_device(accelerator, precision, len(gpus), gpu_workers_bf16(client, gpus))
    return device
