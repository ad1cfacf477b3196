"""Execution strategies for training many models: sequential, task, ddp, mop."""

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
