"""Where DDP trials' ranks run: gangs of workers, all of a trial's ranks placed at once or none.

A trial of world size ``w`` needs ``w`` Dask workers that hold the resources it asks for
(``GPU``, or a CPU slot) and see *different* devices: two ranks sharing a GPU would train one
device twice over. Workers started with ``trials_per_gpu > 1`` share a GPU (the same GPU UUID,
or the same ``CUDA_VISIBLE_DEVICES`` on the same host), so a gang takes at most one of them per
GPU. With ``W`` such workers, ``floor(W / w)`` trials train at once; a trial whose gang lost a
worker gives the rest back and waits for a whole new gang, preferably one without the workers
it blames, so the other trials go on undisturbed.

:func:`choose_gang` is the pure choice; :class:`WorkerGangs` keeps which workers are taken,
under a lock, for the executor's threads (one per trial in flight).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mopflow.training.compute.devices import GPU_RESOURCE, cuda_uuid
from mopflow.training.compute.workers import cluster_workers

WAIT_POLL_S = 0.2


class PlacementError(RuntimeError):
    """The cluster can never hold a trial's ranks (too few workers, or too few devices)."""


def choose_gang(
    free: Mapping[str, str], world_size: int, prefer_not: Collection[str] = ()
) -> list[str] | None:
    """``world_size`` workers of ``free`` (address -> the device it sees) on distinct devices,
    in address order (rank 0 first); None when ``free`` has too few distinct devices.

    Workers in ``prefer_not`` (those of a gang that lost a rank) come after all others, rank 0
    included: they are taken only where the others do not make up a gang."""
    gang: list[str] = []
    devices: set[str] = set()
    for address in sorted(free, key=lambda a: (a in prefer_not, a)):
        if free[address] not in devices:
            gang.append(address)
            devices.add(free[address])
        if len(gang) == world_size:
            return gang
    return None


def avoidable(devices: Mapping[str, str], world_size: int, shunned: Collection[str]) -> bool:
    """Whether the workers (address -> device) but ``shunned`` make up a gang at all, free or
    taken: if not, waiting for one to be freed is in vain."""
    return choose_gang({a: d for a, d in devices.items() if a not in shunned}, world_size) is not None


def concurrent_trials(devices: Mapping[str, str], world_size: int) -> int:
    """How many trials of ``world_size`` ranks the workers (address -> device) hold at once:
    ``floor(W / w)``, fewer when workers share devices (each gang needs distinct ones)."""
    taken: set[str] = set()
    trials = 0
    while (gang := choose_gang({a: d for a, d in devices.items() if a not in taken}, world_size)) is not None:
        taken.update(gang)
        trials += 1
    return trials


def placement_problem(devices: Mapping[str, str], world_size: int, needed: Mapping[str, float]) -> str | None:
    """Why no trial of ``world_size`` ranks fits the workers (address -> device), or None."""
    if concurrent_trials(devices, world_size):
        return None
    what = f" with resources {dict(needed)}" if needed else ""
    distinct = len(set(devices.values()))
    if len(devices) >= world_size:  # enough workers, too few devices: they share GPUs
        return (
            f"ddp_world_size={world_size} needs its ranks on {world_size} different devices; the cluster's "
            f"{len(devices)} workers{what} see {distinct} (workers started with trials_per_gpu > 1 share a "
            f"GPU: give trials_per_gpu=1, or more GPUs)"
        )
    return (
        f"ddp_world_size={world_size} needs {world_size} Dask workers{what}; the cluster has {len(devices)}"
    )


def device_identity(gpu: bool, worker_address: str, host: str, visible: str, uuid: str | None) -> str:
    """What tells the device a worker trains on from every other one in the cluster.

    On the CPU (``gpu`` False) each worker is its own slot. A GPU is named by its UUID where
    torch sees it (unique across hosts), else by the worker's host and ``CUDA_VISIBLE_DEVICES``
    (``visible``): device 0 on two hosts is two devices, while two workers of one host that see
    the same GPU (``trials_per_gpu`` > 1) are one."""
    if not gpu:
        return f"cpu:{worker_address}"
    if uuid:
        return f"cuda:{uuid}"
    return f"cuda:{host}:{visible or 'default'}"


