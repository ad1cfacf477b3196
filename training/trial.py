"""A trial's record and what every trainer of one shares: its pruner and quiet Lightning.

Trials train through the strategy's executor (``training/executors``) and are told to Optuna
by the coordinator (``training/executor_search.py``); a :class:`TrialResult` is what the
coordinator keeps of each.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)


PRUNERS = ("asha", "successive_halving", "hyperband", "median", "none")


def make_pruner(name: str, min_resource: int, max_resource: int | None = None) -> Any:
    """The study's pruner (it decides in the coordinator, where every epoch is reported).

    ``asha`` and ``successive_halving`` are the same: Optuna's successive halving is asynchronous
    (ASHA, Li et al. 2020): a trial is compared with those that reached the same rung, without
    waiting for a full bracket. ``max_resource`` (the epoch budget) is needed by ``hyperband``.
    """
    import optuna

    if name == "none":
        return optuna.pruners.NopPruner()
    if name in ("asha", "successive_halving"):
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)
    if name == "hyperband":
        top = max_resource if max_resource is not None else "auto"
        if isinstance(top, int) and top <= min_resource:
            # A single rung: Hyperband degenerates to successive halving at min_resource.
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)
        return optuna.pruners.HyperbandPruner(min_resource=min_resource, max_resource=top, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=max(min_resource - 1, 0))
    raise ValueError(f"unknown pruner {name!r}; expected one of {list(PRUNERS)}")


def shard_cache_dir() -> str:
    """Where a worker caches remote shards on its local disk (``MOPFLOW_SHARD_CACHE``)."""
    return os.environ.get("MOPFLOW_SHARD_CACHE") or os.path.join(tempfile.gettempdir(), "mopflow-shard-cache")


def quiet_lightning() -> None:
    """Lightning's INFO chatter (GPU available, tips) does not belong in task logs."""
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass
class TrialResult:
    """What a trial produced. ``state`` is COMPLETE, PRUNED or FAIL."""

    number: int
    trial_id: int
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
