"""The plain loop trains a pass exactly as a Lightning Trainer does, on every path a unit takes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mopflow.training.data import load_manifest
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.units import load_partition
from mopflow.training.trainable.lit import NonFiniteLossError
from mopflow.training.trainable.schedule import steps_per_epoch
from mopflow.training.trainable.unit import ModelSpec, PassInterrupted, TrainableUnit
from tests.training.trainable.test_unit import CNN, _assert_same_state

EPOCHS = 2


def _unit(manifest_uri: str, **loss: float) -> tuple[TrainableUnit, Any, Any]:
    data = DataRef.open(manifest_uri)
    manifest = load_manifest(manifest_uri)
    x, y = load_partition(data, [e["name"] for e in manifest["splits"]["train"]])
    total = EPOCHS * steps_per_epoch([len(x)], 32)  # CNN's batch size
    return TrainableUnit.build(ModelSpec("m", CNN, seed=3), manifest, total, **loss), x, y


def _fitted(unit: TrainableUnit, rows: Any, epoch: int, **kwargs: Any) -> Any:
    """The same pass fitted by a Trainer: a callback that uses no hook asks for one."""
    import pytorch_lightning as pl

    return unit.train_pass(rows, epoch, callbacks=[pl.Callback()], **kwargs)


def test_plain_passes_match_trainer_fits_bit_for_bit(small_manifest: str) -> None:
    """Two epochs: the same records (rows, steps, loss, learning rate) and the same weights,
    moments and global step after each."""
    plain, x, y = _unit(small_manifest)
    fitted, _, _ = _unit(small_manifest)
    assert plain.trains_without_trainer()
    for epoch in range(EPOCHS):
        assert plain.train_pass((x, y), epoch) == _fitted(fitted, (x, y), epoch)
        _assert_same_state(plain.export_state(), fitted.export_state())


def _stop_at_call(n: int) -> Any:
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] == n

    return stop


def test_a_plain_pass_stopped_at_a_batch_resumes_in_a_trainer_fit_and_back(small_manifest: str) -> None:
    """Stopped at batch 4 in the plain loop, the pass goes on in a Trainer's fit (and the other
    way round) to the weights and loss of an unstopped pass: the two paths share one state."""
    whole, x, y = _unit(small_manifest)
    expected = whole.train_pass((x, y), 0, part="all")
    for first, then in ((False, True), (True, False)):
        stop = _stop_at_call(4)
        stopped, _, _ = _unit(small_manifest)
        with pytest.raises(PassInterrupted) as raised:
            if first:
                _fitted(stopped, (x, y), 0, part="all", stop=stop)
            else:
                stopped.train_pass((x, y), 0, part="all", stop=stop)
        assert raised.value.batches == 4
        resumed, _, _ = _unit(small_manifest)
        resumed.import_state(raised.value.state)
        record = (
            _fitted(resumed, (x, y), 0, part="all") if then else resumed.train_pass((x, y), 0, part="all")
        )
        assert record.resumed_at_batch == 4 and record.train_loss == expected.train_loss
        _assert_same_state(resumed.export_state(), whole.export_state())


def test_a_distillation_pass_matches_its_trainer_fit(small_manifest: str) -> None:
    """Soft targets weigh in (alpha > 0): the plain pass and the fit still agree bit for bit."""
    plain, x, y = _unit(small_manifest, temperature=2.0, alpha=0.7)
    fitted, _, _ = _unit(small_manifest, temperature=2.0, alpha=0.7)
    soft = torch.softmax(torch.randn(len(y), 10, generator=torch.Generator().manual_seed(0)), dim=1)
    assert plain.train_pass((x, y, soft), 0) == _fitted(fitted, (x, y, soft), 0)
    _assert_same_state(plain.export_state(), fitted.export_state())


def test_a_non_finite_loss_names_its_epoch_and_global_step(small_manifest: str) -> None:
    unit, x, y = _unit(small_manifest)
    unit.train_pass((x, y), 0)
    done = unit.global_step
    with pytest.raises(NonFiniteLossError, match=rf"became nan at epoch 1, step {done}$"):
        unit.train_pass((torch.full_like(x, float("nan")), y), 1)
