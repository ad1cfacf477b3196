"""The sequential baseline: models one after another in this process, each epoch over all shards
in order. What the strategies' learning curves are compared against (``benchmarks/strategies.py``);
not a strategy of the search."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Controller, EpochReport, Executor, ModelOutcome
from mopflow.training.executors.units import evaluate_state, init_state, train_pass
from mopflow.training.trainable.unit import ModelSpec


class OneModelAtATime(Executor):
    """An executor that trains models one after another (each finished model frees the one slot
    for the controller's next)."""

    def _train(
        self, models: Sequence[ModelSpec], epochs: int, controller: Controller
    ) -> dict[str, ModelOutcome]:
        outcomes: dict[str, ModelOutcome] = {}
        queue = list(models)
        while queue:
            spec = queue.pop(0)
            outcome = outcomes[spec.model_id] = self._train_one(spec, epochs, controller)
            controller.on_model_done(outcome)
            queue += controller.new_models(1)
        return outcomes

    @abstractmethod
    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        """Train one model for up to ``epochs`` epochs."""


class SequentialExecutor(OneModelAtATime):
    """The baseline: models one after another in this process, each epoch over all shards in order."""

    name = "sequential"

    def __init__(self, data: DataRef, shard_names: Sequence[str], checkpoint_root: str = "") -> None:
        super().__init__(data, checkpoint_root)
        self.shards = sorted(shard_names)

    def _train_one(self, spec: ModelSpec, epochs: int, controller: Controller) -> ModelOutcome:
        outcome = ModelOutcome(spec)
        state = init_state(spec, self.data)
        for epoch in range(epochs):
            state, record = train_pass(spec, state, self.data, self.shards, epoch, epochs, 0)
            self.records.append(record)
            report = EpochReport(
                spec.model_id, epoch, evaluate_state(spec, state, self.data), record["train_loss"]
            )
            outcome.history.append(report)
            if not controller.on_epoch_end(report):
                outcome.stopped_early = True
                break
        outcome.state = state
        self.save_checkpoint(spec.model_id, state)
        return outcome
