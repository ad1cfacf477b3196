"""The models a worker keeps between units: a state loaded into a kept model trains exactly as on
a freshly built one; the pool's bounds; the packed state's bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.resident import ModelPool, model_bytes, models_here, pool_bytes_here
from mopflow.training.executors.units import train_pass_and_validate
from mopflow.training.trainable.state import pack, state_metadata
from tests.training.volatile.test_preemption import CNN_PARAMS


def test_a_state_loaded_into_a_kept_model_trains_as_on_a_fresh_one(
    small_manifest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expected: the unit after a first one takes the model that one gave back (nothing is
    built), and even with that model's weights and gradients spoiled in between, its state,
    loss and validation accuracy are bit for bit those of the same unit on a freshly built model
    (no pool)."""
    data = DataRef.open(small_manifest)
    shards = sorted(e["name"] for e in load_manifest(small_manifest)["splits"]["train"])
    spec = ModelSpec("trial-0000", CNN_PARAMS, seed=3)
    first, _, _ = train_pass_and_validate(spec, None, data, shards, 0, 3)

    monkeypatch.setenv("MOPFLOW_MODEL_POOL_MB", "0")  # a pool that keeps nothing: every unit builds
    fresh = train_pass_and_validate(spec, first, data, shards, 1, 3, validate=True)
    monkeypatch.delenv("MOPFLOW_MODEL_POOL_MB")

    pool = models_here()
    pool.clear()
    train_pass_and_validate(spec, first, data, shards, 1, 3)
    (key,) = pool._free
    ((kept, _),) = pool._free[key]
    with torch.no_grad():
        for parameter in kept.parameters():
            parameter.fill_(float("nan"))
            parameter.grad = torch.ones_like(parameter)
    builds: list[str] = []
    monkeypatch.setattr("mopflow.training.executors.units._built", lambda *a: builds.append("built"))
    pooled = train_pass_and_validate(spec, first, data, shards, 1, 3, validate=True)
    assert builds == [] and pool._free[key][0][0] is kept
    assert _same_state(pooled[0], fresh[0])
    assert (pooled[1]["train_loss"], pooled[2]) == (fresh[1]["train_loss"], fresh[2])


def test_the_pool_keeps_the_models_given_back_last_within_its_bytes() -> None:
    """Expected: a model is taken by one caller at a time; beyond its bytes the pool drops the
    models given back longest ago; one larger than the pool is not kept; the size comes from
    ``MOPFLOW_MODEL_POOL_MB``, a bad one refused naming it."""
    small, other = nn.Linear(4, 4), nn.Linear(4, 4)
    size = model_bytes(small)
    pool = ModelPool(max_bytes=2 * size)
    assert pool.take("a") is None
    pool.give_back("a", small)
    pool.give_back("b", other)
    assert pool.take("a") is small and pool.take("a") is None
    pool.give_back("a", small)
    pool.give_back("c", nn.Linear(4, 4))  # over the bytes: "b" was given back longest ago
    assert pool.take("b") is None and pool.take("a") is small and pool.held_bytes == size
    pool.give_back("big", nn.Linear(16, 16))
    assert pool.take("big") is None

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOPFLOW_MODEL_POOL_MB", "0.5")
        assert pool_bytes_here() == 2**19
        patch.setenv("MOPFLOW_MODEL_POOL_MB", "lots")
        with pytest.raises(ValueError, match="MOPFLOW_MODEL_POOL_MB='lots': expected a number of megabytes"):
            pool_bytes_here()


def _same_state(a: bytes, b: bytes) -> bool:
    """Same tensors, bit for bit, and the same metadata (whose order in the header is the
    writer's hash map's)."""
    from safetensors.torch import load

    ta, tb = load(a), load(b)
    same_tensors = sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    return same_tensors and state_metadata(a) == state_metadata(b)


def test_a_packed_state_is_what_safetensors_torch_writer_gives() -> None:
    """Expected: what ``safetensors.torch.save`` gives for float32 and uint8 tensors, and
    bfloat16 (no numpy twin) packed too."""
    from safetensors.torch import load, save

    tensors = {"model.w": torch.randn(3, 5), "extra.rng": torch.randint(0, 255, (16,), dtype=torch.uint8)}
    metadata = {"meta": '{"epoch": 1}', "steps": "{}"}
    assert _same_state(pack(tensors, metadata), save(tensors, metadata=metadata))
    assert state_metadata(pack(tensors, metadata)) == metadata
    half = {"model.w": torch.randn(3, 5).to(torch.bfloat16)}
    assert torch.equal(load(pack(half, {}))["model.w"], half["model.w"])
