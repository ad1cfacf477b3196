"""Task parallelism on Dask: each model trains on one worker over all the data.

A model's epochs between two decision points of the controller (ASHA's rungs; the end, without a
pruner) train as one Dask task on one worker (``training/executors/task_run.py``): no round trip,
no state packed and unpacked, between them. The coordinator hears a chain's first epoch and a
decision's as they end, the others every ``hear_every_s`` seconds (``training/executors/chains.py``).

Volatile workers: a chain whose worker got a spot notice comes back as ``UnitPreempted`` with
its state at the last batch boundary and is submitted again from there; one whose worker died
(SIGKILL) is run again from the chain's start by Dask. ``redone_unit_seconds`` sums the work
lost (the scheduler's record of the spans that never finished, less what a notice saved).

In batches (``batches=True``, the search's ``trial_batches``) the run does not depend on which
epoch finishes first: new models start only once every model of the previous batch is done, and
a batch trains in step, an epoch per task, each model's epoch result held until every model of
the batch has one, then handed to the controller in the order the models started, before their
next epochs are submitted. The controller (its sampler and pruner) so sees the same reports in
the same order whatever the timings."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from mopflow.base import stopping
from mopflow.training.compute.workers import cluster_workers
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, Executor, ModelOutcome
from mopflow.training.executors.chains import HEAR_EVERY_S
from mopflow.training.executors.stop_notice import StopNotice
from mopflow.training.executors.task_host import Admission
from mopflow.training.executors.task_listen import listen, stop_listening
from mopflow.training.executors.task_run import TaskRun
from mopflow.training.trainable.unit import ModelSpec

log = logging.getLogger(__name__)


class TaskExecutor(Executor):
    """Task parallelism: each model trains its epochs up to the controller's next decision per
    Dask task over all training shards, one model per worker at a time; the ``task`` strategy of
    the search.

    At most ``slots`` models (default: the workers present) are active at once, or as many as
    ``admission`` allows (worker rounds). A freed slot goes to the controller's next model at
    once, or, in ``batches``, once every active model is done (see the module docstring). An
    epoch that no decision of the controller waits for (a chain's first aside) is heard at most
    ``hear_every_s`` seconds after it ends (0: each as it ends), its state made the checkpoint
    then. Every
    worker that trains loads the full training set once (its storage footprint is the data times
    the number of workers), the cost MOP avoids.
    """

    name = "task"
    stops_on_its_own = True  # a stop lets the epochs in flight checkpoint first

    def __init__(
        self,
        client: Any,
        data: DataRef,
        shard_names: Sequence[str],
        checkpoint_root: str = "",
        slots: int | None = None,
        admission: Admission | None = None,
        batches: bool = False,
        hear_every_s: float | None = None,
    ) -> None:
        super().__init__(data, checkpoint_root)
        self.hear_every_s = HEAR_EVERY_S if hear_every_s is None else hear_every_s
        self.client = client
        self.shards = sorted(shard_names)
        self.slots = slots or len(cluster_workers(client)) or 1
        self.admission = admission
        self.batches = batches
        self.started_at: dict[str, float] = {}

    def may_start(self, active: int) -> bool:
        """Whether another model may start while ``active`` models train."""
        if self.admission is not None:
            return self.admission.may_start(active)
        return active < self.slots

    def _train(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        run = TaskRun(self, epochs, controller, waiting=list(models), run_id=uuid.uuid4().hex)
        notice = StopNotice(self.client, "task", "epoch")  # asked to stop: epochs in flight checkpoint
        try:
            listen(self.client, run)  # its epochs, heard as they end
            run.admit()
            while run.in_flight or run.deferred:
                done = run.next_done(timeout=0.5)
                if stopping.stop_requested():  # the chains in flight checkpoint at their next batch
                    notice.give(len(run.in_flight))
                for future in done:
                    run.collect(future)
                if stopping.stop_requested():
                    run.deferred.clear()  # they wait in their checkpoints for the resume
                run.release()
                if not stopping.stop_requested():
                    run.submit_deferred()
                    run.admit()
        finally:
            stop_listening(run)
        notice.withdraw()
        stopping.raise_if_stopped()
        for mid, outcome in run.outcomes.items():
            outcome.state = run.states.get(mid, outcome.state)
            outcome.checkpoint_uri = self.kept_checkpoint(mid)
        return run.outcomes

    def account(self, mid: str, epoch: int, worker: str, kind: str, redone: float) -> None:
        """Record work lost with an interrupted epoch (a notice or a killed worker)."""
        self.record_interruption(redone, model=mid, epoch=epoch, worker=worker, kind=kind)
        log.warning(
            "task: %s epoch %d interrupted (%s%s): %.2f unit-seconds to redo, %.2f in all",
            mid,
            epoch + 1,
            kind,
            f" on {worker}" if worker else "",
            redone,
            self.redone_unit_seconds,
        )
