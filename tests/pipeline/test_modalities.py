"""Images and sequences through the stages: every strategy trains them, an ensemble mixes
families, and the student is distilled on a mixup transfer set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optuna
import pytest

from mopflow.base.optuna_storage import make_storage
from mopflow.base.settings import Settings
from mopflow.pipeline.config import ConfigError, PipelineConfig
from mopflow.pipeline.context import study_name_for, tracker_for
from mopflow.pipeline.distill import distill_stage
from mopflow.pipeline.ensemble import ensemble_stage
from mopflow.pipeline.run import start_pipeline
from mopflow.pipeline.search import search_stage
from mopflow.pipeline.shard import shard_stage
from mopflow.training.models.bundle import load_bundle

IMAGE_SPACE = {
    "families": {
        "cnn2d": {
            "width": {"type": "int", "low": 4, "high": 6},
            "depth": {"type": "categorical", "choices": [2]},
        },
        "resnet": {
            "width": {"type": "categorical", "choices": [4]},
            "depth": {"type": "int", "low": 1, "high": 2},
            "flip": {"type": "categorical", "choices": [False, True]},
        },
    },
    "common": {"batch_size": {"type": "categorical", "choices": [32]}},
}
SEQUENCE_SPACE = {
    "families": {
        "gru": {
            "width": {"type": "categorical", "choices": [8]},
            "depth": {"type": "categorical", "choices": [1]},
        },
        "rescnn": {
            "width": {"type": "categorical", "choices": [8]},
            "depth": {"type": "categorical", "choices": [2]},
            "shift": {"type": "categorical", "choices": [1]},
        },
    },
}
BASE = {"n_shards": 2, "n_trials": 2, "epochs": 1, "pruner": "none", "top_k": 2, "distill_epochs": 1}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mop", "ddp"])
def test_images_train_under_the_mop_and_ddp_strategies(tmp_path: Path, strategy: str) -> None:
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path)})
    conf = BASE | {
        "dataset": "shapes",
        "num_samples": 400,
        "strategy": strategy,
        "search_space": IMAGE_SPACE,
        "model_name": f"img-{strategy}",
    }
    ctx = start_pipeline(conf, "mopflow_retrain", f"manual__{strategy}", settings)
    shard = shard_stage(conf, ctx, settings)
    search = search_stage(conf, ctx, shard, settings)
    assert search.counts == {"COMPLETE": 2, "PRUNED": 0, "FAIL": 0}


@pytest.mark.slow
def test_a_sequence_ensemble_of_two_families_is_distilled_on_mixup(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    folder = tmp_path / "seq"
    folder.mkdir()
    y = rng.integers(0, 3, 600)
    x = rng.normal(size=(600, 16, 2)).astype(np.float32)
    x[np.arange(600), 4 + 3 * y, 0] += 3.0  # the class is where the bump is
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_DATA_ROOTS": str(folder)})
    conf = BASE | {
        "dataset": str(folder),
        "search_space": SEQUENCE_SPACE,
        "sampler": "grid",  # one trial per family
        "model_name": "seq",
    }
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__seq", settings)
    shard = shard_stage(conf, ctx, settings)
    search = search_stage(conf, ctx, shard, settings)
    ensemble = ensemble_stage(conf, ctx, shard, search, settings)
    members = load_bundle(ensemble.bundle_uri).spec["members"]
    assert sorted(m["family"] for m in members) == ["gru", "rescnn"]
    assert all(m["modality"] == "sequence" and m["input_shape"] == [16, 2] for m in members)
    distill = distill_stage(conf, ctx, shard, ensemble, settings)
    assert distill.arch["family"] == "cnn" and distill.arch["input_shape"] == [16, 2]
    params = tracker_for(settings).client.get_run(distill.run_id).data.params
    assert params["transfer"] == "mixup" and params["family"] == "cnn"  # the choices auto made
    assert "student int8 (static)" in {row["model"] for row in distill.evaluation}

    # A student family that cannot take the data fails the search before any trial trains.
    bad = conf | {"student_family": "cnn2d", "model_name": "seq-bad"}
    bad_ctx = start_pipeline(bad, "mopflow_retrain", "manual__seq-bad", settings)
    with pytest.raises(
        ConfigError, match=r"student_family='cnn2d' takes \['image'\] data; the dataset is 'sequence'"
    ):
        search_stage(bad, bad_ctx, shard_stage(bad, bad_ctx, settings), settings)
    studies = optuna.get_all_study_names(make_storage(settings.optuna_storage))
    assert study_name_for(PipelineConfig.from_conf(conf), ctx) in studies
    assert study_name_for(PipelineConfig.from_conf(bad), bad_ctx) not in studies
