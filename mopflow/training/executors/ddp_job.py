"""One attempt of a DDP trial: its ranks on a gang of workers, followed epoch by epoch.

Rank 0 sends each epoch's report (its checkpoint already written) on the job's report queue
and waits for the coordinator's answer on the decision queue before any rank trains on: a
stopped or pruned trial ends at the epoch the decision was made on, its state, checkpoint and
history alike. A spot notice on any rank stops every rank at the same batch
(``training/executors/ddp_rank.py``); the job then comes back with its checkpoint at that
batch (:class:`JobPreempted`) and starts again there.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from mopflow.base.ports import port_was_taken
from mopflow.training.compute.workers import cluster_workers
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, ModelOutcome, RunBookkeeping
from mopflow.training.executors.ddp_rank import GO, STOP, free_port, run_rank
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the coordinator looks for a report (and checks the ranks every CHECK_S)
CHECK_S = 0.5


class RankLost(RuntimeError):
    """A rank's worker left the cluster or its task failed: the job cannot go on.

    ``workers``: the workers known to be at fault (one that left the cluster); empty when the
    error does not tell (a rank that lost its peers names itself, the one that noticed, not the
    peer or the link that failed)."""

    def __init__(self, message: str, workers: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.workers = tuple(workers)


class MasterPortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port chosen for it: another process bound it
    between the choice and the bind. Nothing was lost; the attempt starts again on another port."""


class JobPreempted(RuntimeError):  # noqa: N818 - a notice, not an error
    """Every rank stopped at the same batch on a spot notice; the checkpoint continues there."""


@dataclass(frozen=True)
class _Ranks:
    """One attempt's ranks in flight: their futures (to rank and worker), report and decision
    queues."""

    checkpoint: str  # where rank 0 writes each epoch's checkpoint ("" without checkpoints)
    reports: Any  # distributed.Queue: rank 0's epoch reports
    decisions: Any  # distributed.Queue: the coordinator's answers, one per report
    futures: dict[Any, tuple[int, str]]


class DDPJobHost(RunBookkeeping, Protocol):
    """What one attempt needs from the executor that runs it (``DDPExecutor``): the cluster, the
    data, the collective's settings, and where it records each rank's process and traffic."""

    client: Any
    data: DataRef
    bf16_compress: bool
    epoch_timeout_s: float
    collective_timeout_s: float
    rank_pids: dict[str, list[int]]
    rank_interfaces: dict[str, list[str]]
    allreduce_bytes: dict[str, int]


