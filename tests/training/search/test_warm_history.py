"""Warm start from earlier studies: which studies are learned from, what is copied, and how the
sampler, the rungs and the budget treat the copies."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from mopflow.base.optuna_storage import make_storage
from mopflow.training.executors import EpochReport, ModelOutcome
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.controller import SearchController
from mopflow.training.search.space import params_from_optuna, sample_params
from mopflow.training.search.study import STALE_ATTR
from mopflow.training.search.warm_history import (
    LEARNED_ATTR,
    SEARCH_KEY_ATTR,
    WARM_START_ATTR,
    dataset_identity,
    learn_from_earlier,
    own_trials,
    search_key,
)
from tests.spaces import SMALL_SEARCH_SPACE

CFG = SearchConfig(n_trials=4, space=SMALL_SEARCH_SPACE, pruner="asha", min_resource=1, epochs=3)
SPACE = CFG.search_space()
MANIFEST = {"dataset": "mnist1d", "modality": "sequence", "input_shape": [1, 40], "num_classes": 10}
KEY = search_key(dataset_identity(MANIFEST), SPACE, CFG.epochs)


def _earlier_study(storage: object, name: str, key: str, values: list[float | None]) -> optuna.Study:
    """A finished study under ``key``: one trial per value (None: a failed trial); the trial of the
    lowest value is pruned after its first epoch, the others complete their three."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")  # type: ignore[arg-type]
    study.set_user_attr(SEARCH_KEY_ATTR, key)
    lowest = min(v for v in values if v is not None)
    for value in values:
        trial = study.ask()
        sample_params(SPACE, trial)
        if value is None:
            study.tell(trial, state=TrialState.FAIL)
            continue
        trial.report(value / 2, 0)
        if value == lowest:
            study.tell(trial, state=TrialState.PRUNED)
            continue
        trial.report(value * 0.9, 1)
        trial.report(value, 2)
        study.tell(trial, value)
    return study


def test_the_key_names_the_dataset_the_space_and_the_epochs_not_the_rows() -> None:
    new_rows = MANIFEST | {"source": "other rows", "manifest_hash": "other", "splits": {}}
    assert search_key(dataset_identity(new_rows), SPACE, 3) == KEY
    other_space = SearchConfig().search_space()  # the packaged default space
    other_data = dataset_identity(MANIFEST | {"dataset": "file:///data/other.csv"})
    assert (
        len({KEY, search_key(other_data, SPACE, 3), search_key(dataset_identity(MANIFEST), other_space, 3)})
        == 3
    )
    assert search_key(dataset_identity(MANIFEST), SPACE, 4) != KEY


def test_a_new_study_learns_from_earlier_studies_of_the_same_key(tmp_path: Path) -> None:
    storage = make_storage(str(tmp_path / "j.log"))
    earlier = _earlier_study(storage, "monday", KEY, [0.7, 0.9, None, 0.5])
    _earlier_study(
        storage, "other-data", search_key(dataset_identity(MANIFEST | {"num_classes": 2}), SPACE, 3), [0.99]
    )
    study = optuna.create_study(study_name="tuesday", storage=storage, direction="maximize")

    assert learn_from_earlier(study, storage, KEY, studies=1) == 3  # the failed trial teaches nothing
    assert study.user_attrs[SEARCH_KEY_ATTR] == KEY  # the next study finds this one
    copies = [t for t in study.trials if LEARNED_ATTR in t.user_attrs]
    assert [t.user_attrs[LEARNED_ATTR] for t in copies] == ["monday#0", "monday#1", "monday#3"]
    assert [t.state for t in copies] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    assert copies[1].intermediate_values == earlier.trials[1].intermediate_values
    assert all("history" not in t.user_attrs for t in copies)  # nothing ties them to models
    # the best earlier configuration is tried first
    (first,) = own_trials(study.trials)
    assert first.state == TrialState.WAITING
    assert first.system_attrs["fixed_params"] == earlier.best_trial.params
    assert first.user_attrs[WARM_START_ATTR] == "study monday#1"


