"""Execution strategies for training many models: sequential, task, ddp, mop, and the model
averaging baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from mopflow.training.trainable.unit import ModelSpec

if TYPE_CHECKING:
    from mopflow.training.executors.averaging import ModelAveragingExecutor

__all__ = [
    "Controller",
    "DataRef",
    "EpochReport",
    "Executor",
    "ModelAveragingExecutor",
    "ModelOutcome",
    "ModelSpec",
    "TrainAll",
]


def __getattr__(name: str) -> Any:
    """The executors on first use: they bring in Dask's client, which the types above do not need."""
    if name == "ModelAveragingExecutor":
        from mopflow.training.executors.averaging import ModelAveragingExecutor

        return ModelAveragingExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