class DDPJob:
    """One attempt of ``spec`` on ``gang``: from the last checkpoint to the end or a stop."""

    def __init__(
        self,
        executor: DDPJobHost,
        spec: ModelSpec,
        epochs: int,
        controller: Controller,
        outcome: ModelOutcome,
        gang: Sequence[str],
    ) -> None:
        self.executor, self.spec, self.epochs = executor, spec, epochs
        self.controller, self.outcome, self.gang = controller, outcome, list(gang)
        self.client = executor.client

    def run(self) -> None:
        """Train from the last checkpoint; raise :class:`RankLost` or :class:`JobPreempted`
        when the attempt ends early."""
        found = self.executor.load_checkpoint(self.spec.model_id)
        start_epoch = self._resume(found)
        if start_epoch is None:
            return
        ranks = self._start(start_epoch, resume=found is not None)
        try:
            self._follow(ranks)
            self._collect(ranks)
        except Exception:
            self._let_ranks_end(ranks.futures)
            for report in _drain(ranks.reports):  # epochs whose checkpoint was written: they count
                self._hear(report, ranks)
            raise
        finally:
            for future in ranks.futures:
                future.release()

    def _resume(self, found: tuple[bytes, dict[str, Any]] | None) -> int | None:
        """The epoch the job starts at: after the latest finished epoch in the checkpoint (a
        checkpoint taken mid-epoch continues that epoch). None when the checkpoint already ends
        the training (all epochs done, or the controller stops it)."""
        # epochs heard in an attempt that ended past its checkpoint are trained again: the record
        # keeps only those the checkpoint covers (none without one)
        covered = int(found[1].get("epoch", -1)) if found is not None else -1
        self.outcome.history = [r for r in self.outcome.history if r.epoch <= covered]
        if found is None:
            return 0
        start_epoch = covered + 1
        self.executor.note_resumed(self.spec.model_id, start_epoch - 1, found[0])
        log.info("ddp: %s resumes at epoch %d from its checkpoint", self.spec.model_id, start_epoch + 1)
        # a restarted coordinator (or a promoted trial): the epochs it had, told again
        outcome = self.outcome
        if not outcome.history and not self.executor.replay_history(
            outcome, start_epoch - 1, self.controller
        ):
            outcome.stopped_early = True
        if start_epoch >= self.epochs or outcome.stopped_early:
            outcome.state = found[0]
            return None
        return start_epoch

    def _start(self, start_epoch: int, resume: bool) -> _Ranks:
        """Submit the ranks, rank 0 first, each pinned to its worker of the gang."""
        from distributed import Queue

        spec, gang = self.spec, self.gang
        checkpoint = self.executor.kept_checkpoint(spec.model_id) or ""
        tag = uuid.uuid4().hex[:12]
        reports = Queue(f"ddp-{tag}", client=self.client)
        decisions = Queue(f"ddp-decide-{tag}", client=self.client)
        address, port = self.client.submit(
            free_port, workers=[gang[0]], allow_other_workers=False, pure=False
        ).result(timeout=60)
        job = self._description(start_epoch, checkpoint, resume) | {
            "queue": reports.name,
            "decisions": decisions.name,
        }
        futures = {
            self.client.submit(
                run_rank,
                job,
                rank,
                address,
                port,
                workers=[worker],
                allow_other_workers=False,
                resources=spec.device.resources() or None,
                pure=False,
                key=f"ddp-{spec.model_id}-r{rank}-{tag}",
            ): (rank, worker)
            for rank, worker in enumerate(gang)
        }
        log.info("ddp: %s starts on %d ranks (%s)", spec.model_id, len(gang), ", ".join(gang))
        return _Ranks(checkpoint, reports, decisions, futures)

    def _description(self, start_epoch: int, checkpoint: str, resume: bool) -> dict[str, Any]:
        """What every rank is told (``training/executors/ddp_rank.py``), but its queues."""
        world = len(self.gang)
        return {
            "spec": asdict(self.spec),
            "data": asdict(self.executor.data),
            "epochs": self.epochs,
            "start_epoch": start_epoch,
            "world_size": world,
            # The configuration's batch size is the global batch: each rank takes its share.
            "batch_per_rank": max(1, int(self.spec.params["batch_size"]) // world),
            "bf16_compress": self.executor.bf16_compress,
            "checkpoint_uri": checkpoint,
            "resume_uri": checkpoint if resume else "",
            "collective_timeout_s": self.executor.collective_timeout_s,
        }

    def _follow(self, ranks: _Ranks) -> None:
        """Answer rank 0's reports with the controller's decision until every rank is done;
        raise when a rank is lost or no epoch finishes within the epoch timeout."""
        last_progress = last_check = time.monotonic()
        while True:
            # qsize, then get: a get that times out as a report arrives can lose it (asyncio's
            # wait_for before Python 3.12), and rank 0 would wait for an answer that never comes
            heard = _drain(ranks.reports)
            for report in heard:
                self._hear(report, ranks)
            now = time.monotonic()
            if heard:
                last_progress = now
            done = {f for f in ranks.futures if f.done()}
            if len(done) == len(ranks.futures):
                # ranks that failed together (a cut link times out both at once) are judged here
                # too: a lost peer restarts the job, never fails the trial as its own error would
                self._check_ranks(ranks.futures, done)
                return
            if done or now - last_check >= CHECK_S:
                self._check_ranks(ranks.futures, done)
                last_check = now
            if now - last_progress > self.executor.epoch_timeout_s:
                raise TimeoutError(f"no epoch finished within {self.executor.epoch_timeout_s:.0f}s")
            if not heard:
                time.sleep(POLL_S)

    def _collect(self, ranks: _Ranks) -> None:
        """The ranks' results: their processes, the bytes they all-reduced, the last reports and
        rank 0's final state; :class:`JobPreempted` when they stopped on a notice."""
        results = sorted((f.result() for f in ranks.futures), key=lambda r: r["rank"])
        executor, model_id = self.executor, self.spec.model_id
        executor.rank_pids[model_id] = [int(r["pid"]) for r in results]
        executor.rank_interfaces[model_id] = [str(r.get("interface", "")) for r in results]
        executor.allreduce_bytes[model_id] = executor.allreduce_bytes.get(model_id, 0) + int(
            sum(r["allreduce_bytes"] for r in results)
        )
        for report in _drain(ranks.reports):  # sent before the ranks returned
            self._hear(report, ranks)
        if results[0].get("preempted"):
            raise JobPreempted(
                f"ranks stopped at batch {results[0]['preempted']} of epoch {results[0]['epoch'] + 1}"
            )
        if results[0]["state"] is not None:
            self.outcome.state = results[0]["state"]
            self.outcome.checkpoint_uri = ranks.checkpoint or None

    def _hear(self, report: EpochReport, ranks: _Ranks) -> None:
        """Record rank 0's report of an epoch (kept beside the checkpoint), ask the controller
        and answer rank 0, which waits for it before any rank trains on."""
        outcome = self.outcome
        keep = False
        if not outcome.stopped_early:
            keep = self.executor.report_epoch(outcome, report, self.controller)
            log.info(
                "ddp: %s epoch %d/%d val_acc=%.4f",
                report.model_id,
                report.epoch + 1,
                self.epochs,
                report.val_acc,
            )
            outcome.stopped_early = not keep
        ranks.decisions.put(GO if keep else STOP)

    def _check_ranks(self, futures: dict[Any, tuple[int, str]], done: set[Any]) -> None:
        """Raise RankLost when a rank's worker left the cluster or a peer went away mid-collective,
        or a failed rank's own error (e.g. a non-finite loss: the trial fails, not started again)."""
        alive = set(cluster_workers(self.client))
        for future, (rank, worker) in futures.items():
            # a rank that returned before its worker left is not lost: a worker leaving on a spot
            # notice hands its results to another worker first (only a lost result counts)
            if worker not in alive and future.status != "finished":
                raise RankLost(f"rank {rank}'s worker {worker} left the cluster", workers=[worker])
            if future in done and future.status == "error":
                error = future.exception()
                if rank == 0 and port_was_taken(error):
                    raise MasterPortTaken(f"rank 0 on {worker}: {error}")
                if _is_communication_error(error):
                    raise RankLost(f"rank {rank} on {worker} lost its peers: {error!r}")
                raise error

    def _let_ranks_end(self, futures: dict[Any, tuple[int, str]]) -> None:
        """Wait, at most the collective timeout, until the other ranks gave up (they fail their
        next collective): only then are their workers free for the next attempt."""
        from distributed import wait

        alive = set(cluster_workers(self.client))
        waiting = []
        for future, (_, worker) in futures.items():
            if worker in alive:
                waiting.append(future)
            else:
                future.cancel()  # pinned to a worker that is gone: it would wait forever
        timeout = self.executor.collective_timeout_s + 30
        try:
            wait(waiting, timeout=timeout)
        except TimeoutError:
            log.warning("ddp: ranks still running %.0fs after their job failed", timeout)


def _report(raw: str) -> EpochReport:
    r = json.loads(raw)
    return EpochReport(
        str(r.get("model_id", "")),
        int(r["epoch"]),
        float(r["val_acc"]),
        float(r["train_loss"]),
        float(r["lr"]) if r.get("lr") is not None else None,
    )


def _drain(queue: Any) -> list[EpochReport]:
    """The reports rank 0 sent that were not read yet."""
    reports = []
    while queue.qsize():
        reports.append(_report(queue.get(timeout=5)))
    return reports


def _is_communication_error(error: BaseException | None) -> bool:
    """Whether a rank failed because a peer went away (gloo/nccl), not for a reason of its own."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(n in text for n in ("connection", "gloo", "nccl", "timed out", "timeout", "peer", "socket"))
