"""Samplers, pruners, warm start and the search budget, on real Optuna studies (no training)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import optuna
import pytest

from mopflow.base.optuna_storage import make_storage
from mopflow.training.search.algorithms import REDUCTION_FACTOR, decision_epochs, make_pruner
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.rungs import Rungs
from mopflow.training.search.space import (
    SpaceError,
    default_space,
    optuna_params_for,
    parse_space,
    sample_params,
)
from mopflow.training.search.study import (
    WARM_START_ATTR,
    WarmStart,
    enqueue_grid,
    grid_configurations,
    grid_search_space,
    make_sampler,
    warm_start_study,
)
from tests.spaces import SMALL_SEARCH_SPACE

SPACE = SMALL_SEARCH_SPACE


def _objective_value(params: dict[str, Any]) -> float:
    """A cheap deterministic score: prefers wide CNNs with lr near 0.01."""
    import math

    bonus = 0.2 if params["family"] == "cnn" else 0.0
    return bonus + params["width"] / 100 - abs(math.log10(params["lr"]) + 2)


def _sweep(sampler: str, seed: int, n: int = 6) -> list[dict[str, Any]]:
    cfg = SearchConfig(n_trials=n, sampler=sampler, seed=seed, space=SPACE, grid_points=3)
    space = cfg.search_space()
    study = optuna.create_study(direction="maximize", sampler=make_sampler(cfg, space))
    if sampler == "grid":
        assert enqueue_grid(study, cfg, space) == n
    drawn = []
    for _ in range(n):
        trial = study.ask()
        params = sample_params(space, trial)
        drawn.append(params)
        study.tell(trial, _objective_value(params))
    return drawn


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid", "gp", "cmaes"])
def test_every_sampler_stays_in_the_space_and_is_seeded(sampler: str) -> None:
    first = _sweep(sampler, seed=7)
    space = parse_space(SPACE)
    for params in first:
        optuna_params_for(space, params)  # raises if any value left the space
    assert _sweep(sampler, seed=7) == first  # same seed, same configurations
    assert _sweep(sampler, seed=8) != first


def test_grid_holds_each_family_and_spaces_log_params_geometrically() -> None:
    grid = grid_search_space(parse_space(SPACE), points=3)
    assert grid["family"] == ["cnn", "mlp"]
    assert grid["cnn_width"] == [4, 16, 64]  # log-spaced ints
    assert grid["cnn_depth"] == [2, 3]  # an int range smaller than the points is taken whole
    assert grid["lr"] == pytest.approx([0.001, 0.01, 0.1])
    assert grid["batch_size"] == [32, 64]
    assert "weight_decay" not in grid  # not in the space: the default is used, not searched


def test_grid_of_a_conditional_space_has_no_duplicate_configurations() -> None:
    space = parse_space(SPACE)
    configs = grid_configurations(space, points=2, seed=0)
    # cnn: width 2 x depth 2, mlp: width 2 x depth 2; each x lr 2 x batch_size 2
    assert len(configs) == (2 * 2 + 2 * 2) * 2 * 2
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    assert all(set(c) >= {"family", "lr", "batch_size"} for c in configs)
    assert not [c for c in configs if c["family"] == "cnn" and "mlp_width" in c]
    assert grid_configurations(space, points=2, seed=0) == configs  # seeded order


def test_grid_search_asks_each_point_once_then_samples_at_random(tmp_path: Path) -> None:
    cfg = SearchConfig(n_trials=40, sampler="grid", space=SPACE, grid_points=2)
    space = cfg.search_space()
    study = optuna.create_study(
        storage=make_storage(str(tmp_path / "j.log")), sampler=make_sampler(cfg, space)
    )
    assert enqueue_grid(study, cfg, space) == 32
    assert enqueue_grid(study, cfg, space) == 0  # reopening the study does not enqueue twice
    seen = set()
    for _ in range(32):
        trial = study.ask()
        sample_params(space, trial)
        seen.add(tuple(sorted(trial.params.items())))
        study.tell(trial, 0.0)
    assert len(seen) == 32
    extra = study.ask()  # the grid is spent: random, still inside the space
    optuna_params_for(space, sample_params(space, extra))


def test_bad_sampler_or_pruner_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="sampler"):
        SearchConfig(sampler="bayes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pruner"):
        SearchConfig(pruner="early")  # type: ignore[arg-type]


def _pruned_at(pruner: Any, good: int, curve: list[float]) -> int | None:
    """After ``good`` finished trials that reported 0.9 at every epoch, a trial reports ``curve``
    and asks at each epoch, as training does; the epoch at which it is pruned, or None."""
    # A fixed study name: Hyperband assigns trials to brackets by a hash of the study name and the
    # trial number, and an in-memory study's default name is random.
    study = optuna.create_study(
        study_name="pruning-check",
        direction="maximize",
        pruner=pruner,
        sampler=optuna.samplers.RandomSampler(0),
    )
    for _ in range(good):
        trial = study.ask()
        for step in range(9):
            trial.report(0.9, step)
            trial.should_prune()  # records the rungs it reached, as a training trial does
        study.tell(trial, 0.9)
    trial = study.ask()
    for step, value in enumerate(curve):
        trial.report(value, step)
        if trial.should_prune():
            return step
    return None


@pytest.mark.parametrize("name", ["asha", "successive_halving", "hyperband", "median"])
def test_pruners_stop_a_clearly_worse_trial_only_after_min_resource(name: str) -> None:
    min_resource = 3
    pruned = _pruned_at(make_pruner(name, min_resource, 9), good=4, curve=[0.1] * 9)
    assert pruned is not None and min_resource - 1 <= pruned < 8
    assert _pruned_at(make_pruner(name, min_resource, 9), good=4, curve=[0.95] * 9) is None


@pytest.mark.parametrize("name", ["successive_halving", "hyperband"])
def test_optunas_rung_pruners_stop_trials_only_at_their_declared_decision_epochs(name: str) -> None:
    """``task`` trains the epochs between two decision points in one task, so a pruner must never
    stop a trial elsewhere: 40 trials of random curves, each asking after every epoch."""
    min_resource, epochs = 2, 20
    points = decision_epochs(name, min_resource, epochs)
    assert points == [3, 7, 19]  # steps 2, 6 and 18 (counted from 0) decide
    study = optuna.create_study(
        study_name="decision-points", direction="maximize", pruner=make_pruner(name, min_resource, epochs)
    )
    rng, stopped_after = random.Random(0), set()
    for _ in range(40):
        trial = study.ask()
        for step in range(epochs):
            trial.report(rng.random(), step)
            if trial.should_prune():
                stopped_after.add(step + 1)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                break
        else:
            study.tell(trial, 0.5)
    assert stopped_after and stopped_after <= set(points), stopped_after


def test_asha_decides_at_the_controllers_rungs_median_after_any_epoch_none_never() -> None:
    assert decision_epochs("asha", 3, 30) == Rungs(3, REDUCTION_FACTOR, 30).epochs() == [3, 9, 27]
    assert decision_epochs("median", 3, 30) is None
    assert decision_epochs("none", 3, 30) == []


def test_no_pruner_never_prunes() -> None:
    assert _pruned_at(make_pruner("none", 1, 9), good=4, curve=[0.0] * 9) is None


def test_hyperband_with_a_single_rung_degenerates_to_successive_halving() -> None:
    assert isinstance(make_pruner("hyperband", 5, 5), optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(make_pruner("hyperband", 1, 27), optuna.pruners.HyperbandPruner)


CHAMPION = {"family": "cnn", "width": 32, "depth": 3, "lr": 0.005, "weight_decay": 0.0, "batch_size": 64}


def test_warm_start_enqueues_the_champion_once(tmp_path: Path) -> None:
    storage = make_storage(str(tmp_path / "j.log"))
    study = optuna.create_study(study_name="w", storage=storage, direction="maximize")
    space = parse_space(SPACE)
    warm = WarmStart(CHAMPION, "m-student v3 (champion)")
    assert warm_start_study(study, space, warm)
    first = study.ask()
    assert sample_params(space, first) == {**CHAMPION, "weight_decay": 0.0}
    assert first.user_attrs[WARM_START_ATTR] == "m-student v3 (champion)"
    study.tell(first, 0.5)
    # A resumed or rerun search does not enqueue it again.
    assert not warm_start_study(study, space, warm)
    assert len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == 0


def test_warm_start_outside_the_space_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    study = optuna.create_study(storage=make_storage(str(tmp_path / "j.log")), direction="maximize")
    outside = {**CHAMPION, "width": 512}
    with caplog.at_level("WARNING"):
        assert not warm_start_study(study, parse_space(SPACE), WarmStart(outside, "m v1"))
    assert "cnn.width=512" in caplog.text
    assert not study.trials


def test_optuna_params_for_names_the_bad_value() -> None:
    with pytest.raises(SpaceError, match="family 'rnn'"):
        optuna_params_for(default_space(), {"family": "rnn"})
    with pytest.raises(SpaceError, match="lr=5.0"):
        optuna_params_for(parse_space(SPACE), {**CHAMPION, "lr": 5.0})


def test_the_registries_are_the_configs_choices_and_each_entry_builds() -> None:
    from mopflow.training.search.algorithms import PRUNERS, SAMPLERS
    from mopflow.training.search.config import SearchConfig
    from mopflow.training.search.sweep import STRATEGIES

    properties = SearchConfig.model_json_schema()["properties"]
    assert set(properties["sampler"]["enum"]) == set(SAMPLERS)
    assert set(properties["pruner"]["enum"]) == set(PRUNERS)
    assert set(properties["strategy"]["enum"]) == set(STRATEGIES)
    for name in SAMPLERS:
        assert isinstance(make_sampler(SearchConfig(sampler=name)), optuna.samplers.BaseSampler)
    for name in PRUNERS:
        assert isinstance(make_pruner(name, 2, 9), optuna.pruners.BasePruner)
    with pytest.raises(ValueError, match=r"unknown pruner 'bogus'; expected one of \['asha'"):
        make_pruner("bogus", 1)
