"""A MOP sweep run twice with one seed: the same trials, epoch values, ensemble and student."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from mopflow.base.optuna_storage import make_storage
from mopflow.base.settings import Settings
from mopflow.pipeline.distill import distill_stage
from mopflow.pipeline.ensemble import ensemble_stage
from mopflow.pipeline.records import ShardRecord
from mopflow.pipeline.run import start_pipeline
from mopflow.pipeline.search import search_stage
from mopflow.training.data import load_manifest

TINY_SPACE = {
    "families": {
        "mlp": {"width": {"type": "int", "low": 8, "high": 32}, "depth": {"type": "int", "low": 1, "high": 2}}
    },
    "common": {
        "lr": {"type": "float", "low": 0.003, "high": 0.03, "log": True},
        "batch_size": {"type": "categorical", "choices": [32, 64]},
    },
}
# Three models hop over the two partitions of the session's 2 workers, so which worker frees
# first would decide a model's order of partitions; ASHA from the first epoch stops models at
# its rung and promotes some, so the order of the reports decides which trials go on.
CONF: dict[str, Any] = {
    "strategy": "mop",
    "model_slots": 3,
    "n_trials": 4,
    "epochs": 2,
    "pruner": "asha",
    "min_resource": 1,
    "seed": 3,
    "warm_start": False,
    "warm_start_studies": 0,
    "search_space": json.dumps(TINY_SPACE),
    "top_k": 2,
    "distill_epochs": 1,
    "student_family": "mlp",
    "student_depth": 1,
    "student_max_param_ratio": 1.0,
    "model_name": "twice",
}


def _sweep(run_id: str, shard: ShardRecord, settings: Settings) -> dict[str, Any]:
    """The search, ensemble and distill stages of one pipeline run; what a rerun must reproduce."""
    ctx = start_pipeline(CONF, "mopflow_retrain", run_id, settings)
    search = search_stage(CONF, ctx, shard, settings)
    ensemble = ensemble_stage(CONF, ctx, shard, search, settings)
    student = distill_stage(CONF, ctx, shard, ensemble, settings)
    study = optuna.load_study(study_name=search.study_name, storage=make_storage(settings.optuna_storage))
    return {
        "study": search.study_name,
        "trials": [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials],
        "ensemble": (ensemble.members, ensemble.member_weights, ensemble.test_acc),
        "student": (student.val_acc, student.test_acc, student.distilled_test_acc),
    }


@pytest.mark.slow
def test_a_mop_sweep_run_twice_with_one_seed_gives_the_same_results(
    tmp_path: Path, dask_client: Any, small_manifest: str
) -> None:
    settings = Settings.from_env(
        {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_DASK_ADDRESS": dask_client.scheduler.address}
    )
    shard = ShardRecord(
        manifest_uri=small_manifest, manifest_hash=load_manifest(small_manifest)["manifest_hash"], reused=True
    )
    first = _sweep("manual__first", shard, settings)
    second = _sweep("manual__second", shard, settings)
    assert first["study"] != second["study"]  # two studies: nothing of the first run is reused
    states = [state for _, state, *_ in first["trials"]]
    assert "PRUNED" in states and states.count("COMPLETE") >= CONF["top_k"], states  # pruning decided
    assert second["trials"] == first["trials"]  # parameters, states and every epoch's value
    assert second["ensemble"] == first["ensemble"]
    assert second["student"] == first["student"]
