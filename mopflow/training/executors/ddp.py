"""Data parallelism inside each model: Lightning DDP over W ranks on W Dask workers, several
trials at once.

Each configuration is one job of W tasks (``training/executors/ddp_rank.py``), one per worker
that holds the resources the trial needs (``GPU``, or a CPU slot), in their own process group
with the rendezvous at rank 0's worker: a trial spans worker processes, and hosts. With N such
workers, ``floor(N / W)`` trials train at once, each on a gang of workers taken whole
(``training/executors/ddp_workers.py``); a freed gang goes to the controller's next trial at
once. The caller hears each epoch's report as rank 0 sends it, and the ranks wait for its
decision before they train on (``training/executors/ddp_job.py``): a pruned trial ends at the
epoch it was judged on. A rank whose worker dies fails its job within the collective timeout;
the job alone starts again from its last checkpoint (weights, optimizer moments and schedule
position), once per lost rank up to ``max_restarts``, on a gang without the failed attempt's
workers where one is free within ``SHUN_WAIT_S`` (without the worker that left, when the error
names it): a cut link between two of them would otherwise fail every restart. A spot notice on
any rank (or a stop of the run) stops all of the job's ranks at the same batch with a checkpoint
there; the job goes on from that batch on a gang without the leaving worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from mopflow.base import stopping
from mopflow.base.fencing import Superseded
from mopflow.training.compute.workers import cluster_workers
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import (
    Controller,
    EpochReport,
    Executor,
    ModelOutcome,
    raise_if_cluster_lost,
)
from mopflow.training.executors.ddp_job import DDPJob, JobPreempted, MasterPortTaken, RankLost
from mopflow.training.executors.ddp_workers import PlacementError, WorkerGangs
from mopflow.training.executors.stop_notice import StopNotice
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)

WORKER_WAIT_S = 120.0  # how long a job waits for a gang of workers (a killed one being restarted)
MAX_NOTICES = 20  # spot notices one trial may take before it is failed (the cluster keeps leaving)
MAX_PORT_CHOICES = 3  # rendezvous ports found taken before the trial fails (each costs no training)
# How long a job that lost a rank waits for a gang without the workers it blames before it takes
# them again: a freed gang may come along, but a cluster of exactly one gang would wait in vain
# (that case is seen at once and not waited for).
SHUN_WAIT_S = 30.0
SUSPECT_S = 600.0  # how long later trials, too, prefer other workers than those that lost a rank

__all__ = ["DDPExecutor", "PlacementError", "RankLost"]


def shunned_after_loss(gang: Sequence[str], lost: RankLost) -> list[str]:
    """The workers the next attempt prefers not to take after ``gang`` lost a rank: those the
    error blames, else the whole gang (a link cut between two of its workers is not told apart
    from a peer that died, and would fail the next attempt on the same workers too)."""
    return list(lost.workers) or list(gang)


class _Serialized:
    """The caller's controller, called by one trial's thread at a time (Optuna's study and the
    pruner's rungs are shared by every trial in flight)."""

    def __init__(self, inner: Controller) -> None:
        self.inner, self.lock = inner, threading.RLock()

    def on_epoch_end(self, report: EpochReport) -> bool:
        with self.lock:
            return self.inner.on_epoch_end(report)

    def on_model_done(self, outcome: ModelOutcome) -> None:
        with self.lock:
            self.inner.on_model_done(outcome)

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        with self.lock:
            return self.inner.new_models(free_slots)


class DDPExecutor(Executor):
    """Models trained by W DDP ranks each on W Dask workers, as many at once as gangs fit."""

    name = "ddp"
    stops_on_its_own = True  # a stop lets every job's ranks checkpoint at the same batch first

    def __init__(
        self,
        client: Any,
        data: DataRef,
        world_size: int = 2,
        checkpoint_root: str = "",
        bf16_compress: bool = False,
        epoch_timeout_s: float = 600.0,
        collective_timeout_s: float = 120.0,
        max_restarts: int = 2,
        max_trials: int | None = None,
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.world_size = world_size
        self.bf16_compress = bf16_compress
        self.epoch_timeout_s = epoch_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.max_restarts = max_restarts
        self.max_trials = max_trials  # None: as many at once as gangs fit
        self.rank_pids: dict[str, list[int]] = {}  # model -> the process of each rank (last attempt)
        # model -> the network interface each rank's collectives used (last attempt; "": the
        # backend's own pick, from the hostname)
        self.rank_interfaces: dict[str, list[str]] = {}
        self.allreduce_bytes: dict[str, int] = {}  # model -> gradient bytes its ranks all-reduced
        # worker -> when a job of it last lost a rank: later trials prefer other workers too, so a
        # cut link between two workers does not fail every trial that starts there first
        self.suspects: dict[str, float] = {}
        self._gangs: WorkerGangs | None = None

    def gangs(self, spec: ModelSpec) -> WorkerGangs:
        """The gang keeper for trials like ``spec`` (every trial of a sweep asks the same)."""
        if self._gangs is None:
            self._gangs = WorkerGangs(self.client, self.world_size, spec.device.resources())
        return self._gangs

    def recent_suspects(self, now: float | None = None) -> list[str]:
        """Workers whose jobs lost a rank within the last ``SUSPECT_S`` seconds."""
        since = (time.monotonic() if now is None else now) - SUSPECT_S
        return sorted(w for w, at in self.suspects.items() if at >= since)

    def rank_workers(self, spec: ModelSpec, wait_s: float = WORKER_WAIT_S) -> list[str]:
        """A gang of workers that can run ``spec``'s ranks, rank 0 first (not taken: a preview);
        waits up to ``wait_s`` for enough of them (a killed worker being restarted)."""
        gangs = self.gangs(spec)
        gangs.slots(wait_s)
        gang = gangs.take(wait_s)
        gangs.give_back(gang)
        return gang

    def _train(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        outcomes: dict[str, ModelOutcome] = {}
        waiting = list(models)
        if not waiting:
            waiting = controller.new_models(1)
        if not waiting:
            return outcomes
        safe = _Serialized(controller)
        slots = self.gangs(waiting[0]).slots(WORKER_WAIT_S)
        if self.max_trials:
            slots = min(slots, self.max_trials)
        log.info("ddp: up to %d trials at once, %d ranks each", slots, self.world_size)
        notice = StopNotice(self.client, "ddp", "trial")
        in_flight: dict[Future[ModelOutcome], ModelSpec] = {}
        with ThreadPoolExecutor(max_workers=slots, thread_name_prefix="ddp-trial") as pool:
            while True:
                if not stopping.stop_requested():
                    if len(waiting) + len(in_flight) < slots:
                        waiting += safe.new_models(slots - len(waiting) - len(in_flight))
                    while waiting and len(in_flight) < slots:
                        spec = waiting.pop(0)
                        in_flight[pool.submit(self._train_one, spec, epochs, safe)] = spec
                if not in_flight:
                    break
                done, _ = wait(list(in_flight), timeout=0.5, return_when=FIRST_COMPLETED)
                if stopping.stop_requested():  # every job's ranks checkpoint at their next batch
                    notice.give(len(in_flight))
                for future in done:
                    spec = in_flight.pop(future)
                    outcome = outcomes[spec.model_id] = future.result()
                    if not (
                        stopping.stop_requested()
                        and outcome.error is None
                        and not self._finished(outcome, epochs)
                    ):
                        safe.on_model_done(outcome)
        notice.withdraw()
        stopping.raise_if_stopped()
        return outcomes

    @staticmethod
    def _finished(outcome: ModelOutcome, epochs: int) -> bool:
        return outcome.stopped_early or outcome.epochs_done >= epochs

    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        """One trial to its end: attempts on whole gangs until it finishes, is stopped, fails, or
        the run is asked to stop (it then waits in its checkpoint for the resume)."""
        outcome = ModelOutcome(spec)
        started = time.time()
        lost = notices = taken_ports = 0
        leaving: list[str] = []  # workers of a preempted attempt: they are about to go
        shunned = self.recent_suspects()  # workers whose jobs lately lost a rank
        while True:
            gangs = self.gangs(spec)
            try:
                gang = gangs.take(
                    WORKER_WAIT_S,
                    avoid=leaving,
                    prefer_not=shunned,
                    prefer_wait_s=SHUN_WAIT_S if lost else 0.0,  # a new trial takes what is free
                )
            except PlacementError as exc:
                outcome.error = f"PlacementError: {exc}"
                break
            attempt_started = time.time()
            try:
                DDPJob(self, spec, epochs, controller, outcome, gang).run()
                break
            except JobPreempted as exc:
                notices += 1
                self.record_interruption(0.0, model=spec.model_id, kind="notice", what=str(exc))
                if stopping.stop_requested():
                    break
                leaving = self._noticed(gang)
                if notices > MAX_NOTICES:
                    outcome.error = f"JobPreempted: {notices} spot notices"
                    break
                log.warning("ddp: %s: %s; going on from that batch", spec.model_id, exc)
            except MasterPortTaken as exc:  # not an interruption: the same gang, another port
                taken_ports += 1
                if taken_ports > MAX_PORT_CHOICES:
                    outcome.error = f"MasterPortTaken: {exc}"
                    break
                log.info("ddp: %s: %s; choosing another port", spec.model_id, exc)
            except RankLost as exc:
                lost += 1
                self.record_interruption(time.time() - attempt_started, model=spec.model_id, kind="rank lost")
                if lost > self.max_restarts:
                    outcome.error = f"RankLost: {exc}"
                    log.warning("ddp: %s failed: %s", spec.model_id, exc)
                    break
                blamed = shunned_after_loss(gang, exc)
                self.suspects |= dict.fromkeys(blamed, time.monotonic())
                shunned = sorted(set(blamed) | set(self.recent_suspects()))
                log.warning(
                    "ddp: %s: %s; starting again from its last checkpoint, preferably without %s",
                    spec.model_id,
                    exc,
                    ", ".join(shunned),
                )
            except Superseded:  # a later attempt drives the study: nothing more is written
                raise
            except Exception as exc:
                # the cluster's loss, not the trial's: it stays unfinished
                raise_if_cluster_lost(exc, self.client)
                outcome.error = f"{type(exc).__name__}: {exc}"
                log.warning("ddp: %s failed: %s", spec.model_id, outcome.error)
                break
            finally:
                gangs.give_back(gang)
                self.records.append(
                    {
                        "model": spec.model_id,
                        "worker": ",".join(gang),
                        "start": attempt_started,
                        "end": time.time(),
                        "epochs": len(outcome.history),
                    }
                )
        log.debug("ddp: %s done in %.1fs", spec.model_id, time.time() - started)
        return outcome

    def _noticed(self, gang: Sequence[str]) -> list[str]:
        """The gang's workers that got a spot notice (they leave once their ranks returned)."""
        from mopflow.training.volatile.preempt import notice_received

        present = cluster_workers(self.client)
        asked = [w for w in gang if w in present]  # one gone already would take a connect timeout
        try:
            told = self.client.run(notice_received, workers=asked, on_error="ignore") if asked else {}
        except Exception:  # a worker gone meanwhile
            return list(gang)
        return [w for w in gang if told.get(w, True) is not False]
