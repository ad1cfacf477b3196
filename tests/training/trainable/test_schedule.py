"""One learning-rate schedule in global steps, whichever strategy trains a configuration and however
often it is stopped and resumed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mopflow.training.executors import DataRef, ModelSpec
from mopflow.training.trainable.schedule import one_cycle, steps_per_epoch

CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.02, "weight_decay": 0.0, "batch_size": 32}


def _schedule(total: int, start: int, steps: int) -> list[tuple[float, float]]:
    """(lr, beta1) at each of ``steps`` steps from ``start``, as an optimizer sees them."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=0.02)
    scheduler = one_cycle(optimizer, 0.02, total, start)
    seen = []
    for i in range(steps):
        if i:
            optimizer.step()
            scheduler.step()
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group["betas"][0]))
    return seen


def _lr_after(total: int, step: int) -> float:
    """The learning rate once ``step`` steps are done (``total`` included: the schedule's end)."""
    return _schedule(total, step, 1)[0][0]


def test_the_schedule_resumed_at_a_step_continues_exactly() -> None:
    whole = _schedule(120, 0, 120)
    for start in (1, 37, 119):
        assert _schedule(120, start, 120 - start) == whole[start:]
    lrs = [lr for lr, _ in whole]
    assert lrs.index(max(lrs)) == 35  # one cycle: warm up over 30% of the steps, then anneal
    assert lrs[-1] < lrs[0] < max(lrs)


def test_steps_per_epoch_count_each_partition_s_short_last_batch() -> None:
    assert steps_per_epoch([100], 32) == 4
    assert steps_per_epoch([50, 50], 32) == 4  # 2 + 2
    assert steps_per_epoch([40, 40, 20], 32) == 5  # 2 + 2 + 1: one more than 100 rows in one pass
    assert steps_per_epoch([0, 64], 32) == 2


def _train_rows(manifest: str) -> dict[str, int]:
    from mopflow.training.data import load_manifest

    return {e["name"]: int(e["rows"]) for e in load_manifest(manifest)["splits"]["train"]}


def test_mop_and_task_follow_the_schedule_in_global_steps(small_manifest: str, dask_client: Any) -> None:
    from mopflow.training.executors.mop import MopExecutor
    from mopflow.training.executors.task import TaskExecutor

    rows = _train_rows(small_manifest)
    spec = ModelSpec("m", CNN, seed=0)
    epochs = 3
    for executor in (
        MopExecutor(dask_client, DataRef.open(small_manifest), list(rows), seed=0),
        TaskExecutor(dask_client, DataRef.open(small_manifest), list(rows)),
    ):
        outcome = executor.run([spec], epochs)["m"]
        parts = (
            executor.partition_rows.values() if isinstance(executor, MopExecutor) else [sum(rows.values())]
        )
        per_epoch = steps_per_epoch(parts, 32)
        total = epochs * per_epoch
        records = sorted(executor.records, key=lambda r: r["global_step_end"])
        # Every unit ends where the global-step schedule says, whichever worker ran it.
        for record in records:
            assert record["lr_end"] == pytest.approx(_lr_after(total, record["global_step_end"]), rel=1e-9)
        assert records[-1]["global_step_end"] == total
        assert [r.lr for r in outcome.history] == pytest.approx(
            [_lr_after(total, (e + 1) * per_epoch) for e in range(epochs)], rel=1e-9
        )


@pytest.mark.slow
def test_a_resumed_ddp_trial_continues_its_schedule_and_its_optimizer(
    small_manifest: str, dask_client: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load

    from mopflow.training.executors.ddp import DDPExecutor

    spec = ModelSpec("d", CNN | {"batch_size": 64}, seed=0)
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole = DDPExecutor(dask_client, DataRef.open(small_manifest), 2, str(whole_dir)).run([spec], epochs=3)[
        "d"
    ]
    DDPExecutor(dask_client, DataRef.open(small_manifest), 2, str(split_dir)).run([spec], epochs=1)
    resumed = DDPExecutor(dask_client, DataRef.open(small_manifest), 2, str(split_dir)).run([spec], epochs=3)[
        "d"
    ]
    assert whole.error is None and resumed.error is None, (whole.error, resumed.error)
    assert [r.epoch for r in resumed.history] == [0, 1, 2]  # epoch 0 from beside the checkpoint
    # The learning rate at the end of epochs 2 and 3 is the uninterrupted run's, not a new cycle's.
    # (the first run planned 1 epoch: its own epoch 0 ended its own, shorter cycle)
    assert [r.lr for r in resumed.history[1:]] == pytest.approx([r.lr for r in whole.history[1:]], rel=1e-9)

    def adam_steps(root: Path) -> float:
        blob = (root / "d" / "last.safetensors").read_bytes()
        size = int.from_bytes(blob[:8], "little")
        return float(json.loads(json.loads(blob[8 : 8 + size])["__metadata__"]["steps"])["0"])

    assert adam_steps(split_dir) == adam_steps(whole_dir) > 0  # the moments went on, not from zero
    assert set(load((split_dir / "d" / "last.safetensors").read_bytes())) >= {"opt.0.exp_avg"}
