"""The search's controller: Optuna behind the executor interface, on real Optuna studies (no training)."""

from __future__ import annotations

import time

import optuna
import pytest

from mopflow.training.search.algorithms import make_pruner
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.controller import SearchController
from tests.spaces import SMALL_SEARCH_SPACE

SPACE = SMALL_SEARCH_SPACE


def test_executor_search_stops_asking_when_the_time_budget_is_spent() -> None:
    cfg = SearchConfig(n_trials=50, space=SPACE, timeout_minutes=0.001)  # 60 ms
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=50)
    assert len(controller.ask(2)) == 2  # the first models always start
    time.sleep(0.1)
    assert controller.new_models(3) == []
    assert len(study.trials) == 2


def _two_good_trials(controller: SearchController, study: optuna.Study, epochs: int) -> None:
    """Two trials asked, reported at 0.9 for ``epochs`` epochs and told COMPLETE: the median's
    yardstick."""
    for spec in controller.ask(2):
        trial = controller.trials[spec.model_id]
        for epoch in range(epochs):
            trial.report(0.9, epoch)
        study.tell(trial, 0.9)


def test_executor_search_prunes_in_the_coordinator() -> None:
    from mopflow.training.executors import EpochReport

    cfg = SearchConfig(n_trials=6, space=SPACE, pruner="median", min_resource=2)
    study = optuna.create_study(direction="maximize", pruner=make_pruner("median", 2, 10))
    controller = SearchController(study, cfg.search_space(), cfg, budget=6)
    _two_good_trials(controller, study, epochs=4)
    (bad,) = controller.ask(1)
    stopped_at = None
    for epoch in range(4):  # the executor stops a model the first time the controller says so
        if not controller.on_epoch_end(EpochReport(bad.model_id, epoch, 0.1, 1.0)):
            stopped_at = epoch
            break
    assert stopped_at is not None and stopped_at >= 1  # not judged at once, stopped past min_resource
    assert controller.pruned[bad.model_id] == stopped_at


def test_the_median_pruner_decides_only_past_its_warm_up() -> None:
    """The median pruner judges nothing in its first ``min_resource`` epochs, and the controller
    says so (``task`` hears those epochs late and ``mop`` trains them in one round); after them,
    every epoch is a decision."""
    from mopflow.training.executors import EpochReport

    cfg = SearchConfig(n_trials=6, epochs=6, space=SPACE, pruner="median", min_resource=3)
    study = optuna.create_study(direction="maximize", pruner=make_pruner("median", 3, 6))
    controller = SearchController(study, cfg.search_space(), cfg, budget=6)
    assert controller.decides_every_epoch
    assert [controller.next_decision(done) for done in range(6)] == [3, 3, 3, 4, 5, 6]
    _two_good_trials(controller, study, epochs=6)
    (bad,) = controller.ask(1)
    kept = [controller.on_epoch_end(EpochReport(bad.model_id, epoch, 0.1, 1.0)) for epoch in range(3)]
    assert kept == [True, True, False]  # the first epoch it may stop it after: the third


def test_an_epoch_trained_again_is_reported_to_optuna_once(recwarn: pytest.WarningsRecorder) -> None:
    from mopflow.training.executors import EpochReport

    cfg = SearchConfig(n_trials=2, space=SPACE, pruner="none")
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=2)
    (spec,) = controller.ask(1)
    for epoch, value in [(0, 0.5), (1, 0.6), (1, 0.61), (2, 0.7)]:  # epoch 1 redone after a lost worker
        assert controller.on_epoch_end(EpochReport(spec.model_id, epoch, value, 1.0))
    trial = study.trials[0]
    assert trial.intermediate_values == {0: 0.5, 1: 0.6, 2: 0.7}
    assert not [w for w in recwarn if "already reported" in str(w.message)]


def test_a_trial_reaching_the_goal_stops_new_trials_and_every_epoch_is_published() -> None:
    from mopflow.base import progress
    from mopflow.training.executors import EpochReport

    cfg = SearchConfig(n_trials=20, space=SPACE, pruner="none", goal_val_acc=0.95)
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=20)
    events: list[dict[str, object]] = []
    unsubscribe = progress.subscribe(events.append)
    try:
        first, second = controller.ask(2)
        assert controller.on_epoch_end(EpochReport(first.model_id, 0, 0.90, 1.0))
        assert len(controller.new_models(1)) == 1  # below the goal: the search goes on
        assert controller.on_epoch_end(EpochReport(second.model_id, 0, 0.96, 1.0))  # it trains on
    finally:
        unsubscribe()
    assert controller.new_models(3) == []
    assert len(study.trials) == 3
    assert [(e["model"], e["val_acc"]) for e in events if e["kind"] == "epoch"] == [
        (first.model_id, 0.90),
        (second.model_id, 0.96),
    ]


def test_extra_trials_for_the_ensemble_ignore_the_goal() -> None:
    from mopflow.training.executors import EpochReport

    cfg = SearchConfig(n_trials=4, space=SPACE, pruner="none", goal_val_acc=0.5)
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=4, respect_deadline=False)
    (spec,) = controller.ask(1)
    controller.on_epoch_end(EpochReport(spec.model_id, 0, 0.9, 1.0))
    assert len(controller.new_models(1)) == 1


def test_the_epoch_budget_stops_new_trials_once_spent_counting_each_epoch_once() -> None:
    from mopflow.training.executors import EpochReport

    cfg = SearchConfig(n_trials=50, space=SPACE, pruner="none", epoch_budget=3)
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=50)
    (spec,) = controller.ask(1)
    for epoch in (0, 1, 1):  # epoch 1 trained again after a lost worker: one epoch of the budget
        controller.on_epoch_end(EpochReport(spec.model_id, epoch, 0.5, 1.0))
    assert controller.epochs_trained == 2
    assert len(controller.new_models(1)) == 1
    (other,) = list(controller.trials.values())[1:]
    controller.on_epoch_end(EpochReport(f"trial-{other.number:04d}", 0, 0.5, 1.0))
    assert controller.new_models(2) == []
    assert len(study.trials) == 2


