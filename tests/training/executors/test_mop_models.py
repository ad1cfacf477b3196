"""A MOP run's models: when a model's state is checkpointed between its units."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from mopflow.base import stopping
from mopflow.training.executors.mop_models import MopModels


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
