"""The search over an executor (``task``, ``mop``, ``ddp``), the one place a strategy is chosen.

Optuna stays in the coordinator behind the executor interface (``training/search/controller.py``):
every epoch report reaches the study as the executor hears it (under ``mop``: a round's reports at
the end of the round), the pruner decides there, and a finished model is told at once, so the sampler and the pruner learn from it while the sweep goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack, get_args

import optuna

from mopflow.base import progress, storage
from mopflow.base.fencing import Fence
from mopflow.training.compute.cluster import forward_worker_logs
from mopflow.training.compute.devices import CPU, DeviceSpec
from mopflow.training.compute.workers import cluster_workers
from mopflow.training.data.ref import DataRef
from mopflow.training.executors.base import Executor, ModelOutcome, pass_seconds, task_parts, task_seconds
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.controller import SearchController
from mopflow.training.search.names import StrategyName
from mopflow.training.search.scaling import RoundScaling, round_scaling, with_spot_replay
from mopflow.training.search.study import (
    SearchOutcome,
    WarmStart,
    open_study,
    result_detail,
    tell_result,
)
from mopflow.training.search.trial import TrialResult
from mopflow.training.trainable.unit import ModelSpec
from mopflow.training.volatile.preempt import register_preemption

log = logging.getLogger(__name__)


class SearchOptions(TypedDict, total=False):
    """The keyword settings both search entry points take (defaults: :data:`DEFAULT_OPTIONS`)."""

    on_trial_done: Callable[[TrialResult], None] | None  # called with each trial the moment it is told
    warm_start: WarmStart | None  # a known-good configuration to try first
    min_complete: int  # COMPLETE trials the ensemble needs: extra trials run without pruning till then
    device: DeviceSpec  # what every trial trains on
    study_attrs: Mapping[str, Any]  # user attributes of the study: what run it belongs to


DEFAULT_OPTIONS = SearchOptions(on_trial_done=None, warm_start=None, min_complete=1, device=CPU)


def run_search_with_executor(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    artifact_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
    checkpoint_root: str = "",
    **options: Unpack[SearchOptions],
) -> SearchOutcome:
    """The search over the strategy's executor: ask-and-tell in this process; the executor
    reports every model's validation accuracy after each epoch, and each model is told to Optuna
    (its bundle written, ``on_trial_done`` called) the moment it finishes or is pruned; the freed
    slot goes to a new trial sampled with that knowledge, which starts at once (task, DDP) or joins
    at the next round (MOP). Checkpoints go under ``checkpoint_root`` ("": none).

    If pruning left fewer than ``min_complete`` COMPLETE trials (the ensemble needs its members),
    extra trials run with pruning off until there are enough (at most ``2 * min_complete``).
    Under ``cfg.spot_trace`` the trace is replayed against the cluster while it runs.
    """
    return with_spot_replay(
        cfg,
        client,
        storage_options,
        lambda: _search(
            cfg, manifest_uri, study_name, storage_url, artifact_root, client, storage_options,
            checkpoint_root, SearchOptions(**{**DEFAULT_OPTIONS, **options}),
        ),
    )  # fmt: skip


def _search(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    artifact_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None,
    checkpoint_root: str,
    opts: SearchOptions,
) -> SearchOutcome:
    from mopflow.training.data import load_manifest
    from mopflow.training.models.families import DataSpec

    study, space, already, results, lease = open_study(
        cfg, manifest_uri, study_name, storage_url, storage_options, opts["warm_start"], client,
        opts.get("study_attrs"),
    )  # fmt: skip
    budget = max(cfg.n_trials - len(already), 0)
    progress.publish("search", total=cfg.n_trials, finished=len(already))
    manifest = load_manifest(manifest_uri, storage_options)
    data = DataRef(manifest_uri, DataSpec.from_manifest(manifest), dict(storage_options or {}), cfg.augment)
    shards = [e["name"] for e in manifest["splits"]["train"]]
    scaling = round_scaling(cfg, client)  # worker_schedule: n_j workers per round
    setting = ExecutorSetting(cfg, client, data, shards, checkpoint_root, scaling, opts["device"])
    executor = strategy_executor(setting)
    executor.fence = lease.check  # no checkpoint moves into place once a later attempt took over
    forward_worker_logs(client)
    sweep = _Sweep(cfg, study, space, executor, artifact_root, study_name, opts, results, lease.check)
    workers = len(cluster_workers(client))
    started = time.monotonic()
    sweep.run(budget, opts["min_complete"])
    wall = time.monotonic() - started
    busy = pass_seconds(executor.records)
    outcome = SearchOutcome(
        study_name,
        storage_url,
        sorted(results, key=lambda r: r.number),
        dict(getattr(executor, "epoch_records", {})),
        worker_rounds=tuple(scaling.history),
        busy_s=busy or 0.0,
        task_s=task_seconds(executor.records) or 0.0,
        task_parts=task_parts(executor.records),
        wall_s=wall,
        workers=workers if busy is not None else 0,  # untimed passes: no utilisation
        unit_records=list(executor.records),
    )
    busy_share = outcome.utilisation
    log.info(
        "search: %s executor finished %d trials in %.0fs%s",
        cfg.strategy,
        len(sweep.told),
        wall,
        f"; its workers were {busy_share:.0%} of it in training and validation passes" if busy_share else "",
    )
    return outcome


def run_strategy_search(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    artifact_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
    **options: Unpack[SearchOptions],
) -> SearchOutcome:
    """The search of ``cfg.strategy`` through its executor, with checkpoints under
    ``<artifact_root>/checkpoints/<study>`` (one folder per model)."""
    return run_search_with_executor(
        cfg, manifest_uri, study_name, storage_url, artifact_root, client, storage_options,
        checkpoint_root=storage.join(artifact_root, "checkpoints", study_name), **options,
    )  # fmt: skip


@dataclass
class _Sweep:
    """One search in progress: trials asked in batches, each told to Optuna as its model is done."""

    cfg: SearchConfig
    study: optuna.Study
    space: Any
    executor: Executor
    artifact_root: str
    study_name: str
    options: SearchOptions
    results: list[TrialResult]  # every finished trial that counts (those of earlier attempts first)
    fence: Fence  # raises Superseded once a later attempt drives the study
    told: set[int] = field(default_factory=set)  # numbers of the trials told
    extra_trials: int = 0  # trials run past the budget for the ensemble (counted in the total)

    def run(self, budget: int, min_complete: int) -> None:
        """``budget`` trials; then, while fewer than ``min_complete`` are COMPLETE, more without
        pruning (at most ``2 * min_complete``)."""
        if budget > 0:
            self.run_batch(budget, prune=True, respect_deadline=True)
        while True:
            missing = min_complete - sum(1 for r in self.results if r.state == "COMPLETE")
            if budget == 0 or missing <= 0 or self.extra_trials >= 2 * min_complete:
                return
            log.warning(
                "search: only %d COMPLETE trial(s), %d needed; running %d more without pruning",
                min_complete - missing,
                min_complete,
                missing,
            )
            self.extra_trials += missing
            progress.publish(
                "search",
                total=self.cfg.n_trials + self.extra_trials,
                finished=len(self.results),
                extra=missing,
                complete=min_complete - missing,
                needed=min_complete,
            )
            self.run_batch(missing, prune=False, respect_deadline=False)

    def run_batch(self, count: int, prune: bool, respect_deadline: bool) -> None:
        """``count`` trials through the executor, each told the moment its model is done."""
        controller = SearchController(
            self.study,
            self.space,
            self.cfg,
            count,
            prune=prune,
            on_done=self.finish,
            respect_deadline=respect_deadline,
            device=self.options["device"],
            fence=self.fence,
        )
        first = controller.ask(STRATEGIES[self.cfg.strategy].first_models(self.cfg))
        outcomes = self.executor.run(first, self.cfg.epochs, controller)
        for _, outcome in sorted(outcomes.items()):  # any model the executor did not report done
            self.finish(controller, outcome)

    def finish(self, controller: SearchController, outcome: ModelOutcome) -> None:
        """Tell Optuna, write the bundle and the trial's record: at once, while the sweep goes on."""
        trial = controller.trials[outcome.spec.model_id]
        if trial.number in self.told:
            return
        self.told.add(trial.number)
        result = self.result_of(controller, outcome)
        self.fence()
        if not tell_result(self.study, trial, result):
            return
        earlier = controller.promoted_from.get(trial.number)  # its model's trial before, superseded
        self.results[:] = [r for r in self.results if r.number != earlier]
        self.results.append(result)
        cfg = self.cfg
        log.info(
            "search: trial %d %s %s after %d epochs (%s) — %d/%d finished",
            result.number,
            result.state,
            result_detail(result),
            len(result.history),
            cfg.strategy,
            len(self.results),
            cfg.n_trials,
        )
        progress.publish(
            "trial",
            model=outcome.spec.model_id,
            number=result.number,
            family=str(result.params.get("family", "")),
            state=result.state,
            epoch=len(result.history),
            epochs=cfg.epochs,
            value=result.value,
            continues=earlier,
            finished=len(self.results),
            total=cfg.n_trials + self.extra_trials,
        )
        on_trial_done = self.options["on_trial_done"]
        if on_trial_done is not None:
            on_trial_done(result)

    def result_of(self, controller: SearchController, outcome: ModelOutcome) -> TrialResult:
        """A finished model as a trial result; its bundle is written when it has a usable state."""
        from mopflow.training.executors.units import state_to_bundle

        executor, data, model_id = self.executor, self.executor.data, outcome.spec.model_id
        trial = controller.trials[model_id]
        history = [
            {"epoch": r.epoch, "val_acc": r.val_acc, "train_loss": r.train_loss} for r in outcome.history
        ]
        bundle_uri = None
        if outcome.state is not None and outcome.error is None:
            bundle_uri = storage.join(
                self.artifact_root, "studies", self.study_name, f"trial-{trial.number:04d}"
            )
            state_to_bundle(outcome.spec, outcome.state, data, bundle_uri)
        state = (
            "FAIL"
            if outcome.error or not history
            else ("PRUNED" if model_id in controller.pruned else "COMPLETE")
        )
        resumed = getattr(executor, "resumed", {}).get(model_id, {})
        records = executor.records_of(model_id)
        started = getattr(executor, "started_at", {}).get(model_id)
        return TrialResult(
            number=trial.number,
            params=dict(outcome.spec.params),
            state=state,
            value=history[-1]["val_acc"] if history else None,
            history=history,
            bundle_uri=bundle_uri,
            pruned_epoch=controller.pruned.get(model_id),
            error=outcome.error,
            duration_s=time.time() - started if started else 0.0,
            worker=", ".join(sorted({str(r["worker"]) for r in records})) or self.cfg.strategy,
            num_params=_num_params(outcome.spec, data),
            resumed_from_epoch=resumed.get("epoch"),
            resumed_from_step=resumed.get("step"),
            resumed_after_notice_at_step=resumed.get("step") if resumed.get("after_notice") else None,
            redone_s=sum(float(i["redone_s"]) for i in executor.interruptions if i["model"] == model_id),
        )


