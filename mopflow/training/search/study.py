"""The Optuna study the coordinators share: samplers and the grid, warm start, stale-trial
recovery, opening a study and telling it results.

The coordinator is ``training/search/sweep.py``: every strategy (``task``, ``mop``, ``ddp``)
trains through its executor and is told to the study from there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from mopflow.base import storage
from mopflow.base.optuna_storage import make_storage, quiet_optuna
from mopflow.training.data import verify_manifest
from mopflow.training.search.algorithms import enqueues_grid, make_pruner, make_sampler
from mopflow.training.search.config import SearchConfig
from mopflow.training.search.lease import StudyLease
from mopflow.training.search.rungs import current
from mopflow.training.search.scaling import RoundScale
from mopflow.training.search.space import SearchSpace, SpaceError, optuna_params_for, params_from_optuna
from mopflow.training.search.trial import TrialResult
from mopflow.training.search.warm_history import (
    WARM_START_ATTR,
    best_params,
    dataset_identity,
    is_learned,
    learn_from_earlier,
    own_trials,
    search_key,
)

if TYPE_CHECKING:
    from mopflow.training.volatile.spot_report import SpotReport

log = logging.getLogger(__name__)

STALE_ATTR = "mopflow_stale_retried"
RESUME_ATTR = "mopflow_resume_from"
# the executor's id of a trial's model, which keys its checkpoints; a retry keeps it, so
# a restarted coordinator's retried trial resumes its model from the last sub-epoch or epoch.
MODEL_ATTR = "mopflow_model_id"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass(frozen=True)
class SearchOutcome:
    """The study and every finished trial that counts towards the budget."""

    study_name: str
    storage_url: str
    results: list[TrialResult]
    epoch_records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # MOP units per epoch
    worker_rounds: tuple[RoundScale, ...] = ()  # worker_schedule: n_j per round (training/search/scaling.py)
    spot: SpotReport | None = None  # spot_trace: the replay's record and cost account
    busy_s: float = 0.0  # worker seconds inside training and validation passes (the batch loops)
    task_s: float = 0.0  # worker seconds inside tasks: the passes and the set-up and packing around them
    task_parts: dict[str, float] = field(default_factory=dict)  # task seconds around the loops, by part
    wall_s: float = 0.0  # the executor's run, start to end
    workers: int = 0  # Dask workers when it started
    # The executor's record of each unit it ran (its span, loops, set-up and packing seconds):
    # what the figures above sum, kept for per-unit costs (benchmarks/small_units.py)
    unit_records: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def utilisation(self) -> float | None:
        """Share of the workers' time spent inside training and validation passes: the rest went
        to fixed costs (task round trips, Trainer set-up, state packing, loading, waits)."""
        return self.busy_s / (self.workers * self.wall_s) if self.workers and self.wall_s > 0 else None

    @property
    def redone_unit_seconds(self) -> float:
        """Work lost to preempted or killed workers and done again, over every trial (seconds)."""
        return float(sum(r.redone_s for r in self.results))

    def complete(self) -> list[TrialResult]:
        """COMPLETE trials, best validation accuracy first."""
        done = [r for r in self.results if r.state == "COMPLETE" and r.value is not None]
        return sorted(done, key=lambda r: (-(r.value or 0.0), r.number))


def grid_values(spec: Any, points: int) -> list[Any]:
    """The values a grid search tries for one parameter: every choice of a categorical; for an
    int or float, ``points`` values evenly spaced over [low, high] (log-spaced when ``log``),
    rounded and de-duplicated for ints."""
    import numpy as np

    from mopflow.training.search.space import CategoricalParam, IntParam

    if isinstance(spec, CategoricalParam):
        return list(spec.choices)
    spaced = (np.geomspace if spec.log else np.linspace)(spec.low, spec.high, points)
    if isinstance(spec, IntParam):
        return sorted({int(round(v)) for v in spaced})
    return [float(v) for v in spaced]


def grid_search_space(space: SearchSpace, points: int) -> dict[str, list[Any]]:
    """Every parameter's grid values under the names ``sample_params`` suggests (all families)."""
    from mopflow.training.search.space import DEFAULT_COMMON

    grid: dict[str, list[Any]] = {}
    families = sorted(space.families)
    if len(families) > 1:
        grid["family"] = families
    for family in families:
        for name, spec in sorted(space.families[family].items()):
            grid[f"{family}_{name}"] = grid_values(spec, points)
    for name in DEFAULT_COMMON:
        if name in space.common:
            grid[name] = grid_values(space.common[name], points)
    return grid


def grid_configurations(space: SearchSpace, points: int, seed: int) -> list[dict[str, Any]]:
    """The grid of a conditional space as Optuna parameter sets, in a seeded random order.

    Optuna's ``GridSampler`` takes one product over every parameter, so in a space with model
    families most of its points would repeat a configuration (a CNN trial ignores the MLP's
    values). Here the grid is the union over families of each family's own product.
    """
    import itertools
    import random

    from mopflow.training.search.space import DEFAULT_COMMON

    grid = grid_search_space(space, points)
    common = [name for name in DEFAULT_COMMON if name in space.common]
    configs: list[dict[str, Any]] = []
    for family in sorted(space.families):
        names = [f"{family}_{n}" for n in sorted(space.families[family])] + common
        for values in itertools.product(*(grid[n] for n in names)):
            config = dict(zip(names, values, strict=True))
            if "family" in grid:
                config["family"] = family
            configs.append(config)
    random.Random(seed).shuffle(configs)
    return configs


