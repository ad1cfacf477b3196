"""The search's say between epochs: Optuna's sampler and pruner behind the executor interface.

The coordinator (``training/search/sweep.py``) hands a :class:`SearchController` to the
executor: it asks the study for new trials as slots free up (until the trial budget or the time
budget is spent), reports every epoch to its trial, prunes there, and passes each finished model
on at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optuna

from mopflow.base import progress
from mopflow.base.fencing import Fence, unfenced
from mopflow.training.compute.devices import CPU, DeviceSpec
from mopflow.training.search.algorithms import REDUCTION_FACTOR, decision_epochs, keeps_waiting_rungs
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.rungs import PROMOTED_ATTR, WAITS_ATTR, Rungs, current
from mopflow.training.search.space import params_from_optuna, sample_params
from mopflow.training.search.study import MODEL_ATTR
from mopflow.training.search.warm_history import LEARNED_ATTR

if TYPE_CHECKING:
    from mopflow.training.executors import EpochReport, ModelOutcome, ModelSpec

log = logging.getLogger(__name__)


class SearchController:
    """Optuna behind the executor interface (a :class:`~mopflow.training.executors.base.Controller`), in
    the coordinator: every epoch report reaches the study as the executor hears it (under MOP at
    the end of the round), the pruner decides there, and a finished model is told at once (``on_done``), so the sampler and the pruner learn
    from it while the sweep goes on.

    Under ``pruner="asha"`` the controller keeps the rungs itself (:class:`~mopflow.training.search.rungs.Rungs`):
    a model stopped at a rung is told to the study as PRUNED, so the sampler learns from it, and
    waits there; when it later ranks in the rung's top third, it is promoted before any new trial
    starts: a new trial with its parameters continues its model from its checkpoint.
    """

    def __init__(
        self,
        study: optuna.Study,
        space: Any,
        cfg: SearchConfig,
        budget: int,
        prune: bool = True,
        on_done: Callable[[SearchController, ModelOutcome], None] | None = None,
        respect_deadline: bool = True,
        device: DeviceSpec = CPU,
        fence: Fence = unfenced,
    ) -> None:
        self.device, self.fence = device, fence
        self.study, self.space, self.cfg, self.budget = study, space, cfg, budget
        self.prune = prune and cfg.pruner != "none"
        self.on_done = on_done
        self.trials: dict[str, optuna.trial.Trial] = {}
        self.pruned: dict[str, int] = {}
        self.reported: dict[int, set[int]] = {}  # epochs each trial (by number) has had reported
        self.trained: dict[str, set[int]] = {}  # epochs each model has trained (replays excluded)
        self.rungs = (
            Rungs(cfg.first_rung, REDUCTION_FACTOR, cfg.epochs)
            if self.prune and keeps_waiting_rungs(cfg.pruner)
            else None
        )
        self.waiting: dict[str, ModelSpec] = {}  # models stopped at a rung that may be promoted
        self.waited_before: dict[str, optuna.trial.FrozenTrial] = {}  # their trials, before a restart
        self.started = 0  # new trials asked (promotions do not count against the budget)
        self.promoted_from: dict[int, int] = {}  # a promotion's trial number -> the trial it continues
        minutes = cfg.timeout_minutes if respect_deadline else None
        self.deadline = time.monotonic() + minutes * 60 if minutes else None
        self.goal = cfg.goal_val_acc if respect_deadline else None
        self.goal_reached = False
        self.epoch_budget = cfg.epoch_budget if respect_deadline else None
        self.epochs_trained = 0  # epochs reported over every trial (an epoch trained again: once)
        if self.rungs is not None:
            self._resume_rungs()

    def out_of_time(self) -> bool:
        """Whether the wall-clock budget is spent (running models finish; no new trial starts)."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def ask(self, count: int) -> list[ModelSpec]:
        """Up to ``count`` new trials from the study, as models to train (none once the trial
        budget, the epoch budget or, after the first trial, the time budget is spent, or once a trial
        reached the goal accuracy)."""

        specs: list[ModelSpec] = []
        if self.goal_reached:
            return specs
        if self.epoch_budget is not None and self.epochs_trained >= self.epoch_budget:
            if count > 0:
                log.info("search: epoch budget of %d spent; not starting more trials", self.epoch_budget)
            return specs
        if count > 0 and self.trials and self.out_of_time():
            log.info(
                "search: time budget of %.1f min reached; not starting more trials", self.cfg.timeout_minutes
            )
            return specs
        specs = self._promotions(count)
        count -= len(specs)
        while count > 0 and self.started < self.budget:
            self.fence()
            trial = self.study.ask()
            params = sample_params(self.space, trial)
            model_id = str(trial.user_attrs.get(MODEL_ATTR) or f"trial-{trial.number:04d}")
            trial.set_user_attr(MODEL_ATTR, model_id)
            self.trials[model_id], self.started = trial, self.started + 1
            specs.append(self._spec(model_id, params))
            log.info("search: started trial %d %s", trial.number, params)
            count -= 1
        return specs

    def _spec(self, model_id: str, params: dict[str, Any]) -> ModelSpec:
        """The model to train for ``model_id``, seeded by its number (a retry or a promotion of a
        model trains it on with the first attempt's seed)."""
        from mopflow.training.executors import ModelSpec

        number = int(model_id.rsplit("-", 1)[1])
        return ModelSpec(model_id, params, self.cfg.seed * 1000 + number, self.device)

    def _promotions(self, count: int) -> list[ModelSpec]:
        """Up to ``count`` waiting models now in their rung's top third, each continued by a new
        trial with its parameters (none while other enqueued trials wait: they come first)."""
        if self.rungs is None or not self.waiting or count <= 0:
            return []
        ready = self.rungs.promotable(self.waiting)[:count]
        if not ready or self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            return []
        specs = []
        for model_id in ready:
            self.fence()
            spec = self.waiting.pop(model_id)
            earlier = self.trials[model_id] if model_id in self.trials else self.waited_before.pop(model_id)
            attrs = {MODEL_ATTR: model_id, PROMOTED_ATTR: earlier.number}
            self.study.enqueue_trial(dict(earlier.params), user_attrs=attrs, skip_if_exists=False)
            trial = self.study.ask()
            sample_params(self.space, trial)  # records the enqueued parameters on the trial
            self.trials[model_id], self.promoted_from[trial.number] = trial, earlier.number
            self.pruned.pop(model_id, None)
            self.rungs.promote(model_id)
            log.info(
                "search: trial %d promotes trial %d's model %s from its rung at epoch %d",
                trial.number,
                earlier.number,
                model_id,
                len(self.trained.get(model_id, ())),
            )
            specs.append(spec)
        return specs

    def _resume_rungs(self) -> None:
        """The rungs of the study's earlier models, and those that wait at one (a coordinator that
        was restarted goes on promoting the models stopped before it). Trials learned from earlier
        studies hold their rung values too: new models are ranked among them."""
        assert self.rungs is not None
        for trial in current(self.study.get_trials(deepcopy=False)):
            model_id = trial.user_attrs.get(MODEL_ATTR, trial.user_attrs.get(LEARNED_ATTR))
            if model_id is None or not trial.intermediate_values:
                continue
            done = max(trial.intermediate_values) + 1  # epochs the model trained
            for rung, epochs in enumerate(self.rungs.epochs()):
                value = trial.intermediate_values.get(epochs - 1)
                if value is not None:
                    self.rungs.values.setdefault(rung, {})[model_id] = value
                    if done > epochs or trial.state != optuna.trial.TrialState.PRUNED:
                        self.rungs.promoted.setdefault(rung, set()).add(model_id)
            if trial.state == optuna.trial.TrialState.PRUNED and WAITS_ATTR in trial.user_attrs:
                self.waiting[model_id] = self._spec(str(model_id), params_from_optuna(trial.params))
                self.waited_before[model_id] = trial
                self.trained[model_id] = set(range(done))  # handed over again when promoted: not trained
        if self.waiting:
            log.info("search: %d model(s) of earlier attempts wait at a rung", len(self.waiting))

    @property
    def decides_every_epoch(self) -> bool:
        """Whether the pruner may stop a model after any epoch (it has no fixed points)."""
        return self.prune and decision_epochs(self.cfg.pruner, self.cfg.first_rung, self.cfg.epochs) is None

    def next_decision(self, epochs_done: int) -> int | None:
        """The next epoch count after which the pruner may stop a model that has trained
        ``epochs_done`` epochs (its rungs; every epoch past its warm-up for a pruner without fixed
        points, the median's; None without pruning): ``task`` trains the epochs up to it in one
        task, hearing only the decisions' epochs at once, and ``mop`` in one round."""
        points = decision_epochs(self.cfg.pruner, self.cfg.first_rung, self.cfg.epochs) if self.prune else []
        if points is None:  # every epoch once its warm-up (``min_resource`` epochs) is over
            return max(epochs_done + 1, self.cfg.first_rung)
        return next((point for point in points if point > epochs_done), None)

    def on_epoch_end(self, report: EpochReport) -> bool:
        """Report the epoch to its trial (once per epoch); False when the pruner stops it. An
        epoch the model trained before (a promoted model's history, handed over again) is
        reported to its new trial and decided no more."""
        trial = self.trials[report.model_id]
        reported = self.reported.setdefault(trial.number, set())
        if report.epoch not in reported:  # an epoch trained again after a lost worker: told once
            self.fence()
            trial.report(report.val_acc, report.epoch)
            reported.add(report.epoch)
        trained = self.trained.setdefault(report.model_id, set())
        if report.epoch in trained:
            return True
        trained.add(report.epoch)
        self.epochs_trained += 1
        progress.publish(
            "epoch", model=report.model_id, epoch=report.epoch, epochs=self.cfg.epochs, val_acc=report.val_acc
        )
        if self.goal is not None and not self.goal_reached and report.val_acc >= self.goal:
            self.goal_reached = True
            log.info(
                "search: %s reached the goal val_acc %.4f >= %.4f at epoch %d; not starting more trials",
                report.model_id,
                report.val_acc,
                self.goal,
                report.epoch,
            )
        if self.rungs is not None:
            rung = self.rungs.rung_at(report.epoch + 1)
            if rung is None or self.rungs.reach(rung, report.model_id, report.val_acc):
                return True
            self.pruned[report.model_id] = report.epoch
            return False
        if self.prune and trial.should_prune():
            self.pruned[report.model_id] = report.epoch
            return False
        return True

    def on_model_done(self, outcome: ModelOutcome) -> None:
        """Pass a finished model on (``on_done``: tell its trial to the study at once). A model
        stopped at a rung waits there when it can resume (it has a checkpoint)."""
        model_id = outcome.spec.model_id
        if (
            self.rungs is not None
            and model_id in self.pruned
            and outcome.error is None
            and outcome.checkpoint_uri
            and model_id not in self.waiting
        ):
            self.waiting[model_id] = outcome.spec
            self.fence()
            try:  # recorded on the trial, so that a restarted coordinator finds it waiting
                self.trials[model_id].set_user_attr(WAITS_ATTR, outcome.checkpoint_uri)
            except optuna.exceptions.UpdateFinishedTrialError:
                log.debug("search: trial of %s already told; a restart will not find it waiting", model_id)
        if self.on_done is not None:
            self.on_done(self, outcome)

    def new_models(self, free_slots: int) -> list[ModelSpec]:
        """New trials for the free slots."""
        return self.ask(free_slots)
