"""Data parallelism inside one model: Lightning DDP over W ranks on W Dask workers.

Each configuration is one job of W tasks (``training/executors/ddp_rank.py``), one per worker
that holds the resources the trial needs (``GPU``, or a CPU slot), in their own process group
with the rendezvous at rank 0's worker: a trial spans worker processes, and hosts. The caller
sees each epoch's report as rank 0 sends it and can stop the job between epochs. A rank whose
worker dies fails the job within the collective timeout; the job is then started again from
its last epoch checkpoint (weights, optimizer moments and schedule position), once per lost rank
up to ``max_restarts``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, ModelOutcome, OneModelAtATime
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)

POLL_S = 0.5
WORKER_WAIT_S = 120.0  # how long a job waits for enough workers for its ranks


class RankLost(RuntimeError):
    """A rank's worker left the cluster or its task failed: the job cannot go on."""


@dataclass(frozen=True)
class _Job:
    """One attempt's ranks in flight: their futures (to rank and worker), report queue and stop event."""

    model_id: str
    checkpoint: str  # where rank 0 writes each epoch's checkpoint ("" without checkpoints)
    queue: Any  # distributed.Queue: rank 0's epoch reports
    stop: Any  # distributed.Event: the coordinator's stop decision
    futures: dict[Any, tuple[int, str]]