def worker_device(dask_worker: Any, gpu: bool = False) -> str:
    """The device a worker process trains on (``client.run`` hands it ``dask_worker``), as
    :func:`device_identity` names it; ``gpu``: whether the ranks train on its GPU."""
    return device_identity(
        gpu,
        dask_worker.address,
        socket.gethostname(),
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        cuda_uuid() if gpu else None,  # a CPU rank does not touch CUDA
    )


class WorkerGangs:
    """The workers taken by DDP trials in flight; hands out whole gangs (see the module)."""

    def __init__(self, client: Any, world_size: int, needed: Mapping[str, float]) -> None:
        self.client, self.world_size, self.needed = client, world_size, dict(needed)
        self._taken: set[str] = set()
        self._known: dict[str, str] = {}  # address -> device, asked once per worker
        self._lock = threading.Lock()

    def devices(self) -> dict[str, str]:
        """Address -> device of the live workers that hold the resources a rank needs."""
        info = cluster_workers(self.client)
        fit = [
            address
            for address, worker in info.items()
            if all(float((worker.get("resources") or {}).get(k, 0)) >= v for k, v in self.needed.items())
        ]
        with self._lock:  # the trials' threads ask at once; each new worker is asked once
            new = [a for a in fit if a not in self._known]
            if new:
                self._known |= self.client.run(
                    worker_device, workers=new, on_error="ignore", gpu=GPU_RESOURCE in self.needed
                )
            return {a: self._known[a] for a in fit if a in self._known}

    def slots(self, wait_s: float) -> int:
        """How many trials may train at once; waits up to ``wait_s`` for workers (a restarting
        one) and raises :class:`PlacementError` when not even one trial fits."""
        deadline = time.monotonic() + wait_s
        while not (n := concurrent_trials(self.devices(), self.world_size)) and time.monotonic() < deadline:
            time.sleep(WAIT_POLL_S * 2)
        if not n:
            raise PlacementError(placement_problem(self.devices(), self.world_size, self.needed))
        return n

    def take(
        self,
        wait_s: float,
        avoid: Sequence[str] = (),
        prefer_not: Collection[str] = (),
        prefer_wait_s: float = 0.0,
    ) -> list[str]:
        """A whole gang of free workers (rank 0 first), taken; waits up to ``wait_s`` for one.
        ``avoid``: workers known to be leaving (a spot notice). ``prefer_not``: workers of a gang
        that lost a rank (a cut link between them would fail the next attempt too), taken only
        when no gang without them is free within ``prefer_wait_s``, or none can ever be formed."""
        start = time.monotonic()
        deadline = start + wait_s
        while True:
            devices = self.devices()
            with self._lock:
                free = {a: d for a, d in devices.items() if a not in self._taken and a not in avoid}
                gang = choose_gang(free, self.world_size, prefer_not)
                if gang is not None and (
                    not prefer_not
                    or not set(gang) & set(prefer_not)
                    or time.monotonic() - start >= prefer_wait_s
                    or not avoidable(devices, self.world_size, [*avoid, *prefer_not])
                ):
                    self._taken.update(gang)
                    return gang
            if time.monotonic() > deadline:
                problem = placement_problem(devices, self.world_size, self.needed)
                raise PlacementError(
                    problem or f"no {self.world_size} free workers on distinct devices within {wait_s:.0f}s"
                )
            time.sleep(WAIT_POLL_S)

    def give_back(self, gang: Sequence[str]) -> None:
        """The gang's workers are free again (those still in the cluster)."""
        with self._lock:
            self._taken.difference_update(gang)
