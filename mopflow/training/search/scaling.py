"""Grow (or shrink) the Dask cluster by a worker schedule: n_j workers in round j (issue #8).

The paper's schedule ``n_j`` counts iterations of synchronous SGD. A sweep has no global
iteration, so here ``j`` counts *rounds*, the points where the cluster can change size without
interrupting any work:

* ``mop``: round j is the executor's j-th MOP epoch (every active model trains one epoch, visiting
  every partition once). Before it starts the cluster is scaled to n_j workers and the partitions
  (``min(n_max, shards)`` of them, fixed for the sweep) are placed round-robin on the workers present.
* ``task``: a trial runs whole on one worker, so round j is a batch of trials: the cluster is scaled
  to n_j workers, one trial per worker present (at most n_j) is started, and round j+1 begins when all of them have
  finished (a barrier: a worker whose trial was pruned early waits for the round to end). ``parallel_trials``
  is then ignored.

Scaling is a :class:`ClusterScaler`: a ``LocalCluster`` starts and stops worker processes
(:class:`LocalClusterScaler`); an external scheduler can only lose workers, so
:class:`RetiringScaler` retires the surplus and waits for an outside deployment to add workers. A
scale-up waits up to ``timeout_s`` for the workers to join; past it the round runs on the workers
present and a warning names both counts. Every round's target and actual count is recorded
(:class:`RoundScale`) and logged to MLflow as ``workers_target`` / ``workers`` (step = round).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mopflow.training.compute.workers import worker_addresses
from mopflow.training.volatile.preempt import register_preemption
from mopflow.training.volatile.schedules import WorkerSchedule, workers_at

if TYPE_CHECKING:
    from mopflow.base.tracking import Tracker
    from mopflow.training.search.config import SearchConfig

log = logging.getLogger(__name__)

POLL_S = 0.1


class ScalingError(RuntimeError):
    """The cluster could not be brought to a usable size."""


class ClusterScaler(Protocol):
    """Brings the cluster to ``n`` workers; returns how many are present afterwards."""

    def scale(self, n: int) -> int: ...


def wait_for_workers(
    client: Any, n: int, timeout_s: float, clock: Callable[[], float] = time.monotonic
) -> int:
    """Wait until exactly ``n`` workers are present or ``timeout_s`` passes; returns the count then.

    A timeout is not an error as long as one worker is present (the round runs on what is there,
    with a warning); with none, :class:`ScalingError`.
    """
    deadline = clock() + timeout_s
    while True:
        count = len(worker_addresses(client))
        if count == n:
            return count
        if clock() >= deadline:
            if count == 0:
                raise ScalingError(f"scaling: no worker joined within {timeout_s:.0f}s (wanted {n})")
            log.warning(
                "scaling: wanted %d workers, %d present after %.0fs; going on with %d",
                n,
                count,
                timeout_s,
                count,
            )
            return count
        time.sleep(POLL_S)


@dataclass
class LocalClusterScaler:
    """A ``LocalCluster`` (any ``SpecCluster``): ``cluster.scale(n)`` starts or stops worker processes."""

    cluster: Any
    client: Any
    timeout_s: float = 120.0

    def scale(self, n: int) -> int:
        if n < 1:
            raise ValueError(f"a cluster needs at least 1 worker, got {n}")
        self.cluster.scale(n)
        return wait_for_workers(self.client, n, self.timeout_s)


@dataclass
class RetiringScaler:
    """An external scheduler: surplus workers are retired (closed gracefully, their data moved);
    missing ones must be started by the deployment (an autoscaler), which is waited for."""

    client: Any
    timeout_s: float = 120.0

    def scale(self, n: int) -> int:
        if n < 1:
            raise ValueError(f"a cluster needs at least 1 worker, got {n}")
        present = worker_addresses(self.client)
        if len(present) > n:
            surplus = present[n:]
            log.info("scaling: retiring %d worker(s) %s", len(surplus), surplus)
            self.client.retire_workers(workers=surplus, close_workers=True)
        elif len(present) < n:
            log.info(
                "scaling: %d worker(s) present, %d wanted; waiting up to %.0fs for the deployment to add them",
                len(present),
                n,
                self.timeout_s,
            )
        return wait_for_workers(self.client, n, self.timeout_s)


def scaler_for(client: Any, timeout_s: float = 120.0) -> ClusterScaler:
    """A :class:`LocalClusterScaler` when the client owns a ``SpecCluster`` (LocalCluster), else a
    :class:`RetiringScaler` for the external scheduler it is connected to."""
    from distributed import SpecCluster

    cluster = getattr(client, "cluster", None)
    if isinstance(cluster, SpecCluster):
        return LocalClusterScaler(cluster, client, timeout_s)
    return RetiringScaler(client, timeout_s)


@dataclass(frozen=True)
class RoundScale:
    """What round ``round`` (from 1) asked for and got."""

    round: int
    target: int  # n_j from the schedule
    workers: int  # workers present when the round started
    seconds: float  # spent scaling


class RoundScaling:
    """Drives a :class:`ClusterScaler` by a :class:`WorkerSchedule`, round by round (see the module
    docstring). Without a schedule it keeps the fixed behaviour: at most ``fixed_workers`` trials
    at once, and no hook for the MOP executor."""

    def __init__(
        self, schedule: WorkerSchedule | None, scaler: ClusterScaler | None, fixed_workers: int = 1
    ) -> None:
        if schedule is not None and scaler is None:
            raise ValueError("a worker schedule needs a cluster scaler")
        self.schedule = schedule
        self.scaler = scaler
        self.fixed_workers = fixed_workers
        self.history: list[RoundScale] = []
        self._quota = 0  # trials the current (task) round may still start

    @property
    def enabled(self) -> bool:
        return self.schedule is not None

    def partitions(self) -> int | None:
        """MOP partitions for a scaled sweep (n_max: one per worker at the widest); None = default."""
        return self.schedule.n_max if self.schedule is not None else None

    def round_hook(self) -> Callable[[int], int] | None:
        """What the MOP executor calls before round ``round_index`` (from 0); None when not scaling."""
        return self.before_round if self.enabled else None

    def before_round(self, round_index: int) -> int:
        """Scale to n_j for round j = ``round_index + 1``; returns the workers present."""
        assert self.schedule is not None and self.scaler is not None
        j = round_index + 1
        target = workers_at(self.schedule, j)
        started = time.monotonic()
        present = self.scaler.scale(target)
        step = RoundScale(j, target, present, time.monotonic() - started)
        self.history.append(step)
        log.info("scaling: round %d: n_j=%d, %d worker(s) present (%.1fs)", j, target, present, step.seconds)
        return present

    # -- task strategy: rounds of trials -------------------------------------------------------
    def may_start(self, in_flight: int) -> bool:
        """Whether the search may start another trial now, ``in_flight`` running."""
        if not self.enabled:
            return in_flight < self.fixed_workers
        if self._quota > 0:
            return True
        if in_flight:
            return False  # the round's barrier: wait until its trials are done
        present = self.before_round(len(self.history))
        self._quota = min(present, self.history[-1].target)  # one trial per worker, at most n_j
        return True

    def started(self) -> None:
        """A trial was started."""
        if self.enabled:
            self._quota -= 1


def round_scaling(cfg: SearchConfig, client: Any) -> RoundScaling:
    """The scaling a search config asks for on this client's cluster."""
    if cfg.worker_schedule is None:
        return RoundScaling(None, None, cfg.parallel_trials)
    log.info("scaling: worker schedule %s", cfg.worker_schedule.model_dump())
    return RoundScaling(cfg.worker_schedule, scaler_for(client, cfg.scale_timeout_s), cfg.parallel_trials)