def test_asha_models_wait_at_a_rung_and_the_best_is_promoted_as_a_new_trial() -> None:
    """Under ``asha`` a model below the rung's top third stops and waits; once the rung fills, the
    best waiting model is continued by a new trial with its parameters, before any new model."""
    from mopflow.training.executors import EpochReport, ModelOutcome
    from mopflow.training.search.rungs import PROMOTED_ATTR
    from mopflow.training.search.study import MODEL_ATTR

    cfg = SearchConfig(n_trials=3, space=SPACE, pruner="asha", min_resource=1, epochs=3)
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=3)
    specs = controller.ask(3)
    for spec, value in zip(specs, [0.9, 0.5, 0.4], strict=True):
        assert not controller.on_epoch_end(EpochReport(spec.model_id, 0, value, 1.0))  # waits at rung 0
        controller.on_model_done(ModelOutcome(spec, stopped_early=True, checkpoint_uri="ckpt"))
        study.tell(controller.trials[spec.model_id], state=optuna.trial.TrialState.PRUNED)
    assert sorted(controller.waiting) == sorted(s.model_id for s in specs)
    (promoted,) = controller.ask(2)  # the trial budget is spent: only the promotion starts
    assert promoted == specs[0]
    trial = controller.trials[promoted.model_id]
    assert trial.number == 3 and trial.params == study.trials[0].params
    assert trial.user_attrs[MODEL_ATTR] == promoted.model_id and trial.user_attrs[PROMOTED_ATTR] == 0
    assert controller.on_epoch_end(EpochReport(promoted.model_id, 0, 0.9, 1.0))  # its history, again
    assert controller.epochs_trained == 3  # a handed-over epoch is not trained again
    assert controller.on_epoch_end(EpochReport(promoted.model_id, 1, 0.95, 1.0))
    assert controller.epochs_trained == 4 and study.trials[3].intermediate_values == {0: 0.9, 1: 0.95}
    assert controller.ask(1) == []  # the others stay below the top third


def test_asha_models_without_a_checkpoint_stop_for_good() -> None:
    from mopflow.training.executors import EpochReport, ModelOutcome

    cfg = SearchConfig(n_trials=3, space=SPACE, pruner="asha", min_resource=1, epochs=3)
    study = optuna.create_study(direction="maximize")
    controller = SearchController(study, cfg.search_space(), cfg, budget=3)
    for spec in controller.ask(3):
        assert not controller.on_epoch_end(EpochReport(spec.model_id, 0, 0.5, 1.0))
        controller.on_model_done(ModelOutcome(spec, stopped_early=True))  # nothing to resume from
        study.tell(controller.trials[spec.model_id], state=optuna.trial.TrialState.PRUNED)
    assert controller.waiting == {} and controller.ask(1) == []
    # nor does a restarted coordinator promote them: it rebuilds their rung, not their waiting
    after = SearchController(study, cfg.search_space(), cfg, budget=0)
    assert after.waiting == {} and after.rungs is not None and len(after.rungs.values[0]) == 3


def test_a_restarted_coordinator_promotes_the_models_that_waited_before_it() -> None:
    """The rungs and the waiting models are rebuilt from the study: a model stopped at a rung
    before the coordinator restarted is promoted once weaker new models fill its rung."""
    from mopflow.training.executors import EpochReport, ModelOutcome
    from mopflow.training.search.rungs import PROMOTED_ATTR

    cfg = SearchConfig(n_trials=4, space=SPACE, pruner="asha", min_resource=1, epochs=3)
    study = optuna.create_study(direction="maximize")
    before = SearchController(study, cfg.search_space(), cfg, budget=2)
    first = before.ask(2)
    for spec, value in zip(first, [0.9, 0.2], strict=True):
        assert not before.on_epoch_end(EpochReport(spec.model_id, 0, value, 1.0))
        before.on_model_done(ModelOutcome(spec, stopped_early=True, checkpoint_uri="ckpt"))
        study.tell(before.trials[spec.model_id], state=optuna.trial.TrialState.PRUNED)

    after = SearchController(study, cfg.search_space(), cfg, budget=2)  # the restarted coordinator
    assert after.waiting == {spec.model_id: spec for spec in first}
    assert after.rungs is not None and after.rungs.values == {
        0: {first[0].model_id: 0.9, first[1].model_id: 0.2}
    }
    new = after.ask(1)  # no waiting model is in the top third yet: a new trial
    assert [s.model_id for s in new] == ["trial-0002"]
    assert not after.on_epoch_end(EpochReport(new[0].model_id, 0, 0.3, 1.0))
    after.on_model_done(ModelOutcome(new[0], stopped_early=True, checkpoint_uri="ckpt"))
    study.tell(after.trials[new[0].model_id], state=optuna.trial.TrialState.PRUNED)
    (promoted,) = after.ask(1)  # the model that waited before the restart goes first
    assert promoted == first[0]
    assert after.trials[promoted.model_id].user_attrs[PROMOTED_ATTR] == 0
    assert after.on_epoch_end(EpochReport(promoted.model_id, 0, 0.9, 1.0))  # its history, again
    assert after.epochs_trained == 1  # only the new model's epoch was trained here
    assert [s.model_id for s in after.ask(1)] == ["trial-0004"]  # the promotion did not use the budget
    assert after.ask(1) == []
