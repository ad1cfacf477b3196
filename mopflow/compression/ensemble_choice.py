"""Which trials of a study make the ensemble, chosen from predictions made on the Dask workers
shard by shard (:mod:`mopflow.compression.shard_eval`): the caller holds counts, not the data."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mopflow.compression.ensemble import Candidate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnsembleChoice:
    """The members and their weights, the best member, and the ensemble's figures (validation
    accuracy on the selection pool's shards, test accuracy of the ensemble and of the best member)."""

    members: list[Candidate]
    weights: list[float]
    best: Candidate
    metrics: dict[str, float]


def load_candidates(study_name: str, storage_url: str) -> list[Candidate]:
    """Every trial of the study that may join the ensemble (stale trials of an earlier attempt and
    trials learned from earlier studies not)."""
    import optuna

    from mopflow.base.optuna_storage import make_storage, quiet_optuna
    from mopflow.training.search.space import params_from_optuna
    from mopflow.training.search.study import STALE_ATTR
    from mopflow.training.search.warm_history import is_learned

    quiet_optuna()
    study = optuna.load_study(study_name=study_name, storage=make_storage(storage_url))
    return [
        Candidate(
            t.number, t.state.name, t.value, t.user_attrs.get("bundle_uri"), params_from_optuna(t.params)
        )
        for t in study.get_trials(deepcopy=False)
        if not t.user_attrs.get(STALE_ATTR) and not is_learned(t)
    ]


def choose_on_shards(
    client: Any,
    manifest_uri: str,
    manifest: Mapping[str, Any],
    predictions_uri: str,
    storage_options: Mapping[str, Any],
    candidates: Sequence[Candidate],
    selection: str,
    top_k: int,
) -> EnsembleChoice:
    """Members, weights, the best member and the figures, from predictions made on the workers
    (kept under ``predictions_uri``): the selection pool on the validation shards (``selection``
    ``"greedy"`` picks ``top_k`` times with replacement, else the ``top_k`` best all join), the
    members on the test shards."""
    from mopflow.compression.ensemble import members_from_picks, selection_pool
    from mopflow.compression.shard_eval import ShardEvaluator

    evaluator = ShardEvaluator(client, manifest_uri, predictions_uri, storage_options, manifest)
    pool = selection_pool(candidates, selection, top_k)
    log.info("ensemble: predicting the validation shards with %d candidate(s) on the workers", len(pool))
    val = evaluator.predictions("validation", [str(c.bundle_uri) for c in pool])
    picks = evaluator.greedy_selection(val, top_k) if selection == "greedy" else list(range(len(pool)))
    members, weights = members_from_picks(pool, picks)
    best = sorted(members, key=lambda m: (-(m.value or 0.0), m.number))[0]
    on_pool = [float(picks.count(i)) for i in range(len(pool))]
    (val_acc,) = evaluator.accuracies(val, [on_pool])
    log.info("ensemble: predicting the test shards with %d member(s) on the workers", len(members))
    test = evaluator.predictions("test", [str(m.bundle_uri) for m in members])
    one_hot = [float(m is best) for m in members]
    test_acc, best_test = evaluator.accuracies(test, [weights, one_hot])
    metrics = {
        "val_acc": val_acc,
        "test_acc": test_acc,
        "best_trial_val_acc": float(best.value or 0.0),
        "best_trial_test_acc": best_test,
    }
    return EnsembleChoice(members, weights, best, metrics)
