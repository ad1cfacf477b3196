"""A trial's record.

Trials train through the strategy's executor (``training/executors``) and are told to Optuna
by the coordinator (``training/search/sweep.py``); a :class:`TrialResult` is what the
coordinator keeps of each.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class TrialResult:
    """What a trial produced. ``state`` is COMPLETE, PRUNED or FAIL."""

    number: int
    params: dict[str, Any]
    state: str
    value: float | None
    history: list[dict[str, float]]
    bundle_uri: str | None
    pruned_epoch: int | None = None
    error: str | None = None
    duration_s: float = 0.0
    worker: str = ""
    num_params: int = 0
    resumed_from_epoch: int | None = None  # the epoch a retried trial resumed after
    resumed_from_step: int | None = None  # the optimizer step it resumed at (mid-epoch after a notice)
    resumed_after_notice_at_step: int | None = None  # set when it went on from a spot notice's state
    redone_s: float = 0.0  # work lost with preempted/killed workers and done again (set by the coordinator)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
