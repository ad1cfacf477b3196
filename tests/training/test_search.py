from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from infra.optuna_storage import StorageConfigError, make_storage
from training.config import SearchConfig
from training.search import STALE_ATTR
from training.space import parse_space, sample_params
from training.task_search import run_search
from training.trial import TrialSpec, train_trial

TINY_SPACE = {
    "families": {
        "cnn": {"width": {"type": "int", "low": 4, "high": 8}, "depth": {"type": "int", "low": 2, "high": 3}},
        "mlp": {
            "width": {"type": "int", "low": 8, "high": 16},
            "depth": {"type": "int", "low": 1, "high": 2},
        },
    },
    "common": {"lr": {"type": "float", "low": 0.005, "high": 0.02, "log": True}},
}
CNN = {"family": "cnn", "width": 8, "depth": 2, "lr": 0.01, "weight_decay": 0.0, "batch_size": 64}


class PruneAfter:
    """A reporter that asks to prune once ``epochs`` values have been reported."""

    def __init__(self, epochs: int) -> None:
        self.reported: list[tuple[int, float]] = []
        self.epochs = epochs

    def report(self, value: float, step: int) -> None:
        self.reported.append((step, value))

    def should_prune(self) -> bool:
        return len(self.reported) >= self.epochs


def _spec(manifest: str, tmp_path: Path, params: dict, epochs: int = 3) -> TrialSpec:
    return TrialSpec(0, 0, params, epochs, 0, manifest, str(tmp_path / "bundle"))


def test_trial_reports_every_epoch_and_saves_its_model(small_manifest: str, tmp_path: Path) -> None:
    reporter = PruneAfter(epochs=99)
    result = train_trial(_spec(small_manifest, tmp_path, CNN, epochs=3), reporter)
    assert result.state == "COMPLETE", result.error
    assert [s for s, _ in reporter.reported] == [0, 1, 2]
    assert result.value == reporter.reported[-1][1]
    assert (tmp_path / "bundle" / "weights.safetensors").exists()


def test_pruning_decision_stops_training_at_that_epoch(small_manifest: str, tmp_path: Path) -> None:
    result = train_trial(_spec(small_manifest, tmp_path, CNN, epochs=6), PruneAfter(epochs=2))
    assert result.state == "PRUNED"
    assert result.pruned_epoch == 1 and len(result.history) == 2


def _poison_train_shard(manifest_uri: str, tmp_path: Path) -> str:
    """Copy a manifest's folder, put NaN features into one train shard, and re-seal the manifest."""
    import shutil

    import pandas as pd

    from infra import storage
    from training.data import manifest_hash

    src = Path(manifest_uri).parent
    dst = tmp_path / "poisoned"
    shutil.copytree(src, dst)
    manifest = storage.read_json(str(dst / "manifest.json"))
    entry = manifest["splits"]["train"][0]
    frame = pd.read_parquet(dst / entry["name"])
    frame.iloc[:, 0] = float("nan")
    frame.to_parquet(dst / entry["name"], index=False)
    entry["sha256"] = storage.sha256_url(str(dst / entry["name"]))
    manifest["manifest_hash"] = manifest_hash(manifest)
    storage.write_json_atomic(str(dst / "manifest.json"), manifest)
    return str(dst / "manifest.json")


def test_non_finite_loss_fails_the_trial_with_the_reason(small_manifest: str, tmp_path: Path) -> None:
    poisoned = _poison_train_shard(small_manifest, tmp_path)
    result = train_trial(_spec(poisoned, tmp_path, CNN, epochs=3), PruneAfter(epochs=99))
    assert result.state == "FAIL"
    assert "NonFiniteLossError" in (result.error or "") and "epoch 0" in (result.error or "")
    assert result.history == []  # stopped at the first non-finite step, before any epoch ended
    assert not (tmp_path / "bundle").exists()


def test_search_runs_trials_in_parallel_and_records_them(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    storage_url = str(tmp_path / "journal.log")
    cfg = SearchConfig(n_trials=4, epochs=2, n_workers=2, space=TINY_SPACE, min_resource=1)
    seen: list[int] = []
    outcome = run_search(
        cfg,
        small_manifest,
        "s1",
        storage_url,
        str(tmp_path / "art"),
        dask_client,
        on_trial_done=lambda r: seen.append(r.number),
    )
    assert sorted(seen) == [0, 1, 2, 3]
    study = optuna.load_study(study_name="s1", storage=make_storage(storage_url))
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 4
    assert {r.worker for r in outcome.results} and len({r.worker for r in outcome.results}) <= 2
    for trial in study.trials:
        assert trial.user_attrs["history"], "per-epoch history is stored on the trial"
    # Rerunning the same study is idempotent: no trial is added.
    again = run_search(cfg, small_manifest, "s1", storage_url, str(tmp_path / "art"), dask_client)
    assert len(again.results) == 4
    assert len(optuna.load_study(study_name="s1", storage=make_storage(storage_url)).trials) == 4


def test_trial_left_running_is_retried_with_the_same_params(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    storage_url = str(tmp_path / "journal.log")
    cfg = SearchConfig(n_trials=2, epochs=1, n_workers=2, space=TINY_SPACE, pruner="none")
    study = optuna.create_study(study_name="s2", storage=make_storage(storage_url), direction="maximize")
    study.enqueue_trial({"family": "mlp", "mlp_width": 9, "mlp_depth": 1, "lr": 0.01})
    killed = study.ask()  # the coordinator samples its params, then "dies": left RUNNING
    assert sample_params(parse_space(TINY_SPACE), killed)["width"] == 9
    outcome = run_search(cfg, small_manifest, "s2", storage_url, str(tmp_path / "art"), dask_client)
    trials = optuna.load_study(study_name="s2", storage=make_storage(storage_url)).trials
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    marked = [t for t in trials if t.user_attrs.get(STALE_ATTR)]
    assert len(marked) == 1 and marked[0].state == TrialState.FAIL
    retried = [t for t in trials if t.number > marked[0].number and t.params == marked[0].params]
    assert retried and retried[0].state == TrialState.COMPLETE
    assert len(outcome.results) == 2  # the stale attempt does not count towards n_trials


def test_sqlite_storage_is_refused_for_parallel_workers(tmp_path: Path) -> None:
    with pytest.raises(StorageConfigError, match="SQLite"):
        make_storage(f"sqlite:///{tmp_path}/o.db", n_workers=2)


def test_search_adds_unpruned_trials_until_the_ensemble_has_its_members(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    # min_resource=1 with reduction 3 prunes most of 3 trials; 3 COMPLETE are still required.
    cfg = SearchConfig(n_trials=3, epochs=3, n_workers=2, space=TINY_SPACE, min_resource=1, sampler="random")
    outcome = run_search(
        cfg, small_manifest, "s3", str(tmp_path / "j.log"), str(tmp_path / "art"), dask_client, min_complete=3
    )
    assert len(outcome.complete()) >= 3
    assert len(outcome.results) >= 3
