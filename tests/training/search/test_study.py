from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from mopflow.base import progress
from mopflow.base.optuna_storage import StorageConfigError, make_storage
from mopflow.training.data import load_manifest
from mopflow.training.executors import DataRef, EpochReport, ModelOutcome, ModelSpec
from mopflow.training.executors.base import TrainAll
from mopflow.training.executors.task import TaskExecutor
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.rungs import PROMOTED_ATTR
from mopflow.training.search.space import parse_space, sample_params
from mopflow.training.search.study import MODEL_ATTR, STALE_ATTR
from mopflow.training.search.sweep import run_strategy_search
from mopflow.training.search.trial import TrialResult
from tests.spaces import fixed_cnn_space

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


class StopAfter(TrainAll):
    """A controller that stops a model once it has reported ``epochs`` epochs."""

    def __init__(self, epochs: int) -> None:
        self.reports: list[EpochReport] = []
        self.done: list[ModelOutcome] = []
        self.epochs = epochs

    def on_epoch_end(self, report: EpochReport) -> bool:
        self.reports.append(report)
        return len(self.reports) < self.epochs

    def on_model_done(self, outcome: ModelOutcome) -> None:
        self.done.append(outcome)


def _train(manifest: str, client: object, epochs: int, controller: StopAfter) -> ModelOutcome:
    data = DataRef.open(manifest)
    shards = [e["name"] for e in load_manifest(manifest)["splits"]["train"]]
    return TaskExecutor(client, data, shards).run([ModelSpec("m", CNN)], epochs, controller)["m"]


