"""Warm start from earlier studies of the same data: the sampler learns from their trials.

A study records what makes it comparable with another (:data:`SEARCH_KEY_ATTR`): the dataset
(its name, features, input shape and classes, not its rows: a retraining on new rows of the same
dataset learns from the earlier ones), the search space and the epochs per trial (the
learning-rate schedule spans them, so the values at each epoch depend on them). A new study with
``warm_start_studies=N`` copies the finished trials of the N newest earlier studies with the same
key from its Optuna storage:

* the samplers count them towards their start-up trials, so the model-based sampler proposes from
  the first ask; TPE and GP model them (Optuna's CMA-ES learns only from the trials it proposed);
* ASHA's rungs start from their values at each rung, so a new model must rank among the
  earlier models to go on;
* the best earlier configuration is enqueued as the first trial.

A copied trial carries :data:`LEARNED_ATTR` (``"<study>#<number>"``). It never counts towards the
budget, the results, the ensemble or the rungs' waiting models: it only informs the search.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from mopflow.base import progress
from mopflow.training.search.rungs import current
from mopflow.training.search.space import SearchSpace

log = logging.getLogger(__name__)

SEARCH_KEY_ATTR = "mopflow_search_key"  # study attr: data, space and epochs the study searched
LEARNED_ATTR = "mopflow_learned_from"  # trial attr: a copy of an earlier study's trial
WARM_START_ATTR = "mopflow_warm_start"  # trial attr: an enqueued known-good configuration's source
MAX_LEARNED_TRIALS = 1000  # bounds the sampler's work on every ask
DATASET_FIELDS = ("dataset", "modality", "feature_columns", "input_shape", "label_column", "num_classes")


def dataset_identity(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What names a dataset in a shard manifest, whatever rows it holds this time."""
    return {name: manifest.get(name) for name in DATASET_FIELDS}


def search_key(dataset: Mapping[str, Any], space: SearchSpace, epochs: int) -> str:
    """What makes two studies' trials comparable: the same dataset (:func:`dataset_identity`),
    space and epochs per trial."""
    spec = space.model_dump(mode="json")
    blob = json.dumps({"data": dict(dataset), "space": spec, "epochs": epochs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_learned(trial: FrozenTrial) -> bool:
    """Whether ``trial`` is a copy of an earlier study's trial (history, not this search's work)."""
    return LEARNED_ATTR in trial.user_attrs


def own_trials(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """``trials`` without the copies of earlier studies' trials."""
    return [t for t in trials if not is_learned(t)]


def earlier_studies(storage: Any, key: str, exclude: str, limit: int) -> list[str]:
    """The names of the ``limit`` newest studies in ``storage`` recorded under ``key`` (not
    ``exclude``, the study being opened); newest first (studies are numbered as created)."""
    matching = [
        s
        for s in storage.get_all_studies()
        if s.user_attrs.get(SEARCH_KEY_ATTR) == key and s.study_name != exclude
    ]
    # studies are numbered as they are created (Optuna's public storage API gives the number)
    matching.sort(key=lambda s: storage.get_study_id_from_name(s.study_name), reverse=True)
    return [s.study_name for s in matching[:limit]]


def learned_copy(trial: FrozenTrial, source: str) -> FrozenTrial:
    """A finished trial of study ``source`` as history for another study: its parameters, value
    and per-epoch values, nothing that ties it to its models or checkpoints."""
    return optuna.trial.create_trial(
        state=trial.state,
        value=trial.value if trial.state == TrialState.COMPLETE else None,
        params=dict(trial.params),
        distributions=dict(trial.distributions),
        intermediate_values=dict(trial.intermediate_values),
        user_attrs={LEARNED_ATTR: f"{source}#{trial.number}"},
    )


def history_of(study: optuna.Study) -> list[FrozenTrial]:
    """A study's own finished trials worth learning from: COMPLETE, or PRUNED with per-epoch
    values (a failed or stale attempt, or one a promotion continued, teaches nothing)."""
    return [
        t
        for t in current(own_trials(study.get_trials(deepcopy=False)))
        if (t.state == TrialState.COMPLETE and t.value is not None)
        or (t.state == TrialState.PRUNED and t.intermediate_values)
    ]


def best_params(copies: Sequence[FrozenTrial]) -> tuple[dict[str, Any], str] | None:
    """The parameters of the best COMPLETE copy and the trial it copies (``"<study>#<n>"``)."""
    done = [t for t in copies if t.state == TrialState.COMPLETE and t.value is not None]
    if not done:
        return None
    best = max(done, key=lambda t: t.value or 0.0)
    return dict(best.params), str(best.user_attrs[LEARNED_ATTR])


def learn_from_earlier(study: optuna.Study, storage: Any, key: str, studies: int) -> int:
    """Record ``key`` on ``study``; when it is new (no trial yet) and ``studies`` > 0, copy the
    trials of the ``studies`` newest earlier studies under ``key`` in ``storage`` (the study's
    Optuna storage) into it and enqueue the best earlier configuration first. Returns how many
    trials were copied (0 for a resumed study, so a rerun copies nothing twice)."""
    if study.user_attrs.get(SEARCH_KEY_ATTR) != key:
        study.set_user_attr(SEARCH_KEY_ATTR, key)
    if studies <= 0 or study.get_trials(deepcopy=False):
        return 0
    copies: list[FrozenTrial] = []
    sources = earlier_studies(storage, key, study.study_name, studies)
    for name in sources:
        earlier = optuna.load_study(study_name=name, storage=storage)
        copies += [learned_copy(t, name) for t in history_of(earlier)]
    copies = copies[:MAX_LEARNED_TRIALS]
    if not copies:
        log.info("search: warm start: no earlier study of this data, space and epochs; starting cold")
        progress.publish("warm_start", studies=[], trials=0)
        return 0
    progress.publish("warm_start", studies=list(sources), trials=len(copies))
    study.add_trials(copies)
    best = best_params(copies)
    if best is not None:
        study.enqueue_trial(best[0], user_attrs={WARM_START_ATTR: f"study {best[1]}"})
    log.info(
        "search: warm start: learned from %d trial(s) of %d earlier stud%s (%s); first trial is %s",
        len(copies),
        len(sources),
        "y" if len(sources) == 1 else "ies",
        ", ".join(sources),
        f"the best of them (study {best[1]})" if best else "sampled",
    )
    return len(copies)
