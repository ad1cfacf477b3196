"""The search benchmark's plain-Optuna baseline (``benchmarks/studies/plain_optuna.py``): its helpers,
its training recipe against mopflow's trainable unit, and two tiny searches in two processes."""

from __future__ import annotations

import json
import math
import multiprocessing
from pathlib import Path
from typing import Any

import optuna
import pytest
from studies import plain_optuna as plain

from tests.benchmarks.loader import load_benchmark

SPACE = load_benchmark("search").SPACE
ROW_KEYS = {
    "strategy", "arm", "seed", "reached", "epochs_to_target", "seconds_to_target", "epochs_trained",
    "total_s", "best_val_acc", "trials", "busy_s", "utilisation", "start_s", "stop_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> str:
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.data import shard_dataset
    from mopflow.training.data.config import DataConfig

    root = tmp_path_factory.mktemp("plain-data")
    with dask_client("", 2) as client:
        return str(
            shard_dataset(DataConfig(num_samples=2000, val_fraction=0.1), f"{root}/data", client).manifest_uri
        )


def _job(manifest: str, work: Path, **changes: Any) -> dict[str, Any]:
    base = {
        "trials": 4, "budget_epochs": 6, "epochs": 2, "min_resource": 1, "workers": 2, "target": 0.2,
        "space": SPACE, "manifest": manifest, "work": str(work), "seed": 0, "arm": "plain-tpe",
        "strategy": "task",
    }  # fmt: skip
    return base | changes


def test_seeds_keep_process_zero_on_the_search_seed_and_follow_mopflow_per_trial() -> None:
    assert plain.process_seed(5, 0) == 5
    assert len({plain.process_seed(s, i) for s in range(20) for i in range(4)}) == 80
    assert plain.trial_seed(2, 7) == 2007


def test_params_are_named_as_mopflow_names_them() -> None:
    from mopflow.training.search.space import SearchSpace, sample_params

    for seed in range(5):
        ours = plain.suggest_params(optuna.trial.FixedTrial(_draw(seed)), SPACE)
        theirs = sample_params(SearchSpace.model_validate(SPACE), optuna.trial.FixedTrial(_draw(seed)))
        assert ours == theirs
    only_cnn = {"families": {"cnn": SPACE["families"]["cnn"]}}  # one family, no common params
    drawn = plain.suggest_params(optuna.trial.FixedTrial({"cnn_width": 8, "cnn_depth": 2}), only_cnn)
    assert drawn == {
        "family": "cnn",
        "width": 8,
        "depth": 2,
        "lr": 1e-2,
        "weight_decay": 0.0,
        "batch_size": 128,
    }


def test_random_proposals_are_mopflows_random_search_trial_for_trial() -> None:
    from mopflow.training.search.algorithms import make_sampler
    from mopflow.training.search.config import SearchConfig
    from mopflow.training.search.space import SearchSpace, sample_params

    space = SearchSpace.model_validate(SPACE)
    for seed in (0, 7):
        study = optuna.create_study(sampler=make_sampler(SearchConfig(sampler="random", seed=seed)))
        ours = []
        for _ in range(6):
            trial = study.ask()
            sample_params(space, trial)
            ours.append(trial.params)
        assert plain.random_proposals(SPACE, seed, 6) == ours
    assert plain.random_proposals(SPACE, 0, 6) != plain.random_proposals(SPACE, 1, 6)


def _draw(seed: int) -> dict[str, Any]:
    return plain.random_proposals(SPACE, seed, 1)[0]


def test_no_trial_starts_past_the_budget_the_trial_count_or_the_target() -> None:
    ctx = multiprocessing.get_context("spawn")
    shared = plain.Shared(ctx.Lock(), ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event())
    job = {"budget_epochs": 4, "trials": 3}
    assert plain.claim_trial(shared, job) and shared.started.value == 1
    shared.epochs.value = 4
    assert not plain.claim_trial(shared, job)
    shared.epochs.value = 3
    shared.started.value = 3
    assert not plain.claim_trial(shared, job)
    shared.started.value = 0
    shared.goal.set()
    assert not plain.claim_trial(shared, job) and shared.started.value == 0


def test_the_plain_loop_trains_as_mopflows_unit_does(manifest: str) -> None:
    """Same seed, params and schedule: the same validation accuracy after each of two epochs."""
    import threading

    from mopflow.training.data import load_manifest
    from mopflow.training.trainable.unit import ModelSpec, TrainableUnit

    class Trial:
        number = 7

        def report(self, value: float, step: int) -> None: ...

        def should_prune(self) -> bool:
            return False

    shared = plain.Shared(threading.Lock(), _Count(), _Count(), threading.Event())
    trainer = plain.Trainer(_job(manifest, Path("."), seed=3, target=2.0), shared)
    params = {"family": "cnn", "width": 16, "depth": 3, "lr": 0.01, "weight_decay": 1e-4, "batch_size": 64}
    assert trainer.run_trial(Trial(), params)[0] == "COMPLETE"
    state, accs, steps = None, [], math.ceil(len(trainer.train[1]) / 64)
    for epoch in range(2):
        unit = TrainableUnit.build(ModelSpec("trial-0007", params, 3007), load_manifest(manifest), 2 * steps)
        if state is not None:
            unit.import_state(state)
        unit.train_pass(trainer.train, epoch)
        state = unit.export_state()
        accs.append(unit.evaluate(*trainer.val))
    assert [acc for _, acc in trainer.reports] == pytest.approx(accs, abs=1e-9)
    assert shared.epochs.value == 2


class _Count:
    value = 0


def test_a_reachable_target_is_reached_and_stops_new_trials(manifest: str, tmp_path: Path) -> None:
    row = plain.run_plain_search(_job(manifest, tmp_path, arm="plain-random"))
    print(json.dumps(row))
    assert set(row) == ROW_KEYS
    assert row["strategy"] == "plain" and row["arm"] == "plain-random"
    assert row["reached"] and row["best_val_acc"] >= 0.2
    assert 1 <= row["epochs_to_target"] <= row["epochs_trained"]
    assert row["seconds_to_target"] <= row["total_s"]
    # past the target no trial starts: the reaching one finishes (1 epoch left at most), the other
    # worker's too (2 at most)
    assert row["epochs_trained"] <= row["epochs_to_target"] + 1 + 2
    assert sum(row["trials"].values()) <= 4 and row["trials"]["FAIL"] == 0
    assert 0 < row["utilisation"] <= 1
    assert row["busy_s"] <= 2 * row["total_s"]
    assert row["start_s"] > 0  # spawning and importing, before the clock
    assert row["stop_s"] >= 0  # the processes' exits, after it
    # each trial trained the configuration mopflow's random search gives the trial of that number
    journal = tmp_path / "plain" / "bench-plain-random-0" / "journal.log"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    trials = optuna.load_study(study_name="bench-plain-random-0", storage=storage).get_trials()
    proposals = plain.random_proposals(SPACE, 0, 4)
    started = [t for t in trials if t.state != optuna.trial.TrialState.WAITING]
    assert started and all(t.params == proposals[t.number] for t in started)


def test_an_unreachable_target_trains_until_the_budget_is_spent(manifest: str, tmp_path: Path) -> None:
    job = _job(manifest, tmp_path, arm="plain-tpe+sh", target=1.01, trials=50, seed=1)
    row = plain.run_plain_search(job)
    print(json.dumps(row))
    assert not row["reached"]
    assert row["epochs_to_target"] == row["epochs_trained"]
    # trials start below the budget and run to their end: at most budget - 1 + workers x epochs
    assert 6 <= row["epochs_trained"] <= 6 - 1 + 2 * 2
    assert row["seconds_to_target"] == pytest.approx(row["total_s"], abs=0.01)
    assert 0 < row["utilisation"] <= 1
    assert sum(row["trials"].values()) >= 3  # two epochs a trial at most: the budget took three or more