def test_a_resumed_study_learns_nothing_twice_and_zero_studies_is_off(tmp_path: Path) -> None:
    storage = make_storage(str(tmp_path / "j.log"))
    _earlier_study(storage, "monday", KEY, [0.7, 0.9])
    study = optuna.create_study(study_name="tuesday", storage=storage, direction="maximize")
    assert learn_from_earlier(study, storage, KEY, studies=2) == 2
    assert learn_from_earlier(study, storage, KEY, studies=2) == 0
    assert len(study.trials) == 3
    cold = optuna.create_study(study_name="cold", storage=storage, direction="maximize")
    assert learn_from_earlier(cold, storage, KEY, studies=0) == 0 and cold.trials == []
    assert cold.user_attrs[SEARCH_KEY_ATTR] == KEY


def test_only_the_newest_studies_are_learned_from_and_not_their_copies(tmp_path: Path) -> None:
    storage = make_storage(str(tmp_path / "j.log"))
    _earlier_study(storage, "s1", KEY, [0.6, 0.5])
    _earlier_study(storage, "s2", KEY, [0.7, 0.5])
    s3 = optuna.create_study(study_name="s3", storage=storage, direction="maximize")
    learn_from_earlier(s3, storage, KEY, studies=1)  # learns s2's two trials
    stale = s3.ask()
    sample_params(SPACE, stale)
    stale.set_user_attr(STALE_ATTR, True)
    s3.tell(stale, state=TrialState.FAIL)
    s4 = optuna.create_study(study_name="s4", storage=storage, direction="maximize")
    assert (
        learn_from_earlier(s4, storage, KEY, studies=2) == 2
    )  # s3's copies and failed trial are not its own
    assert {t.user_attrs[LEARNED_ATTR] for t in s4.trials if LEARNED_ATTR in t.user_attrs} == {"s2#0", "s2#1"}


def test_the_rungs_rank_new_models_among_the_copies(tmp_path: Path) -> None:
    storage = make_storage(str(tmp_path / "j.log"))
    _earlier_study(storage, "monday", KEY, [0.9, 0.8, 0.7, 0.6, 0.4])
    study = optuna.create_study(study_name="tuesday", storage=storage, direction="maximize")
    learn_from_earlier(study, storage, KEY, studies=1)
    controller = SearchController(study, SPACE, CFG, budget=4)
    assert controller.rungs is not None
    # rung 0 (after 1 epoch) holds the five earlier values: 0.45, 0.4, 0.35, 0.3, 0.2
    assert sorted(controller.rungs.values[0].values()) == [0.2, 0.3, 0.35, 0.4, 0.45]
    best, sampled = controller.ask(2)
    assert best.params == params_from_optuna(study.trials[0].params)  # the best earlier (0.9)
    assert controller.on_epoch_end(EpochReport(best.model_id, 0, 0.5, 1.0))  # above every copy: on
    assert not controller.on_epoch_end(EpochReport(sampled.model_id, 0, 0.38, 1.0))  # below the top third
    controller.on_model_done(ModelOutcome(sampled, stopped_early=True, checkpoint_uri="ckpt"))
    assert controller.waiting == {sampled.model_id: sampled}
    assert controller.started == 2  # the copies use none of the budget


def test_the_champion_s_configuration_is_not_enqueued_twice(tmp_path: Path) -> None:
    from mopflow.training.search.study import WarmStart, warm_start_study

    storage = make_storage(str(tmp_path / "j.log"))
    earlier = _earlier_study(storage, "monday", KEY, [0.7, 0.9])
    study = optuna.create_study(study_name="tuesday", storage=storage, direction="maximize")
    learn_from_earlier(study, storage, KEY, studies=1)
    champion = WarmStart(params_from_optuna(earlier.best_trial.params), "m-student v1 (champion)")
    assert not warm_start_study(study, SPACE, champion)  # the earlier best is that configuration
    other = WarmStart(params_from_optuna(earlier.trials[0].params), "m-student v2 (champion)")
    assert warm_start_study(study, SPACE, other)
    assert [t.user_attrs[WARM_START_ATTR] for t in own_trials(study.trials)] == [
        "study monday#1",
        "m-student v2 (champion)",
    ]