def is_fresh(study: optuna.Study) -> bool:
    """Whether ``study`` has no trial of its own yet besides warm starts still enqueued (copies of
    earlier studies' trials are not its own)."""
    trials = own_trials(study.get_trials(deepcopy=False))
    return all(t.state == TrialState.WAITING and WARM_START_ATTR in t.user_attrs for t in trials)


def enqueue_grid(study: optuna.Study, cfg: SearchConfig, space: SearchSpace) -> int:
    """Enqueue the grid (at most ``n_trials`` points) into a new study; returns how many."""
    if not is_fresh(study):
        return 0  # a resumed study already holds its grid
    configs = grid_configurations(space, cfg.grid_points, cfg.seed)
    if len(configs) > cfg.n_trials:
        log.warning(
            "search: the grid has %d points and n_trials=%d: a seeded random %d of them are tried",
            len(configs),
            cfg.n_trials,
            cfg.n_trials,
        )
    for config in configs[: cfg.n_trials]:
        study.enqueue_trial(config)
    return min(len(configs), cfg.n_trials)


def result_from_frozen(trial: optuna.trial.FrozenTrial) -> TrialResult:
    """Rebuild a result from what the storage recorded (for trials finished by an earlier attempt)."""
    attrs = trial.user_attrs
    state = trial.state.name
    value = trial.value if trial.state == TrialState.COMPLETE else attrs.get("last_value")
    return TrialResult(
        number=trial.number,
        params=params_from_optuna(trial.params),
        state=state,
        value=value,
        history=list(attrs.get("history", [])),
        bundle_uri=attrs.get("bundle_uri"),
        pruned_epoch=attrs.get("pruned_epoch"),
        error=attrs.get("fail_reason"),
        duration_s=float(attrs.get("duration_s", 0.0)),
        worker=str(attrs.get("worker", "")),
        num_params=int(attrs.get("num_params", 0)),
        resumed_from_epoch=attrs.get("resumed_from_epoch"),
        redone_s=float(attrs.get("redone_s", 0.0)),
    )


def _counted(trial: optuna.trial.FrozenTrial) -> bool:
    return trial.state in FINISHED and not trial.user_attrs.get(STALE_ATTR) and not is_learned(trial)


def retry_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> int:
    """Fail trials left RUNNING by a dead coordinator and enqueue their params again.

    Only one coordinator drives a study (the search task), so at its start every RUNNING
    trial is stale; the retry keeps the model id, so its model resumes from its checkpoint.
    """
    stale = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
    study_id = storage.get_study_id_from_name(study.study_name) if stale else 0
    for t in stale:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, STALE_ATTR, True)
        study.tell(t.number, state=TrialState.FAIL)
        attrs = {RESUME_ATTR: t.number} | (
            {MODEL_ATTR: t.user_attrs[MODEL_ATTR]} if MODEL_ATTR in t.user_attrs else {}
        )
        study.enqueue_trial(dict(t.params), user_attrs=attrs, skip_if_exists=False)
        log.warning(
            "search: trial %d was left RUNNING by an earlier attempt; retrying its params from its "
            "last checkpoint",
            t.number,
        )
    return len(stale)


