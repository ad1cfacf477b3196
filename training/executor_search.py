"""The search over an executor (``task``, ``mop``, ``ddp``), the one place a strategy is chosen.

Optuna stays in the coordinator behind the executor interface: every epoch report reaches the
study when it happens, the pruner decides there, and a finished model is told at once, so the
sampler and the pruner learn from it while the sweep goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, get_args

import optuna

from infra import progress, storage
from training.algorithms import StrategyName
from training.config import SearchConfig
from training.devices import CPU, DeviceSpec
from training.search import (
    MODEL_ATTR,
    SearchOutcome,
    WarmStart,
    open_study,
    register_preemption,
    result_detail,
    tell_result,
)
from training.space import sample_params
from training.trial import TrialResult, shard_cache_dir
from training.volatile.scaling import round_scaling, with_spot_replay

log = logging.getLogger(__name__)


class _SearchController:
    """Optuna behind the executor interface, in the coordinator: every epoch report reaches the
    study when it happens, the pruner decides there, and a finished model is told at once
    (``on_done``), so the sampler and the pruner learn from it while the sweep goes on."""

    def __init__(
        self,
        study: optuna.Study,
        space: Any,
        cfg: SearchConfig,
        budget: int,
        prune: bool = True,
        on_done: Callable[[_SearchController, Any], None] | None = None,
        respect_deadline: bool = True,
        device: DeviceSpec = CPU,
    ) -> None:
        self.device = device
        self.study, self.space, self.cfg, self.budget = study, space, cfg, budget
        self.prune = prune and cfg.pruner != "none"
        self.on_done = on_done
        self.trials: dict[str, optuna.trial.Trial] = {}
        self.pruned: dict[str, int] = {}
        self.reported: dict[str, set[int]] = {}  # epochs each model's trial has had reported
        minutes = cfg.timeout_minutes if respect_deadline else None
        self.deadline = time.monotonic() + minutes * 60 if minutes else None

    def out_of_time(self) -> bool:
        """Whether the wall-clock budget is spent (running models finish; no new trial starts)."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def ask(self, count: int) -> list[Any]:
        from training.executors import ModelSpec

        specs: list[Any] = []
        if count > 0 and self.trials and self.out_of_time():
            log.info(
                "search: time budget of %.1f min reached; not starting more trials", self.cfg.timeout_minutes
            )
            return specs
        while count > 0 and len(self.trials) < self.budget:
            trial = self.study.ask()
            params = sample_params(self.space, trial)
            model_id = str(trial.user_attrs.get(MODEL_ATTR) or f"trial-{trial.number:04d}")
            trial.set_user_attr(MODEL_ATTR, model_id)
            self.trials[model_id] = trial
            number = int(model_id.rsplit("-", 1)[1])  # a retry trains the first attempt's model on
            specs.append(ModelSpec(model_id, params, self.cfg.seed * 1000 + number, self.device))
            log.info("search: started trial %d %s", trial.number, params)
            count -= 1
        return specs

    def on_epoch_end(self, report: Any) -> bool:
        trial = self.trials[report.model_id]
        progress.publish("epoch", model=report.model_id, epoch=report.epoch, epochs=self.cfg.epochs)
        reported = self.reported.setdefault(report.model_id, set())
        if report.epoch not in reported:  # an epoch trained again after a lost worker: told once
            trial.report(report.val_acc, report.epoch)
            reported.add(report.epoch)
        if self.prune and trial.should_prune():
            self.pruned[report.model_id] = report.epoch
            return False
        return True

    def on_model_done(self, outcome: Any) -> None:
        if self.on_done is not None:
            self.on_done(self, outcome)

    def new_models(self, free_slots: int) -> list[Any]:
        return self.ask(free_slots)


