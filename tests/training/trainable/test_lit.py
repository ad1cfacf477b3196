from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.trainable.lit import Classifier, quiet_trainer_kwargs

ARCH = ArchSpec("mlp", {"width": 16, "depth": 1}, 8, 3)
ROWS, BATCH, EPOCHS = 96, 16, 2
STEPS = EPOCHS * ROWS // BATCH


class StepWatch(pl.Callback):
    """Records, per batch, whether the module took the fast path."""

    def __init__(self) -> None:
        self.fast: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.fast.append(pl_module._fast is not None)


class OptimizerStepHook(StepWatch):
    """A callback that uses a step hook: Lightning's path must run it every step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.calls += 1


def _fit(callback: StepWatch) -> tuple[Classifier, pl.Trainer]:
    torch.manual_seed(0)
    x, y = torch.randn(ROWS, ARCH.input_dim), torch.randint(0, ARCH.num_classes, (ROWS,))
    torch.manual_seed(1)
    module = Classifier(build_model(ARCH), lr=0.01, weight_decay=1e-4)
    loader = DataLoader(
        TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    trainer = pl.Trainer(max_epochs=EPOCHS, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(module, loader)
    return module, trainer


def test_fast_path_counts_steps_and_trains_exactly_like_lightnings_path() -> None:
    fast_watch, hooked = StepWatch(), OptimizerStepHook()
    fast, fast_trainer = _fit(fast_watch)
    slow, slow_trainer = _fit(hooked)
    assert fast_watch.fast == [True] * STEPS
    assert hooked.fast == [False] * STEPS  # a step hook in use: Lightning's path, hook run every step
    assert hooked.calls == STEPS
    assert fast_trainer.global_step == slow_trainer.global_step == STEPS
    for a, b in zip(fast.state_dict().values(), slow.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fast.last_train_loss == slow.last_train_loss
    assert fast._fast is None  # cleared at the end of the fit


def test_callback_factories_are_looked_up_once_and_called_for_every_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The entry-point scan runs once per process; each Trainer still gets its own callbacks."""
    from pytorch_lightning.trainer.connectors import callback_connector

    from mopflow.training.trainable import lit

    class Marker(pl.Callback):
        pass

    class Entry:
        name = "marker"

        def load(self) -> object:
            return lambda: [Marker()]

    scans: list[str] = []

    def entry_points(group: str) -> list[Entry]:
        scans.append(group)
        return [Entry()]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    monkeypatch.setattr(lit, "_factory_lookup", [])
    monkeypatch.setattr(
        callback_connector, "_load_external_callbacks", callback_connector._load_external_callbacks
    )
    lit.cache_callback_factories()
    lit.cache_callback_factories()
    first = pl.Trainer(max_epochs=1, **quiet_trainer_kwargs())
    second = pl.Trainer(max_epochs=1, **quiet_trainer_kwargs())
    assert scans == [lit.CALLBACK_FACTORY_GROUP]
    mine = [[c for c in t.callbacks if isinstance(c, Marker)] for t in (first, second)]
    assert len(mine[0]) == len(mine[1]) == 1 and mine[0][0] is not mine[1][0]


def test_batch_runs_group_a_pass_and_keep_its_order() -> None:
    from mopflow.training.trainable.lit import BatchRun, BatchRuns

    runs = BatchRuns(list(range(10)), 4)
    assert len(runs) == 3
    assert list(runs) == [BatchRun((0, 1, 2, 3)), BatchRun((4, 5, 6, 7)), BatchRun((8, 9))]
    assert len(BatchRuns([], 4)) == 0 and list(BatchRuns([], 4)) == []
    with pytest.raises(ValueError, match="length=0"):
        BatchRuns([1], 0)