def test_a_task_trial_reports_every_epoch_and_saves_its_model(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    cfg = SearchConfig(n_trials=1, epochs=3, space=fixed_cnn_space(64), pruner="none", sampler="random")
    seen: list[TrialResult] = []
    outcome = run_strategy_search(
        cfg, small_manifest, "one", str(tmp_path / "j.log"), str(tmp_path / "art"), dask_client,
        on_trial_done=seen.append,
    )  # fmt: skip
    (result,) = outcome.results
    assert seen == [result] and result.state == "COMPLETE", result.error
    assert [h["epoch"] for h in result.history] == [0, 1, 2]
    assert result.value == result.history[-1]["val_acc"] and result.num_params > 0
    assert (Path(result.bundle_uri or "") / "weights.safetensors").exists()
    trial = optuna.load_study(study_name="one", storage=make_storage(str(tmp_path / "j.log"))).trials[0]
    assert trial.intermediate_values == {h["epoch"]: h["val_acc"] for h in result.history}


def test_pruning_decision_stops_training_at_that_epoch(small_manifest: str, dask_client: object) -> None:
    controller = StopAfter(epochs=2)
    outcome = _train(small_manifest, dask_client, 6, controller)
    assert outcome.stopped_early and outcome.epochs_done == 2 and outcome.state
    assert controller.done == [outcome]


def _poison_train_shard(manifest_uri: str, tmp_path: Path) -> str:
    """Copy a manifest's folder, put NaN features into one train shard, and re-seal the manifest."""
    import shutil

    import pandas as pd

    from mopflow.base import storage
    from mopflow.training.data import manifest_hash

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


def test_non_finite_loss_fails_the_trial_with_the_reason(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    poisoned = _poison_train_shard(small_manifest, tmp_path)
    controller = StopAfter(epochs=99)
    outcome = _train(poisoned, dask_client, 3, controller)
    assert "NonFiniteLossError" in (outcome.error or "") and "epoch 0" in (outcome.error or "")
    assert outcome.history == [] and controller.done == [outcome]  # stopped at the first non-finite step


def test_search_runs_trials_in_parallel_and_records_them(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    storage_url = str(tmp_path / "journal.log")
    cfg = SearchConfig(n_trials=4, epochs=2, parallel_trials=2, space=TINY_SPACE, min_resource=1)
    seen: list[int] = []
    outcome = run_strategy_search(
        cfg,
        small_manifest,
        "s1",
        storage_url,
        str(tmp_path / "art"),
        dask_client,
        on_trial_done=lambda r: seen.append(r.number),
    )
    study = optuna.load_study(study_name="s1", storage=make_storage(storage_url))
    # under asha a model waiting at a rung may be promoted: a new trial continues it
    promotions = [t for t in study.trials if PROMOTED_ATTR in t.user_attrs]
    trials = 4 + len(promotions)
    assert sorted(seen) == list(range(trials))
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == trials and len({t.user_attrs[MODEL_ATTR] for t in finished}) == 4
    assert len(outcome.results) == 4  # one per model: a promoted model's latest trial
    workers = {w for r in outcome.results for w in r.worker.split(", ")}  # where their epochs ran
    assert workers and len(workers) <= 2
    for trial in study.trials:
        assert trial.user_attrs["history"], "per-epoch history is stored on the trial"
    # Rerunning the same study is idempotent: no trial is added.
    again = run_strategy_search(cfg, small_manifest, "s1", storage_url, str(tmp_path / "art"), dask_client)
    assert len(again.results) == 4
    assert len(optuna.load_study(study_name="s1", storage=make_storage(storage_url)).trials) == trials


def test_trial_left_running_is_retried_with_the_same_params(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    storage_url = str(tmp_path / "journal.log")
    cfg = SearchConfig(n_trials=2, epochs=1, parallel_trials=2, space=TINY_SPACE, pruner="none")
    study = optuna.create_study(study_name="s2", storage=make_storage(storage_url), direction="maximize")
    study.enqueue_trial({"family": "mlp", "mlp_width": 9, "mlp_depth": 1, "lr": 0.01})
    killed = study.ask()  # the coordinator samples its params, then "dies": left RUNNING
    assert sample_params(parse_space(TINY_SPACE), killed)["width"] == 9
    outcome = run_strategy_search(cfg, small_manifest, "s2", storage_url, str(tmp_path / "art"), dask_client)
    trials = optuna.load_study(study_name="s2", storage=make_storage(storage_url)).trials
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    marked = [t for t in trials if t.user_attrs.get(STALE_ATTR)]
    assert len(marked) == 1 and marked[0].state == TrialState.FAIL
    retried = [t for t in trials if t.number > marked[0].number and t.params == marked[0].params]
    assert retried and retried[0].state == TrialState.COMPLETE
    assert len(outcome.results) == 2  # the stale attempt does not count towards n_trials


def test_sqlite_storage_is_refused_for_parallel_workers(tmp_path: Path) -> None:
    with pytest.raises(StorageConfigError, match="SQLite"):
        make_storage(f"sqlite:///{tmp_path}/o.db", writers=2)


def test_search_adds_unpruned_trials_until_the_ensemble_has_its_members(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    # min_resource=1 with reduction 3 prunes most of 3 trials; 3 COMPLETE are still required.
    cfg = SearchConfig(
        n_trials=3, epochs=3, parallel_trials=2, space=TINY_SPACE, min_resource=1, sampler="random"
    )
    events: list[dict[str, object]] = []
    unsubscribe = progress.subscribe(events.append)
    try:
        outcome = run_strategy_search(
            cfg,
            small_manifest,
            "s3",
            str(tmp_path / "j.log"),
            str(tmp_path / "art"),
            dask_client,
            min_complete=3,
        )
    finally:
        unsubscribe()
    assert len(outcome.complete()) >= 3
    assert len(outcome.results) >= 3
    # the progress count never passes its total: the extra trials raise the total as they start
    trials = [event for event in events if event["kind"] == "trial"]
    assert trials and all(int(e["finished"]) <= int(e["total"]) for e in trials)  # type: ignore[call-overload]
    assert int(trials[-1]["total"]) == len(outcome.results)  # type: ignore[call-overload]


def test_a_study_learns_from_an_earlier_study_of_the_same_data(
    small_manifest: str, tmp_path: Path, dask_client: object
) -> None:
    from mopflow.compression.ensemble_choice import load_candidates
    from mopflow.training.search.warm_history import LEARNED_ATTR, WARM_START_ATTR

    storage_url = str(tmp_path / "journal.log")
    cfg = SearchConfig(n_trials=2, epochs=1, parallel_trials=2, space=TINY_SPACE, pruner="none")
    monday = run_strategy_search(cfg, small_manifest, "mon", storage_url, str(tmp_path / "art"), dask_client)
    warm = cfg.model_copy(update={"warm_start_studies": 1, "seed": 1})
    tuesday = run_strategy_search(
        warm, small_manifest, "tue", storage_url, str(tmp_path / "art"), dask_client
    )

    trials = optuna.load_study(study_name="tue", storage=make_storage(storage_url)).trials
    copies = [t for t in trials if LEARNED_ATTR in t.user_attrs]
    assert sorted(t.user_attrs[LEARNED_ATTR] for t in copies) == ["mon#0", "mon#1"]
    # its own trials: the budget's two, the first of them monday's best configuration
    assert [r.number for r in tuesday.results] == [2, 3]
    best_monday = monday.complete()[0]
    assert tuesday.results[0].params == best_monday.params
    assert trials[2].user_attrs[WARM_START_ATTR] == f"study mon#{best_monday.number}"
    assert [c.number for c in load_candidates("tue", storage_url)] == [2, 3]  # copies join no ensemble


def test_a_study_names_its_objective_and_its_run_once(recwarn: pytest.WarningsRecorder) -> None:
    from mopflow.training.search.study import METRIC_NAME, describe_study

    study = optuna.create_study(direction="maximize")
    attrs = {"mopflow.run_key": "abc", "mopflow.airflow_run_id": "manual__1"}
    describe_study(study, attrs)
    describe_study(study, attrs)  # a resume: nothing changes
    assert study.metric_names == [METRIC_NAME] == ["val_acc"]
    assert study.user_attrs == attrs
    assert not [w for w in recwarn if issubclass(w.category, optuna.exceptions.ExperimentalWarning)]