@with_spot_replay
def run_search_with_executor(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    artifact_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
    on_trial_done: Callable[[TrialResult], None] | None = None,
    checkpoint_root: str = "",
    warm_start: WarmStart | None = None,
    min_complete: int = 1,
    device: DeviceSpec = CPU,
) -> SearchOutcome:
    """The search over the strategy's executor: ask-and-tell in this process; the executor
    reports every model's validation accuracy after each epoch, and each model is told to Optuna
    (its bundle written, ``on_trial_done`` called) the moment it finishes or is pruned; the freed
    slot goes to a new trial sampled with that knowledge, which starts at once (task, DDP) or joins
    at the next round (MOP).

    If pruning left fewer than ``min_complete`` COMPLETE trials (the ensemble needs its members),
    extra trials run with pruning off until there are enough (at most ``2 * min_complete``).
    """
    from training.data import load_manifest
    from training.executors import DataRef

    study, space, already, results = open_study(
        cfg, manifest_uri, study_name, storage_url, storage_options, warm_start, client
    )
    budget = max(cfg.n_trials - len(already), 0)
    progress.publish("search", total=cfg.n_trials, finished=len(already))
    data = DataRef(manifest_uri, dict(storage_options or {}), shard_cache_dir())
    shards = [e["name"] for e in load_manifest(manifest_uri, storage_options)["splits"]["train"]]
    scaling = round_scaling(cfg, client)  # worker_schedule: n_j workers per round
    executor = _strategy_executor(cfg, client, data, shards, checkpoint_root, scaling)
    try:  # show the workers' per-epoch progress in this (task) log
        client.forward_logging("training", level=logging.INFO)
    except Exception:  # an older scheduler without log forwarding still trains
        log.debug("worker log forwarding unavailable")
    told: set[str] = set()

    def finish(controller: _SearchController, outcome: Any) -> None:
        """Tell Optuna, write the bundle and the trial's record: at once, while the sweep goes on."""
        if outcome.spec.model_id in told:
            return
        told.add(outcome.spec.model_id)
        result = _executor_result(cfg, controller, outcome, data, artifact_root, study_name, executor)
        if not tell_result(study, controller.trials[outcome.spec.model_id], result):
            return
        results.append(result)
        log.info(
            "search: trial %d %s %s after %d epochs (%s) — %d/%d finished",
            result.number,
            result.state,
            result_detail(result),
            len(result.history),
            cfg.strategy,
            len(results),
            cfg.n_trials,
        )
        progress.publish(
            "trial",
            model=outcome.spec.model_id,
            number=result.number,
            state=result.state,
            value=result.value,
            finished=len(results),
            total=cfg.n_trials,
        )
        if on_trial_done is not None:
            on_trial_done(result)

    def run_batch(count: int, prune: bool, respect_deadline: bool) -> None:
        controller = _SearchController(
            study,
            space,
            cfg,
            count,
            prune=prune,
            on_done=finish,
            respect_deadline=respect_deadline,
            device=device,
        )
        # task admits trials itself as slots free up; MOP starts with its slots, DDP with one job
        first = controller.ask({"task": 0, "mop": cfg.model_slots}.get(cfg.strategy, 1))
        outcomes = executor.run(first, cfg.epochs, controller)
        for _, outcome in sorted(outcomes.items()):  # any model the executor did not report done
            finish(controller, outcome)

    started = time.monotonic()
    if budget > 0:
        run_batch(budget, prune=True, respect_deadline=True)
    extra_attempts = 0
    while True:
        missing = min_complete - sum(1 for r in results if r.state == "COMPLETE")
        if budget == 0 or missing <= 0 or extra_attempts >= 2 * min_complete:
            break
        log.warning(
            "search: only %d COMPLETE trial(s), %d needed; running %d more without pruning",
            min_complete - missing,
            min_complete,
            missing,
        )
        run_batch(missing, prune=False, respect_deadline=False)
        extra_attempts += missing
    epoch_records: dict[int, list[dict[str, Any]]] = dict(getattr(executor, "epoch_records", {}))
    log.info(
        "search: %s executor finished %d trials in %.0fs",
        cfg.strategy,
        len(told),
        time.monotonic() - started,
    )
    return SearchOutcome(
        study_name,
        storage_url,
        sorted(results, key=lambda r: r.number),
        epoch_records,
        worker_rounds=tuple(scaling.history),
    )


def run_strategy_search(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    artifact_root: str,
    client: Any,
    storage_options: Mapping[str, Any] | None = None,
    on_trial_done: Callable[[TrialResult], None] | None = None,
    warm_start: WarmStart | None = None,
    min_complete: int = 1,
    device: DeviceSpec = CPU,
) -> SearchOutcome:
    """The search of ``cfg.strategy`` through its executor, with checkpoints under
    ``<artifact_root>/checkpoints/<study>`` (one folder per model)."""
    return run_search_with_executor(
        cfg,
        manifest_uri,
        study_name,
        storage_url,
        artifact_root,
        client,
        storage_options,
        on_trial_done=on_trial_done,
        checkpoint_root=storage.join(artifact_root, "checkpoints", study_name),
        warm_start=warm_start,
        min_complete=min_complete,
        device=device,
    )


