"""What a ``task`` run (``training/executors/task_run.py``) does with a chain its worker lost:
a spot notice hands back the chain's state at its batch, and the chain goes on from there on
another worker; a killed worker's attempts are accounted as work to redo."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from mopflow.base import stopping
from mopflow.training.executors.task_host import TaskHost
from mopflow.training.trainable.state import global_step
from mopflow.training.volatile.preempt import UnitPreempted, lost_spans, redone_seconds, task_story

log = logging.getLogger(__name__)


class RunLosingChains(Protocol):
    """What of a task run (``task_run.TaskRun``) a lost chain touches."""

    executor: TaskHost
    states: dict[str, bytes]
    next_epoch: dict[str, int]
    stop_after: dict[str, int]
    leaving: set[str]

    def take_epoch(self, mid: str, record: dict[str, Any], staged: bool = True) -> None: ...

    def end_stopped(self, mid: str) -> None: ...

    def submit(self, mid: str) -> None: ...


def account_killed(run: RunLosingChains, mid: str, epoch: int, future: Any) -> bool:
    """Record the work of attempts of this chain lost with a killed worker (from the
    scheduler's story of its task); whether there were any."""
    lost = redone_seconds(lost_spans(task_story(run.executor.client, str(future.key))))
    if lost > 0:
        run.executor.account(mid, epoch, "", "killed", lost)
    return lost > 0


def take_preempted(run: RunLosingChains, mid: str, first_epoch: int, exc: UnitPreempted) -> None:
    """A chain stopped by a spot notice: the epochs it finished go to the controller, the state
    at its batch is checkpointed, and it goes on from that batch on another worker (or waits
    in its checkpoint when the run stops)."""
    finished = list(exc.record.get("epochs", []))
    epoch = int(finished[-1]["epoch"]) + 1 if finished else first_epoch  # the one it stopped in
    for record in finished:  # each with its staged state, before the state at the batch
        run.take_epoch(mid, record)
    if mid in run.stop_after:  # its checkpoint ends where the controller stopped it
        run.end_stopped(mid)
        return
    if exc.state is not None:
        run.states[mid] = exc.state
        run.executor.save_checkpoint(mid, exc.state)
        run.next_epoch[mid] = epoch
        run.executor.resumed[mid] = {
            "epoch": epoch - 1,
            "step": global_step(exc.state),
            "after_notice": True,
        }
    if stopping.stop_requested():  # the run stops: the model waits in its checkpoint
        log.info("task: %s saved at batch %d of epoch %d", mid, int(exc.record.get("batches", 0)), epoch + 1)
        return
    worker = str(exc.record.get("worker", ""))
    run.leaving.add(worker)  # forgotten once it has left (a restarted one has a new address)
    run.executor.account(
        mid,
        epoch,
        worker,
        "notice",
        max(0.0, float(exc.record["end"]) - float(exc.record["saved_at"])),
    )
    run.submit(mid)
