"""Execution strategies the search trains its models with: task, ddp and mop (``mopflow.training.executors.task``,
``.ddp``, ``.mop``), and the types they share. The benchmarks' baselines (sequential, model
averaging) live in ``benchmarks/baselines/``."""

from __future__ import annotations

from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, Executor, ModelOutcome, TrainAll
from mopflow.training.trainable.unit import ModelSpec

__all__ = [
    "Controller",
    "DataRef",
    "EpochReport",
    "Executor",
    "ModelOutcome",
    "ModelSpec",
    "TrainAll",
]