def log_worker_rounds(
    tracker: Tracker, run_id: str, rounds: tuple[RoundScale, ...] | list[RoundScale]
) -> None:
    """``workers_target`` (n_j) and ``workers`` (present) per round, step = round (from 1)."""
    if not rounds:
        return
    tracker.log_metric_history(run_id, "workers_target", [(r.round, float(r.target)) for r in rounds])
    tracker.log_metric_history(run_id, "workers", [(r.round, float(r.workers)) for r in rounds])
    tracker.log_metrics(run_id, {"worker_rounds": float(sum(r.workers for r in rounds))})


def log_volatile(tracker: Tracker, run_id: str, outcome: Any) -> None:
    """Log what a sweep on scaled or spot workers recorded (a :class:`~mopflow.training.search.study.SearchOutcome`)."""
    log_worker_rounds(tracker, run_id, tuple(getattr(outcome, "worker_rounds", ())))
    spot = getattr(outcome, "spot", None)
    if spot is not None:
        from mopflow.training.volatile.spot_report import log_replay

        log_replay(tracker, run_id, spot)


def spot_replay_for(
    cfg: SearchConfig, client: Any, grace_s: float, storage_options: Mapping[str, Any] | None = None
) -> Any:
    """A :class:`~mopflow.training.volatile.spot_replay.SpotReplay` for ``cfg.spot_trace`` (a path or fsspec URL) on this
    client's LocalCluster, validated before any training: the trace file, the cluster, one bid per worker."""
    from distributed import Nanny, SpecCluster

    from mopflow.training.volatile.price_trace import read_price_trace
    from mopflow.training.volatile.prices import PriceError
    from mopflow.training.volatile.spot_replay import SpotReplay

    cluster = getattr(client, "cluster", None)
    if not isinstance(cluster, SpecCluster):
        raise PriceError(
            "spot_trace replay stops and starts the workers of a LocalCluster; this search is connected "
            "to an external scheduler (MOPFLOW_DASK_ADDRESS); unset it or drop spot_trace"
        )
    if any(spec.get("cls") is not Nanny for spec in cluster.worker_spec.values()):
        raise PriceError("spot_trace replay needs a LocalCluster of worker processes (processes=True)")
    trace = read_price_trace(cfg.spot_trace, storage_options)
    return SpotReplay(
        cluster,
        client,
        trace,
        cfg.spot_bids or [],
        cfg.spot_speed,
        kill_after_s=grace_s + 15.0,
        source=cfg.spot_trace,
    )


def with_spot_replay(
    cfg: SearchConfig, client: Any, storage_options: Mapping[str, Any] | None, search: Callable[[], Any]
) -> Any:
    """Run ``search`` (which returns a ``SearchOutcome``): with ``cfg.spot_trace`` set, the trace is
    replayed against the cluster of ``client`` while it runs, and the outcome carries the
    :class:`~mopflow.training.volatile.spot_report.SpotReport` as ``spot``."""
    if not cfg.spot_trace:
        return search()
    grace = register_preemption(client)  # before the first notice can come
    replay = spot_replay_for(cfg, client, grace, storage_options)
    replay.start()
    try:
        outcome = search()
    finally:
        report = replay.stop()
    return dataclasses.replace(outcome, spot=report)
