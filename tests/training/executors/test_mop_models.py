"""A MOP run's models: when a model's state is checkpointed between its units."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from mopflow.base import stopping
from mopflow.training.executors.base import TrainAll
from mopflow.training.executors.mop_models import MopModels
from mopflow.training.trainable.unit import ModelSpec

MLP = {"family": "mlp", "width": 16, "depth": 1, "lr": 3e-3, "weight_decay": 0.0, "batch_size": 32}


@pytest.fixture
def run() -> Iterator[MopModels]:
    """A run over two partitions whose model ``m0`` has visited one of them in its epoch."""
    host: Any = SimpleNamespace(partitions={"p0": ["s0"], "p1": ["s1"]})
    models = MopModels(host, epochs=3, controller=None)  # type: ignore[arg-type]
    models.visited["m0"] = ["p0"]
    models.checkpointed["m0"] = time.monotonic()
    yield models
    stopping.reset()


def test_a_mid_epoch_state_is_checkpointed_only_once_the_last_checkpoint_is_old(run: MopModels) -> None:
    """Expected: after a unit inside its epoch, a model is checkpointed only when its last
    checkpoint is ``every_s`` old; the clock then starts again."""
    assert not run.checkpoint_due("m0", every_s=10.0)
    run.checkpointed["m0"] -= 11.0
    assert run.checkpoint_due("m0", every_s=10.0)
    assert not run.checkpoint_due("m0", every_s=10.0)  # checkpointed just now


def test_an_epochs_end_and_a_stop_are_always_checkpointed(run: MopModels) -> None:
    """Expected: the unit that ends the model's epoch is checkpointed however recent the last
    checkpoint, and so is every unit once the run is asked to stop."""
    run.visited["m0"] = ["p0", "p1"]
    assert run.checkpoint_due("m0", every_s=10.0)
    run.visited["m0"] = ["p1"]
    stopping.request_stop(signal.SIGTERM)
    assert run.checkpoint_due("m0", every_s=10.0)


class Successors(TrainAll):
    """Hands out new models ``n0``, ``n1``, ... as asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        self.asked.append(free_slots)
        start = sum(self.asked[:-1])
        return [ModelSpec(f"n{i}", MLP, seed=i) for i in range(start, start + free_slots)]


@pytest.mark.parametrize("ask_ahead", [True, False])
def test_a_round_asks_ahead_only_for_the_slots_of_models_in_their_last_epoch(ask_ahead: bool) -> None:
    """Expected: of two active models in 3-epoch runs, the one starting its last epoch is finishing;
    with ``ask_ahead`` its successor is asked in that round once the last round's models are told,
    once (a second start asks no more), and the next round's models are the one going on and the
    successor."""
    host: Any = SimpleNamespace(partitions={"p0": ["s0"], "p1": ["s1"]}, slots=2)
    controller = Successors()
    models = MopModels(host, epochs=3, controller=controller, asks_ahead=ask_ahead)
    models.active = {"m0": ModelSpec("m0", MLP, seed=0), "m1": ModelSpec("m1", MLP, seed=1)}
    models.next_epoch = {"m0": 2, "m1": 0}
    models.told_later = [object()]  # type: ignore[list-item]  # a model of the last round not told yet
    models.start_round(1)
    models.ask_ahead()
    assert not models.joining  # asked only once the last round's models are told
    models.told_later = []
    models.ask_ahead()
    models.start_round(1)
    models.ask_ahead()
    assert models.finishing == {"m0"}
    assert list(models.joining) == (["n0"] if ask_ahead else [])
    assert controller.asked == ([1] if ask_ahead else [])
    assert models.next_round() == (["m1", "n0"] if ask_ahead else ["m1"])
    assert models.spec_of("m1").model_id == "m1"