def _num_params(spec: ModelSpec, data: DataRef) -> int:
    """The parameters of the model ``spec`` builds on this data."""
    from mopflow.training.models.builtin import ArchSpec, count_params

    return count_params(ArchSpec.from_params(dict(spec.params), data.spec))


# -- the strategies' executors ---------------------------------------------------------------


@dataclass(frozen=True)
class ExecutorSetting:
    """What every strategy's executor is made from: the search config, the cluster, the data, its
    training shards, where checkpoints go, the worker rounds and the device the models train on."""

    cfg: SearchConfig
    client: Any
    data: DataRef
    shards: list[str]
    checkpoint_root: str
    scaling: RoundScaling
    device: DeviceSpec = CPU


def _task_executor(s: ExecutorSetting) -> Executor:
    from mopflow.training.executors.task import TaskExecutor

    register_preemption(s.client)  # spot notices: epochs checkpoint mid-pass and move on
    return TaskExecutor(
        s.client,
        s.data,
        s.shards,
        s.checkpoint_root,
        slots=s.cfg.parallel_trials,
        admission=s.scaling,
        batches=s.cfg.trial_batches,
    )


def _mop_executor(s: ExecutorSetting) -> Executor:
    from mopflow.training.executors.mop import MopExecutor

    register_preemption(s.client)  # spot notices: units checkpoint mid-pass and move on
    return MopExecutor(
        s.client, s.data, s.shards, s.checkpoint_root, seed=s.cfg.seed, slots=s.cfg.model_slots,
        schedule=s.cfg.mop_schedule, lookahead=s.cfg.mop_lookahead, ask_ahead=s.cfg.mop_ask_ahead,
        resources=s.device.resources(),  # a GPU sweep's partitions live on its GPU workers only
        # under a spot replay the cluster has one worker per bid, priced out or not at the start
        partitions=s.scaling.partitions() or (len(s.cfg.spot_bids or ()) if s.cfg.spot_trace else None),
        before_round=s.scaling.round_hook(),
    )  # fmt: skip


