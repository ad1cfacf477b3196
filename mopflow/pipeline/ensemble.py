"""Stage 3: the top-k COMPLETE trials as one probability-averaging module, logged as a pyfunc."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from mopflow.base.settings import Settings
from mopflow.base.tag_names import MANIFEST_HASH, STUDY
from mopflow.pipeline.context import Stage, stage

log = logging.getLogger(__name__)


def ensemble_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    search: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Choose, evaluate and save the ensemble of the study's best trials; returns its URIs and
    figures. Predictions and accuracies are computed on the Dask workers shard by shard
    (:mod:`mopflow.compression.shard_eval`); this process holds counts, not the data."""
    from mopflow.compression.ensemble import build_ensemble, save_ensemble
    from mopflow.compression.registry.model_registry import log_bundle_model
    from mopflow.training.compute.cluster import dask_client

    lineage = {
        MANIFEST_HASH: str(shard["manifest_hash"]),
        STUDY: str(search["study_name"]),
    }
    with stage("ensemble", conf, ctx_dict, settings, lineage) as st:
        so, cfg = st.storage_options, st.cfg
        manifest_uri = str(shard["manifest_uri"])
        candidates = load_candidates(str(search["study_name"]), st.settings.optuna_storage)
        with dask_client(st.settings.dask_address, st.settings.dask_workers) as client:
            choice = choose_on_shards(client, st, manifest_uri, candidates)
        members, weights, best, metrics = choice
        ensemble, archs, columns = build_ensemble(members, so, weights)
        metrics["num_params"] = float(sum(p.numel() for p in ensemble.parameters()))
        best_test = metrics["best_trial_test_acc"]
        bundle_uri = st.output_uri("ensemble")
        numbers = [m.number for m in members]
        meta = {"members": numbers, "study": search["study_name"], "manifest_hash": shard["manifest_hash"]}
        save_ensemble(bundle_uri, ensemble, archs, columns, meta, so)
        st.tracker.log_params(
            st.run_id,
            {
                "top_k": cfg.ensemble.top_k,
                "selection": cfg.ensemble.selection,
                "members": numbers,
                "member_weights": [round(w, 4) for w in ensemble.weights.tolist()],
            },
        )
        st.tracker.log_metrics(st.run_id, metrics)
        model_uri = log_bundle_model(st.run_id, "ensemble", bundle_uri, example_input(manifest_uri, so), so)
    log.info(
        "ensemble: members %s val_acc=%.4f test_acc=%.4f (%d params)",
        numbers,
        metrics["val_acc"],
        metrics["test_acc"],
        int(metrics["num_params"]),
    )
    return {
        "bundle_uri": bundle_uri,
        "model_uri": model_uri,
        "run_id": st.run_id,
        "members": numbers,
        "member_weights": ensemble.weights.tolist(),
        "best_trial_bundle": best.bundle_uri,
        "best_trial": {
            "number": best.number,
            "params": dict(best.params),
            "val_acc": best.value,
            "test_acc": best_test,
        },
        **json_figures(metrics),
    }


def choose_on_shards(
    client: Any, st: Stage, manifest_uri: str, candidates: Sequence[Any]
) -> tuple[list[Any], list[float], Any, dict[str, float]]:
    """Members, weights, the best member and the figures, from predictions made on the workers:
    the selection pool on the validation shards, the members on the test shards."""
    from mopflow.compression.ensemble import members_from_picks, selection_pool
    from mopflow.compression.shard_eval import ShardEvaluator

    ecfg = st.cfg.ensemble
    evaluator = ShardEvaluator(client, manifest_uri, st.output_uri("predictions"), st.storage_options)
    pool = selection_pool(candidates, ecfg.selection, ecfg.top_k)
    log.info("ensemble: predicting the validation shards with %d candidate(s) on the workers", len(pool))
    val = evaluator.predictions("validation", [str(c.bundle_uri) for c in pool])
    if ecfg.selection == "greedy":
        picks = evaluator.greedy_selection(val, ecfg.top_k)
    else:
        picks = list(range(len(pool)))
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
    return members, weights, best, metrics


def json_figures(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """Figures for XCom, which travels as JSON through the API server: NaN/inf become null."""
    return {k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}


def load_candidates(study_name: str, storage_url: str) -> list[Any]:
    """Every trial of the study that may join the ensemble (stale trials of an earlier attempt and
    trials learned from earlier studies not)."""
    import optuna

    from mopflow.base.optuna_storage import make_storage, quiet_optuna
    from mopflow.compression.ensemble import Candidate
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


def example_input(manifest_uri: str, storage_options: Mapping[str, Any]) -> Any:
    """A few validation examples as the model's input example: a frame of a table's columns, an
    array of tensors ``(n, *shape)`` for images and sequences (a TensorSpec signature), or one
    column of base64 images for images stored encoded (one string column)."""
    from mopflow.compression.registry.inputs import served_examples
    from mopflow.training.data import load_manifest, read_shard
    from mopflow.training.data.reading import shard_arrays

    manifest = load_manifest(manifest_uri, storage_options)
    first = manifest["splits"]["validation"][0]  # one shard is enough for five rows
    frame = read_shard(manifest_uri, manifest, first, storage_options).iloc[:5]
    x, _ = shard_arrays(frame, manifest)
    return served_examples(frame, x, manifest)