def retried_trial(trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> int | None:
    """The number of the trial this one retries (after a dead coordinator), if any."""
    value = trial.user_attrs.get(RESUME_ATTR)
    return None if value is None else int(value)


def checkpoint_folder(artifact_root: str, study_name: str, number: int) -> str:
    """Where trial ``number``'s model keeps its latest state (its model id is ``trial-NNNN``; a
    retry keeps the first attempt's), under the search's checkpoint root."""
    return storage.join(artifact_root, "checkpoints", study_name, f"trial-{number:04d}")


def result_detail(result: TrialResult) -> str:
    """A finished trial's figure for the log: its accuracy or error, and where it was pruned
    (epochs counted from 1, as the logs count them)."""
    detail = f"val_acc={result.value:.4f}" if result.value is not None else f"error={result.error}"
    if result.pruned_epoch is not None:
        detail += f" (pruned after epoch {result.pruned_epoch + 1})"
    return detail


def tell_result(study: optuna.Study, trial: optuna.trial.Trial, result: TrialResult) -> bool:
    """Record a result on its trial; False when the trial had already been finished (failed as
    stale, its retry queued): the result is then dropped."""
    attrs: dict[str, Any] = {
        "bundle_uri": result.bundle_uri,
        "history": result.history,
        "worker": result.worker,
        "duration_s": round(result.duration_s, 3),
        "num_params": result.num_params,
        "last_value": result.value,
    }
    if result.pruned_epoch is not None:
        attrs["pruned_epoch"] = result.pruned_epoch
    if result.error:
        attrs["fail_reason"] = result.error[:2000]
    if result.resumed_from_epoch is not None:
        attrs["resumed_from_epoch"] = result.resumed_from_epoch
    if result.resumed_from_step is not None:
        attrs["resumed_from_step"] = result.resumed_from_step
    if result.redone_s > 0:
        attrs["redone_s"] = round(result.redone_s, 3)
    try:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
    except optuna.exceptions.UpdateFinishedTrialError:
        log.warning("search: trial %d was already finished (stale); result dropped", result.number)
        return False
    try:
        if result.state == "COMPLETE":
            study.tell(trial, result.value, skip_if_finished=True)
        elif result.state == "PRUNED":
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
        else:
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    except optuna.exceptions.UpdateFinishedTrialError:
        # a retried database call whose first attempt was committed: the trial is already told
        log.warning("search: trial %d was already finished when told; kept as stored", result.number)
    return True


@dataclass(frozen=True)
class WarmStart:
    """A known-good configuration (the current champion's best trial) to try first."""

    params: dict[str, Any]
    source: str  # e.g. "mopflow-student v3 (champion)", recorded on the trial


def warm_start_study(study: optuna.Study, space: SearchSpace, warm: WarmStart) -> bool:
    """Enqueue ``warm.params`` as the study's first trial; only into a study with no trials of its
    own yet (other warm starts aside), so a resumed or rerun search does not enqueue it twice. A
    configuration outside the current space is skipped with a warning (the space may have changed
    since the champion was trained)."""
    if not is_fresh(study):
        return False
    if any(t.user_attrs.get(WARM_START_ATTR) == warm.source for t in study.get_trials(deepcopy=False)):
        return False
    try:
        fixed = optuna_params_for(space, warm.params)
    except SpaceError as exc:
        log.warning("search: not warm-starting from %s: %s", warm.source, exc)
        return False
    earlier = best_params([t for t in study.get_trials(deepcopy=False) if is_learned(t)])
    if earlier is not None and earlier[0] == fixed:  # enqueued already, as the earlier studies' best
        log.info(
            "search: warm start: %s's configuration is the earlier studies' best; not twice", warm.source
        )
        return False
    study.enqueue_trial(fixed, user_attrs={WARM_START_ATTR: warm.source})
    log.info("search: warm start: enqueued %s's configuration %s", warm.source, warm.params)
    return True


METRIC_NAME = "val_acc"  # what every trial's value is: optuna-dashboard shows it by this name


def describe_study(study: optuna.Study, attrs: Mapping[str, Any]) -> None:
    """Name the study's objective and record ``attrs`` on it (both idempotent on a resume)."""
    import warnings

    if study.metric_names != [METRIC_NAME]:
        with warnings.catch_warnings():  # experimental in Optuna 5, and the only way to name it
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([METRIC_NAME])
    for key, value in attrs.items():
        if study.user_attrs.get(key) != value:
            study.set_user_attr(key, value)


def open_study(
    cfg: SearchConfig,
    manifest_uri: str,
    study_name: str,
    storage_url: str,
    storage_options: Mapping[str, Any] | None,
    warm_start: WarmStart | None = None,
    client: Any = None,
    attrs: Mapping[str, Any] | None = None,
) -> tuple[optuna.Study, Any, list[optuna.trial.FrozenTrial], list[TrialResult], StudyLease]:
    """Verify the shards (on the Dask workers of ``client`` when given), then create or resume the
    study (a new one learns from earlier studies of the same data when ``cfg.warm_start_studies``;
    stale trials retried); return it, the space, the trials that already count towards the budget,
    their results and this attempt's lease on the study (taken before anything else is written:
    an earlier attempt still running somewhere writes nothing more). The study's objective is named (:data:`METRIC_NAME`) and ``attrs`` become
    its user attributes (the run it belongs to)."""
    from mopflow.training.models.families import DataSpec
    from mopflow.training.search.space import check_space_fits

    quiet_optuna()
    # a bad shard, or a family that cannot take the data, fails here, before any training
    manifest = verify_manifest(manifest_uri, storage_options, client)
    data = DataSpec.from_manifest(manifest)
    space = cfg.search_space(data.modality)
    check_space_fits(space, data)
    storage = make_storage(storage_url, cfg.parallel_trials)
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        direction="maximize",
        sampler=make_sampler(cfg, space),
        pruner=make_pruner(cfg.pruner, cfg.first_rung, cfg.epochs),
        load_if_exists=True,
    )
    lease = StudyLease.take(study)
    describe_study(study, attrs or {})
    key = search_key(dataset_identity(manifest), space, cfg.epochs)
    learn_from_earlier(study, storage, key, cfg.warm_start_studies)
    if warm_start is not None:
        warm_start_study(study, space, warm_start)
    if enqueues_grid(cfg.sampler):
        enqueue_grid(study, cfg, space)
    retry_stale_trials(study, storage)
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials if (n := retried_trial(t)) is not None}  # superseded by their retry
    # current: not superseded by the trial that continued their model from its rung either
    already = [t for t in current(trials) if _counted(t) and t.number not in retried]
    return study, space, already, [result_from_frozen(t) for t in already], lease