def _task_executor(
    cfg: SearchConfig, client: Any, data: Any, shards: list[str], checkpoint_root: str, scaling: Any
) -> Any:
    from training.executors.task import TaskExecutor

    register_preemption(client)  # spot notices: epochs checkpoint mid-pass and move on
    return TaskExecutor(client, data, shards, checkpoint_root, slots=cfg.parallel_trials, admission=scaling)


def _mop_executor(
    cfg: SearchConfig, client: Any, data: Any, shards: list[str], checkpoint_root: str, scaling: Any
) -> Any:
    from training.executors.mop import MopExecutor

    register_preemption(client)  # spot notices: units checkpoint mid-pass and move on
    return MopExecutor(
        client,
        data,
        shards,
        checkpoint_root,
        seed=cfg.seed,
        slots=cfg.model_slots,
        partitions=scaling.partitions(),
        before_round=scaling.round_hook(),
    )


def _ddp_executor(
    cfg: SearchConfig, client: Any, data: Any, shards: list[str], checkpoint_root: str, scaling: Any
) -> Any:
    from training.executors.ddp import DDPExecutor

    return DDPExecutor(client, data, cfg.ddp_world_size, checkpoint_root, bf16_compress=cfg.bf16_compress)


# strategy name -> the executor that trains its models (names: training.algorithms.StrategyName)
STRATEGY_EXECUTORS: dict[str, Callable[..., Any]] = {
    "task": _task_executor,
    "mop": _mop_executor,
    "ddp": _ddp_executor,
}
if set(STRATEGY_EXECUTORS) != set(get_args(StrategyName)):
    raise ImportError("training.executor_search: STRATEGY_EXECUTORS and StrategyName disagree")


def _strategy_executor(
    cfg: SearchConfig, client: Any, data: Any, shards: list[str], checkpoint_root: str, scaling: Any
) -> Any:
    """The executor of ``cfg.strategy`` (from :data:`STRATEGY_EXECUTORS`)."""
    return STRATEGY_EXECUTORS[cfg.strategy](cfg, client, data, shards, checkpoint_root, scaling)


def _executor_result(
    cfg: SearchConfig,
    controller: _SearchController,
    outcome: Any,
    data: Any,
    artifact_root: str,
    study_name: str,
    executor: Any,
) -> TrialResult:
    """A finished model as a trial result; its bundle is written when it has a usable state."""
    from training.data import load_manifest
    from training.executors.units import state_to_bundle
    from training.families import DataSpec
    from training.models import ArchSpec, count_params

    model_id = outcome.spec.model_id
    manifest = load_manifest(data.manifest_uri, data.storage_options)
    arch = ArchSpec.from_params(dict(outcome.spec.params), DataSpec.from_manifest(manifest))
    resumed = getattr(executor, "resumed", {}).get(model_id, {})
    records = [r for r in executor.records if r.get("model") == model_id]
    started = getattr(executor, "started_at", {}).get(model_id)
    trial = controller.trials[model_id]
    history = [{"epoch": r.epoch, "val_acc": r.val_acc, "train_loss": r.train_loss} for r in outcome.history]
    bundle_uri = None
    if outcome.state is not None and outcome.error is None:
        bundle_uri = storage.join(artifact_root, "studies", study_name, f"trial-{trial.number:04d}")
        state_to_bundle(outcome.spec, outcome.state, data, bundle_uri)
    state = (
        "FAIL"
        if outcome.error or not history
        else ("PRUNED" if model_id in controller.pruned else "COMPLETE")
    )
    return TrialResult(
        number=trial.number,
        trial_id=trial._trial_id,
        params=dict(outcome.spec.params),
        state=state,
        value=history[-1]["val_acc"] if history else None,
        history=history,
        bundle_uri=bundle_uri,
        pruned_epoch=controller.pruned.get(model_id),
        error=outcome.error,
        duration_s=time.time() - started if started else 0.0,
        worker=", ".join(sorted({str(r["worker"]) for r in records})) or cfg.strategy,
        num_params=count_params(arch),
        resumed_from_epoch=resumed.get("epoch"),
        resumed_from_step=resumed.get("step"),
        resumed_after_notice_at_step=resumed.get("step") if resumed.get("after_notice") else None,
        redone_s=sum(
            float(i["redone_s"]) for i in getattr(executor, "interruptions", []) if i["model"] == model_id
        ),
    )
