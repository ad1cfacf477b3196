"""The trainable unit: one pass at a time, state in and out, the same model under every strategy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mopflow.training.data import load_manifest
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.units import load_eval_split, load_partition
from mopflow.training.trainable.schedule import steps_per_epoch
from mopflow.training.trainable.state import StateFormatError
from mopflow.training.trainable.unit import ModelSpec, PassInterrupted, TrainableUnit

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 1e-4, "batch_size": 32}


def _unit(manifest_uri: str, epochs: int, seed: int = 0) -> tuple[TrainableUnit, Any, Any]:
    data = DataRef.open(manifest_uri)
    manifest = load_manifest(manifest_uri)
    x, y = load_partition(data, [e["name"] for e in manifest["splits"]["train"]])
    unit = TrainableUnit.build(ModelSpec("m", CNN, seed), manifest, epochs * steps_per_epoch([len(x)], 32))
    return unit, x, y


def _assert_same_state(a: bytes, b: bytes) -> None:
    """Weights, moments and global step equal (the caller's metadata may differ)."""
    from safetensors.torch import load

    from mopflow.training.trainable.state import global_step

    ta, tb = load(a), load(b)
    assert sorted(ta) == sorted(tb) and any(k.startswith("opt.") for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    assert global_step(a) == global_step(b)


def test_a_unit_exported_between_passes_trains_on_exactly_like_one_that_kept_going(
    small_manifest: str,
) -> None:
    """Export after epoch 0, import into a fresh unit, train epoch 1: the same weights, optimizer
    moments, global step and learning rate as the unit that never left memory."""
    kept, x, y = _unit(small_manifest, epochs=2)
    kept.train_pass((x, y), 0)
    hopped, _, _ = _unit(small_manifest, epochs=2, seed=0)
    meta = hopped.import_state(kept.export_state({"epoch": 0}))
    assert meta["epoch"] == 0 and meta["global_step"] == kept.global_step > 0
    a, b = kept.train_pass((x, y), 1), hopped.train_pass((x, y), 1)
    assert a == b  # rows, steps, loss and the learning rate at the end
    for (name, p), q in zip(kept.model.state_dict().items(), hopped.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    _assert_same_state(kept.export_state(), hopped.export_state())


def test_a_pass_stopped_at_a_batch_goes_on_from_that_batch(small_manifest: str) -> None:
    """``stop`` at batch 3 raises with the state there; importing it and running the same pass
    again continues from batch 3 and ends with the weights and epoch loss of an unstopped pass."""
    whole, x, y = _unit(small_manifest, epochs=1)
    expected = whole.train_pass((x, y), 0, part="all")
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] == 3

    stopped, _, _ = _unit(small_manifest, epochs=1)
    with pytest.raises(PassInterrupted) as raised:
        stopped.train_pass((x, y), 0, part="all", stop=stop)
    assert raised.value.batches == 3
    resumed, _, _ = _unit(small_manifest, epochs=1)
    resumed.import_state(raised.value.state)
    record = resumed.train_pass((x, y), 0, part="all")
    assert record.resumed_at_batch == 3 and record.train_loss == expected.train_loss
    _assert_same_state(resumed.export_state(), whole.export_state())


@pytest.mark.parametrize("run", [3, 64])
def test_batches_handed_to_lightning_in_runs_train_exactly_like_one_at_a_time(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch, run: int
) -> None:
    """A pass fitted by a Lightning Trainer (a callback asks for one) whose batches reach it in
    runs (the last one shorter, or one run for the whole pass) ends with the weights, moments,
    steps, loss and learning rate of one batch at a time."""
    import pytorch_lightning as pl

    from mopflow.training.trainable import lit

    monkeypatch.setattr(lit, "BATCH_RUN", 1)
    single, x, y = _unit(small_manifest, epochs=2)
    assert not single.trains_without_trainer([pl.Callback()])
    expected = [single.train_pass((x, y), epoch, callbacks=[pl.Callback()]) for epoch in range(2)]
    assert expected[0].steps % run != 0 or run > expected[0].steps  # a short last run is covered
    monkeypatch.setattr(lit, "BATCH_RUN", run)
    runs, _, _ = _unit(small_manifest, epochs=2)
    assert [runs.train_pass((x, y), epoch, callbacks=[pl.Callback()]) for epoch in range(2)] == expected
    _assert_same_state(runs.export_state(), single.export_state())


def test_a_state_that_is_not_safetensors_is_refused(small_manifest: str) -> None:
    unit, _, _ = _unit(small_manifest, epochs=1)
    with pytest.raises(StateFormatError, match="not a safetensors blob"):
        unit.import_state(b"PK\x03\x04 a zip file, e.g. torch.save")


def test_validation_is_batched_and_matches_whole_split_accuracy(small_manifest: str) -> None:
    unit, x, y = _unit(small_manifest, epochs=1)
    unit.train_pass((x, y), 0)
    xv, yv = load_eval_split(DataRef.open(small_manifest), "validation")
    with torch.no_grad():
        whole = float((unit.model.eval()(xv).argmax(dim=1).numpy() == yv).mean())
    assert unit.evaluate(xv, yv) == pytest.approx(whole)