def _ddp_executor(s: ExecutorSetting) -> Executor:
    from mopflow.training.executors.ddp import DDPExecutor

    register_preemption(s.client)  # spot notices: every rank of a job checkpoints at the same batch
    return DDPExecutor(
        s.client,
        s.data,
        s.cfg.ddp_world_size,
        s.checkpoint_root,
        bf16_compress=s.cfg.bf16_compress,
        collective_timeout_s=s.cfg.ddp_collective_timeout_s,
    )


@dataclass(frozen=True)
class Strategy:
    """A strategy the config can name: the executor that trains its models, and how many models
    the search asks for before the executor starts (the rest it admits as it goes)."""

    executor: Callable[[ExecutorSetting], Executor]
    first_models: Callable[[SearchConfig], int]


# strategy name -> how it trains (names: mopflow.training.search.names.StrategyName)
STRATEGIES: dict[str, Strategy] = {
    # task and DDP admit trials themselves as slots (gangs of workers) free up; MOP starts with its slots
    "task": Strategy(_task_executor, lambda cfg: 0),
    "mop": Strategy(_mop_executor, lambda cfg: cfg.model_slots),
    "ddp": Strategy(_ddp_executor, lambda cfg: 1),
}
if set(STRATEGIES) != set(get_args(StrategyName)):
    raise ImportError("mopflow.training.search.sweep: STRATEGIES and StrategyName disagree")


def strategy_executor(setting: ExecutorSetting) -> Executor:
    """The executor of ``setting.cfg.strategy`` (from :data:`STRATEGIES`)."""
    return STRATEGIES[setting.cfg.strategy].executor(setting)