class DDPExecutor(OneModelAtATime):
    """Models one after another, each trained by W DDP ranks on W Dask workers."""

    name = "ddp"

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
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.client = client
        self.world_size = world_size
        self.bf16_compress = bf16_compress
        self.epoch_timeout_s = epoch_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.max_restarts = max_restarts
        self.rank_pids: dict[str, list[int]] = {}  # model -> the process of each rank (last attempt)
        self.allreduce_bytes: dict[str, int] = {}  # model -> gradient bytes its ranks all-reduced

    def rank_workers(self, spec: ModelSpec, wait_s: float = WORKER_WAIT_S) -> list[str]:
        """W distinct workers that can run a rank of ``spec`` (with its resources), rank 0 first;
        waits up to ``wait_s`` for enough of them (a killed worker being restarted)."""
        needed = spec.device.resources()
        deadline = time.monotonic() + wait_s
        while True:
            info = self.client.scheduler_info()["workers"]
            fit = sorted(
                address
                for address, worker in info.items()
                if all(float((worker.get("resources") or {}).get(k, 0)) >= v for k, v in needed.items())
            )
            if len(fit) >= self.world_size or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if len(fit) < self.world_size:
            what = f" with resources {needed}" if needed else ""
            raise RuntimeError(
                f"ddp_world_size={self.world_size} needs {self.world_size} Dask workers{what}; "
                f"the cluster has {len(fit)}"
            )
        return fit[: self.world_size]

    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        outcome = ModelOutcome(spec)
        started = time.time()
        for attempt in range(self.max_restarts + 1):
            try:
                self._run_job(spec, epochs, controller, outcome)
                break
            except RankLost as exc:
                self.record_interruption(0.0, model=spec.model_id, kind="rank lost")
                if attempt == self.max_restarts:
                    outcome.error = f"RankLost: {exc}"
                    log.warning("ddp: %s failed: %s", spec.model_id, exc)
                else:
                    log.warning("ddp: %s: %s; starting again from its last checkpoint", spec.model_id, exc)
            except Exception as exc:
                outcome.error = f"{type(exc).__name__}: {exc}"
                log.warning("ddp: %s failed: %s", spec.model_id, outcome.error)
                break
        self.records.append(
            {
                "model": spec.model_id,
                "worker": f"ddp x{self.world_size}",
                "start": started,
                "end": time.time(),
                "epochs": len(outcome.history),
            }
        )
        return outcome

    def _run_job(self, spec: ModelSpec, epochs: int, controller: Controller, outcome: ModelOutcome) -> None:
        """One attempt: the ranks from the last checkpoint to the end (or a stop)."""
        found = self.load_checkpoint(spec.model_id)
        start_epoch = self._resume(spec, epochs, controller, outcome, found)
        if start_epoch is None:
            return
        job = self._start_job(spec, epochs, start_epoch, resume=found is not None)
        try:
            self._follow(job, epochs, controller, outcome)
            self._collect(job, epochs, controller, outcome)
        except Exception:
            self._let_ranks_end(job.futures)
            for report in self._drain(job.queue):  # epochs whose checkpoint was written: they count
                self._hear(report, epochs, controller, outcome)
            raise
        finally:
            for future in job.futures:
                future.release()

    def _resume(
        self,
        spec: ModelSpec,
        epochs: int,
        controller: Controller,
        outcome: ModelOutcome,
        found: tuple[bytes, dict[str, Any]] | None,
    ) -> int | None:
        """The epoch the job starts at: after the latest epoch checkpoint, if any. None when the
        checkpoint already ends the training (all epochs done, or the controller stops it)."""
        if found is None:
            return 0
        start_epoch = int(found[1].get("epoch", -1)) + 1
        log.info("ddp: %s resumes at epoch %d from its checkpoint", spec.model_id, start_epoch + 1)
        # a restarted coordinator: the epochs it had, told again
        if not outcome.history and not self.replay_history(outcome, start_epoch - 1, controller):
            outcome.stopped_early = True
        if start_epoch >= epochs or outcome.stopped_early:
            outcome.state = found[0]
            return None
        return start_epoch

    def _start_job(self, spec: ModelSpec, epochs: int, start_epoch: int, resume: bool) -> _Job:
        """Submit the W ranks, rank 0 first, each pinned to its worker, with their own report
        queue and stop event."""
        from distributed import Event, Queue

        from mopflow.training.executors.ddp_rank import free_port, run_rank

        checkpoint = self.kept_checkpoint(spec.model_id) or ""
        workers = self.rank_workers(spec)
        tag = uuid.uuid4().hex[:12]
        queue, stop = Queue(f"ddp-{tag}", client=self.client), Event(f"ddp-stop-{tag}", client=self.client)
        address, port = self.client.submit(
            free_port, workers=[workers[0]], allow_other_workers=False, pure=False
        ).result(timeout=60)
        job = self._job_description(spec, epochs, start_epoch, checkpoint, resume)
        job |= {"queue": queue.name, "stop_event": stop.name}
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
            for rank, worker in enumerate(workers)
        }
        log.info("ddp: %s starts on %d ranks (%s)", spec.model_id, self.world_size, ", ".join(workers))
        return _Job(spec.model_id, checkpoint, queue, stop, futures)

    def _job_description(
        self, spec: ModelSpec, epochs: int, start_epoch: int, checkpoint: str, resume: bool
    ) -> dict[str, Any]:
        """What every rank is told (``training/executors/ddp_rank.py``), but its queue and event."""
        return {
            "spec": asdict(spec),
            "data": asdict(self.data),
            "epochs": epochs,
            "start_epoch": start_epoch,
            "world_size": self.world_size,
            # The configuration's batch size is the global batch: each rank takes its share.
            "batch_per_rank": max(1, int(spec.params["batch_size"]) // self.world_size),
            "bf16_compress": self.bf16_compress,
            "checkpoint_uri": checkpoint,
            "resume_uri": checkpoint if resume else "",
            "collective_timeout_s": self.collective_timeout_s,
        }

    def _follow(self, job: _Job, epochs: int, controller: Controller, outcome: ModelOutcome) -> None:
        """Pass rank 0's reports to the controller (its stop to the ranks) until every rank is
        done; raise when a rank is lost or no epoch finishes within ``epoch_timeout_s``."""
        from distributed import wait

        last_progress = time.monotonic()
        while True:
            for report in self._drain(job.queue):
                last_progress = time.monotonic()
                if not self._hear(report, epochs, controller, outcome):
                    job.stop.set()
            with contextlib.suppress(TimeoutError):  # not all done yet: poll again
                wait(list(job.futures), timeout=POLL_S)
            done = {f for f in job.futures if f.done()}
            if len(done) == len(job.futures):
                return
            self._check_ranks(job.futures, done)
            if time.monotonic() - last_progress > self.epoch_timeout_s:
                raise TimeoutError(f"no epoch finished within {self.epoch_timeout_s:.0f}s")

    def _collect(self, job: _Job, epochs: int, controller: Controller, outcome: ModelOutcome) -> None:
        """The ranks' results: their processes, the bytes they all-reduced, the last reports and
        rank 0's final state."""
        results = [f.result() for f in job.futures]
        self.rank_pids[job.model_id] = [int(r["pid"]) for r in sorted(results, key=lambda r: r["rank"])]
        self.allreduce_bytes[job.model_id] = int(sum(r["allreduce_bytes"] for r in results))
        for report in self._drain(job.queue):  # sent before the ranks returned
            self._hear(report, epochs, controller, outcome)
        state = next(r["state"] for r in results if r["rank"] == 0)
        if state is not None:
            outcome.state = state
            outcome.checkpoint_uri = job.checkpoint or None

    def _hear(self, report: EpochReport, epochs: int, controller: Controller, outcome: ModelOutcome) -> bool:
        """Record rank 0's report of an epoch (kept beside the checkpoint) and pass it to the
        controller; False once the model is to stop. Reports of epochs trained before the ranks
        saw a stop are dropped: the model stopped at the epoch of the decision."""
        if outcome.stopped_early:
            return False
        keep = self.report_epoch(outcome, report, controller)
        log.info(
            "ddp: %s epoch %d/%d val_acc=%.4f", report.model_id, report.epoch + 1, epochs, report.val_acc
        )
        outcome.stopped_early = not keep
        return keep

    def _check_ranks(self, futures: dict[Any, tuple[int, str]], done: set[Any]) -> None:
        """Raise RankLost when a rank's worker left the cluster or a peer went away mid-collective,
        or a failed rank's own error (e.g. a non-finite loss: the trial fails, not started again)."""
        alive = set(self.client.scheduler_info()["workers"])
        for future, (rank, worker) in futures.items():
            if worker not in alive:
                raise RankLost(f"rank {rank}'s worker {worker} left the cluster")
            if future in done and future.status == "error":
                error = future.exception()
                if _is_communication_error(error):
                    raise RankLost(f"rank {rank} on {worker} lost its peers: {error!r}")
                raise error

    def _let_ranks_end(self, futures: dict[Any, tuple[int, str]]) -> None:
        """Wait, at most the collective timeout, until the other ranks gave up (they fail their
        next collective): only then are their workers free for the next attempt."""
        from distributed import wait

        alive = set(self.client.scheduler_info()["workers"])
        waiting = []
        for future, (_, worker) in futures.items():
            if worker in alive:
                waiting.append(future)
            else:
                future.cancel()  # pinned to a worker that is gone: it would wait forever
        try:
            wait(waiting, timeout=self.collective_timeout_s + 30)
        except TimeoutError:
            log.warning(
                "ddp: ranks still running %.0fs after their job failed", self.collective_timeout_s + 30
            )

    @staticmethod
    def _drain(queue: Any) -> list[EpochReport]:
        """The reports rank 0 sent since the last call."""
        reports = []
        while queue.qsize():
            r = json.loads(queue.get(timeout=5))
            reports.append(
                EpochReport(
                    str(r.get("model_id", "")),
                    int(r["epoch"]),
                    float(r["val_acc"]),
                    float(r["train_loss"]),
                    float(r["lr"]) if r.get("lr") is not None else None,
                )
            )
        return reports


def _is_communication_error(error: BaseException | None) -> bool:
    """Whether a rank failed because a peer went away (gloo/nccl), not for a reason of its own."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(n in text for n in ("connection", "gloo", "nccl", "timed out", "timeout", "peer", "socket"))
