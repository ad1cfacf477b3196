"""Dask client at the edge: an existing scheduler when an address is set, else a LocalCluster.

One process that runs several stages in turn (``mopflow run``) can keep its LocalCluster between
them (:func:`shared_local_clusters`): the workers start once and have their imports done when the
next stage needs them. It can also start that cluster early (:func:`start_local_cluster_early`),
its workers importing the training stack while the process does other work.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import dask
from distributed import Client, LocalCluster

from mopflow.base.hosts import SAME_HOST_WORKER_ENV
from mopflow.training.compute.devices import DeviceError, WorkerSpec, gpu_worker_plan, visible_gpus
from mopflow.training.compute.workers import cluster_workers

log = logging.getLogger(__name__)


def local_gpus(accelerator: str, gpus: Sequence[str] | None = None) -> list[str]:
    """The GPUs a LocalCluster gives its workers: none for ``cpu``; the visible ones otherwise
    (``gpus`` overrides what is visible). ``gpu`` with none visible is refused."""
    if accelerator == "cpu":
        return []
    found = list(visible_gpus() if gpus is None else gpus)
    if accelerator == "gpu" and not found:
        raise DeviceError(
            "accelerator 'gpu' but no CUDA device is visible (CUDA_VISIBLE_DEVICES, or a CPU-only "
            "torch: install the CUDA build of torch for GPU workers)"
        )
    return found


# What a trial imports on its worker: pytorch_lightning alone takes 2-4 s of CPU (it pulls in
# torchmetrics, scipy.signal, matplotlib and torch._dynamo).
TRAINING_IMPORTS = ("pytorch_lightning", "mopflow.training.executors.units")

START_METHOD = "distributed.worker.multiprocessing-method"


def worker_start_settings(gpu_workers: bool) -> dict[str, str]:
    """How a LocalCluster's worker processes start: from a fork server that imported the
    training stack once (:func:`preload_training_stack`), for CPU workers on Linux.

    Spawned, every worker imports torch and Lightning itself: about 4 s of CPU each, again for
    every worker restarted after a loss. Forked from the server, none does; a tiny ``mopflow run``
    used 15% less CPU (``docs/architecture.md``). GPU workers are spawned: each is given its own
    ``CUDA_VISIBLE_DEVICES``, which CUDA reads once per process. A start method the user set in
    Dask's config (``DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=spawn`` or a YAML file) is
    kept."""
    if dask.config.get(START_METHOD, default=None, config=dask.config.collect()):
        return {}
    forked = not gpu_workers and sys.platform == "linux"
    return {START_METHOD: "forkserver" if forked else "spawn"}


def preload_training_stack() -> None:
    """Have the fork server import Dask and the training stack before it forks its first worker
    (with the fork-server start method set; a server already running keeps what it has)."""
    from distributed.utils import get_mp_context

    get_mp_context().set_forkserver_preload(["distributed", *TRAINING_IMPORTS])


# Within shared_local_clusters(): the LocalClusters kept between uses, by the shape asked for (a
# Future while one started early is still starting).
_SHARED: dict[tuple[Any, ...], _Local | Future[_Local]] | None = None


@contextmanager
def shared_local_clusters() -> Iterator[None]:
    """Within this block, :func:`dask_client` keeps each LocalCluster it starts and hands it to the
    next use asking for the same workers, instead of starting another (one per stage cost a
    pipeline run seconds of worker start-up each time); all are closed when the block ends. A
    cluster whose workers changed meanwhile (one lost, or scaled by a volatile sweep) is closed
    after its use rather than kept."""
    global _SHARED
    if _SHARED is not None:  # already sharing (nested): the outer block closes them
        yield
        return
    _SHARED = {}
    try:
        yield
    finally:
        kept, _SHARED = _SHARED, None
        for entry in kept.values():
            local = _ready(entry)
            if local is not None:
                local.close()


def start_local_cluster_early(n_workers: int, warm_imports: Sequence[str] = TRAINING_IMPORTS) -> None:
    """Within :func:`shared_local_clusters`: start the CPU LocalCluster that a later
    ``dask_client("", n_workers)`` will ask for now, in a background thread, each worker then
    importing ``warm_imports``; the caller goes on meanwhile (``mopflow run`` migrates Airflow's
    DB and builds its DAG run while the workers start). The use that asks for it waits until it
    has started; one that failed to start is started again there. Outside the block: nothing."""
    key = _shape(n_workers, ())
    if _SHARED is None or key in _SHARED:
        return
    starting: Future[_Local] = Future()

    def start() -> None:
        try:
            local = _start(n_workers, (), 1)
        except BaseException as exc:  # handed to the use that waits for it
            starting.set_exception(exc)
            return
        try:  # a warm-up that cannot be submitted only costs the first trial its imports
            local.warm(warm_imports)
        except Exception as exc:
            log.warning("the Dask workers' warm-up imports were not started: %s: %s", type(exc).__name__, exc)
        starting.set_result(local)  # always: the use that waits for it must not wait forever

    _SHARED[key] = starting
    threading.Thread(target=start, name="mopflow-local-cluster-start", daemon=True).start()


def _ready(entry: _Local | Future[_Local]) -> _Local | None:
    """A kept cluster, waiting for one still starting; None if it failed to start (logged)."""
    if isinstance(entry, _Local):
        return entry
    try:
        return entry.result()
    except Exception as exc:
        log.warning("the Dask LocalCluster started early failed: %s: %s", type(exc).__name__, exc)
        return None


@contextmanager
def dask_client(
    address: str = "",
    n_workers: int = 2,
    accelerator: str = "cpu",
    trials_per_gpu: int = 1,
    gpus: Sequence[str] | None = None,
) -> Iterator[Client]:
    """Yield a Dask client; a LocalCluster (one thread per worker process) is closed on exit,
    or kept for the next use within :func:`shared_local_clusters`.

    With an ``accelerator`` other than ``cpu`` and CUDA devices visible, the LocalCluster starts
    ``trials_per_gpu`` worker processes per GPU instead of ``n_workers``, each seeing only its
    GPU (``CUDA_VISIBLE_DEVICES``) and declaring the Dask resource ``GPU=1``.
    """
    if address:
        log.info("connecting to Dask scheduler at %s", address)
        with Client(address, timeout="30s") as client:
            yield client
        return
    plan = gpu_worker_plan(local_gpus(accelerator, gpus), trials_per_gpu)
    key = _shape(n_workers, plan)
    kept = _ready(_SHARED.pop(key)) if _SHARED is not None and key in _SHARED else None
    if kept is not None:
        local = kept
        log.info("using the running Dask LocalCluster (%d worker processes)", local.size)
    else:
        local = _start(n_workers, plan, trials_per_gpu)
    try:
        yield local.client
    finally:
        if _SHARED is not None and key not in _SHARED and local.unchanged():
            _SHARED[key] = local
        else:
            local.close()


def _shape(n_workers: int, plan: Sequence[WorkerSpec]) -> tuple[Any, ...]:
    """What a kept cluster must match to serve a use: its CPU workers, or each GPU worker's name,
    environment and resources (a WorkerSpec holds dicts: not hashable as it is)."""
    if not plan:
        return (n_workers,)
    return tuple((w.name, tuple(sorted(w.env.items())), tuple(sorted(w.resources.items()))) for w in plan)


def _start(n_workers: int, plan: Sequence[WorkerSpec], trials_per_gpu: int) -> _Local:
    """A LocalCluster of ``n_workers`` CPU workers, or of one worker per ``plan`` entry, and its client."""
    if plan:
        log.info(
            "starting Dask LocalCluster with %d GPU worker processes (%d per GPU)", len(plan), trials_per_gpu
        )
    else:
        log.info("starting Dask LocalCluster with %d worker processes", n_workers)
    with contextlib.ExitStack() as undo:  # what is entered here is undone in this order on close
        # Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which freezes glibc's
        # mmap threshold: every numpy temporary over 128 KiB is then mmap'd and page-faulted
        # afresh, and the heap is trimmed on each free. MNIST-1D generation cost 15-45% more CPU
        # in a worker than in a plain process (benchmarks/shard.py); glibc's defaults it is.
        # Held while the cluster runs: a worker restarted later is started with them too.
        undo.enter_context(
            dask.config.set(
                {
                    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                    # The statistical profiler samples every worker's stack 100 times a second,
                    # taking the GIL from the task each time; its only reader is the dashboard,
                    # which a LocalCluster here never serves (dashboard_address=None).
                    "distributed.worker.profile.enabled": False,
                    # Every process's event loop wakes 50 times a second to time itself (tick),
                    # and samples its own memory and system counters every 100-500 ms: idle, the
                    # three processes used 0.64 CPU-s per 7 s (about 5% of a 2-core machine, taken
                    # from the tasks). These intervals cut that to 0.09 CPU-s; the memory limits
                    # are still checked twice a second and a blocked event loop still warned
                    # about after 3 s.
                    "distributed.admin.tick.interval": "500ms",
                    "distributed.admin.system-monitor.interval": "2s",
                    "distributed.worker.memory.monitor-interval": "500ms",
                }
                | worker_start_settings(gpu_workers=bool(plan))
            )
        )
        if dask.config.get(START_METHOD) == "forkserver":
            preload_training_stack()
        cluster = undo.enter_context(
            LocalCluster(
                n_workers=0 if plan else n_workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                host="127.0.0.1",
                silence_logs=logging.WARNING,
                # A forked worker starts with the fork server's environment: give it this
                # process's, as a spawned worker has it; but no storage options of its own (on
                # this host, what a stage sends is right, an Airflow connection's included).
                env={**os.environ, **SAME_HOST_WORKER_ENV},
            )
        )
        # Closed, not exited: a client's exit resets a context variable, and a kept cluster's
        # client is closed from another context than the stage's that started it.
        client = Client(cluster)
        undo.callback(client.close)
        if plan:
            _add_workers(cluster, client, plan)
        return _Local(cluster, client, len(plan) or n_workers, undo.pop_all())


class _Local:
    """A LocalCluster started here, its client, and what closes them (the settings restored last)."""

    def __init__(self, cluster: LocalCluster, client: Client, size: int, undo: contextlib.ExitStack) -> None:
        self.cluster, self.client, self.size, self._undo = cluster, client, size, undo
        self.warming: list[Any] = []  # the warm-up imports' futures, held until they are done

    def warm(self, modules: Sequence[str]) -> None:
        """Have every worker import ``modules`` as its first task, without waiting for it (a
        failed import is logged; the task that needs the module fails on its own)."""
        if not modules:
            return
        for address in cluster_workers(self.client):
            future = self.client.submit(
                import_modules, tuple(modules), workers=[address], allow_other_workers=False, pure=False
            )
            future.add_done_callback(self._warmed)
            self.warming.append(future)

    def _warmed(self, future: Any) -> None:
        if future.status == "error":
            log.warning("a Dask worker's warm-up imports failed: %s", future.exception())
        with contextlib.suppress(ValueError):
            self.warming.remove(future)

    def unchanged(self) -> bool:
        """Whether it still has the workers it was started with, all connected."""
        try:
            return (
                self.client.status == "running"
                and len(self.cluster.worker_spec) == self.size
                and len(cluster_workers(self.client)) == self.size
            )
        except Exception:  # a cluster that cannot answer is not kept
            return False

    def close(self) -> None:
        """Close the client, then the cluster (the worker processes end), then restore the settings."""
        self._undo.close()


def _add_workers(cluster: LocalCluster, client: Client, plan: Sequence[WorkerSpec]) -> None:
    """Start one worker process per spec, with the cluster's own worker options plus its env
    and resources, and wait until all have joined."""
    for worker in plan:
        spec = dict(cluster.new_spec)
        env = {**worker.env, **SAME_HOST_WORKER_ENV}
        spec["options"] = {**spec["options"], "env": env, "resources": dict(worker.resources)}
        cluster.worker_spec[worker.name] = spec
    cluster.sync(cluster._correct_state)
    client.wait_for_workers(len(plan), timeout=120)


def import_modules(modules: Sequence[str]) -> None:
    """Import ``modules`` (in a worker: its first task, so that a trial's imports are done)."""
    for name in modules:
        importlib.import_module(name)


def forward_worker_logs(client: Any) -> None:
    """Show the workers' per-epoch progress (``mopflow.training``'s log) in this process's log."""
    try:
        client.forward_logging("mopflow.training", level=logging.INFO)
    except Exception:  # an older scheduler without log forwarding still trains
        log.debug("worker log forwarding unavailable")
