"""Where MOP's data lives: partitions on the workers that declare the units' Dask resources."""

from __future__ import annotations

from typing import Any

import pytest

from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.executors.mop import MopExecutor

MLP = {"family": "mlp", "width": 16, "depth": 1, "lr": 3e-3, "weight_decay": 0.0, "batch_size": 32}


async def _declare(amount: float, dask_worker: Any = None) -> None:
    """Make this worker declare ``amount`` of the test's resource (``client.run`` it)."""
    await dask_worker.set_resources(MOPTEST=amount)


def test_mop_trains_only_on_the_workers_declaring_its_units_resources(
    small_manifest: str, dask_client: Any
) -> None:
    """Expected: with ``resources`` (a GPU sweep's ``{"GPU": 1}``), every partition and every unit
    goes to the workers that declare them; none declaring them is refused by name."""
    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    needs = {"MOPTEST": 1.0}
    with pytest.raises(RuntimeError, match="MOPTEST"):
        MopExecutor(dask_client, data, shards, resources=needs)
    held = sorted(dask_client.scheduler_info()["workers"])[1]
    dask_client.run(_declare, 1.0, workers=[held])
    try:
        executor = MopExecutor(dask_client, data, shards, resources=needs)
        outcomes = executor.run([ModelSpec(f"m{i}", MLP, seed=i) for i in range(2)], epochs=1)
    finally:
        dask_client.run(_declare, 0.0, workers=[held])
    assert all(o.epochs_done == 1 for o in outcomes.values())
    assert set(executor.scheduler.placement.values()) == {held}
    assert {r["worker"] for r in executor.records} == {held} and len(executor.records) == 2
