"""Task sweeps in batches (``trial_batches``): the same trials whatever finishes first."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna
import pytest

from mopflow.base.optuna_storage import make_storage
from mopflow.pipeline.config import ConfigError, PipelineConfig
from mopflow.training.compute.workers import worker_addresses
from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, EpochReport, ModelOutcome, ModelSpec
from mopflow.training.executors.task import TaskExecutor
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.study import MODEL_ATTR
from mopflow.training.search.sweep import run_strategy_search

# CNNs and MLPs of different sizes: side by side, their epochs finish in an order set by the timings
SPACE = {
    "families": {
        "cnn": {
            "width": {"type": "int", "low": 4, "high": 16},
            "depth": {"type": "int", "low": 2, "high": 3},
        },
        "mlp": {
            "width": {"type": "int", "low": 8, "high": 32},
            "depth": {"type": "int", "low": 1, "high": 2},
        },
    },
    "common": {"lr": {"type": "float", "low": 0.005, "high": 0.03, "log": True}},
}
SLOW = {"family": "cnn", "width": 48, "depth": 3, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32}
FAST = {"family": "mlp", "width": 8, "depth": 1, "lr": 0.01, "weight_decay": 0.0, "batch_size": 128}


def _sweep(name: str, cfg: SearchConfig, manifest: str, root: Path, client: Any) -> dict[str, Any]:
    storage_url = str(root / f"{name}.log")
    outcome = run_strategy_search(cfg, manifest, name, storage_url, str(root / name), client)
    study = optuna.load_study(study_name=name, storage=make_storage(storage_url))
    return {
        "trials": [
            (t.number, t.state.name, t.params, t.intermediate_values, t.value, t.user_attrs.get(MODEL_ATTR))
            for t in study.trials
        ],
        "results": [(r.number, r.state, r.params, r.history, r.pruned_epoch) for r in outcome.results],
    }


def test_a_task_sweep_in_batches_run_twice_gives_the_same_trials(
    small_manifest: str, dask_client: Any, tmp_path: Path
) -> None:
    # ASHA from the first epoch: which models stop, wait or are promoted depends on the order in
    # which their values reach the rung; the sampler learns from every trial told before it asks
    cfg = SearchConfig(
        strategy="task", trial_batches=True, parallel_trials=2, n_trials=5, epochs=2, pruner="asha",
        min_resource=1, sampler="tpe", seed=5, space=SPACE,
    )  # fmt: skip
    first = _sweep("first", cfg, small_manifest, tmp_path, dask_client)
    # the second run's timings differ: one of the two workers is busy for its first second
    worker = worker_addresses(dask_client)[0]
    busy = dask_client.submit(time.sleep, 1.0, workers=[worker], pure=False)
    second = _sweep("second", cfg, small_manifest, tmp_path, dask_client)
    busy.result()
    states = [state for _, state, *_ in first["trials"]]
    assert "PRUNED" in states and "COMPLETE" in states, states  # the rung decided
    assert len({params["family"] for _, _, params, *_ in first["trials"]}) == 2  # models of unequal speed
    assert second == first  # parameters, states, every epoch's value, each model's history


class Recorder:
    """A controller that hands out ``models`` one at a time, stops those in ``stop`` after their
    first epoch and records what it hears, in order."""

    def __init__(self, models: list[ModelSpec], stop: set[str]) -> None:
        self.models, self.stop = models, stop
        self.events: list[tuple[str, str, int]] = []

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.events.append(("epoch", report.model_id, report.epoch))
        return report.model_id not in self.stop

    def on_model_done(self, outcome: ModelOutcome) -> None:
        self.events.append(("done", outcome.spec.model_id, outcome.epochs_done))

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        handed, self.models = self.models[:free_slots], self.models[free_slots:]
        self.events += [("new", spec.model_id, 0) for spec in handed]
        return handed


def test_in_batches_a_batch_trains_in_step_and_the_next_waits_for_all_of_it(
    small_manifest: str, dask_client: Any
) -> None:
    data = DataRef.open(small_manifest)
    shards = [e["name"] for e in load_manifest(small_manifest)["splits"]["train"]]
    # "a" is many times slower than "b": as they come, b's epochs would reach the controller
    # first and, once b is stopped, "c" would start beside a
    models = [ModelSpec("a", SLOW), ModelSpec("b", FAST), ModelSpec("c", FAST), ModelSpec("d", FAST)]
    recorder = Recorder(models, stop={"b"})
    executor = TaskExecutor(dask_client, data, shards, slots=2, batches=True)
    outcomes = executor.run([], 2, recorder)
    assert recorder.events == [
        ("new", "a", 0), ("new", "b", 0),
        ("epoch", "a", 0), ("epoch", "b", 0), ("done", "b", 1),
        ("epoch", "a", 1), ("done", "a", 2),
        ("new", "c", 0), ("new", "d", 0),
        ("epoch", "c", 0), ("epoch", "d", 0),
        ("epoch", "c", 1), ("done", "c", 2), ("epoch", "d", 1), ("done", "d", 2),
    ]  # fmt: skip
    assert outcomes["b"].stopped_early and not outcomes["a"].stopped_early


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"strategy": "mop", "trial_batches": True}, "trial_batches applies to strategy='task'"),
        ({"trial_batches": True, "worker_schedule": "static:2"}, "cannot be combined"),
    ],
)
def test_trial_batches_is_refused_where_it_cannot_hold(conf: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        PipelineConfig.from_conf(conf)
    assert PipelineConfig.from_conf({"trial_batches": True}).search.trial_batches
