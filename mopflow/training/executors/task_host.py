"""What a task run asks of the executor that starts it: the seam between ``TaskExecutor`` (the
interface the search calls) and ``TaskRun`` (one run's bookkeeping)."""

from __future__ import annotations

from typing import Any, Protocol

from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import RunBookkeeping


class Admission(Protocol):
    """Who decides when another model may start (``training/search/scaling.py``'s rounds of n_j)."""

    def may_start(self, in_flight: int) -> bool: ...

    def started(self) -> None: ...


class TaskHost(RunBookkeeping, Protocol):
    """The executor as one task run sees it: the cluster, the data and its shards, who may start,
    and where each unit's record, start time, resumption and lost work are written."""

    client: Any
    data: DataRef
    shards: list[str]
    batches: bool
    checkpoint_root: str  # "": nothing is staged or checkpointed
    hear_every_s: float  # how often a chain's epochs that no decision waits for are heard
    admission: Admission | None
    records: list[dict[str, Any]]
    started_at: dict[str, float]
    resumed: dict[str, dict[str, Any]]

    def may_start(self, active: int) -> bool: ...

    def account(self, mid: str, epoch: int, worker: str, kind: str, redone: float) -> None: ...
