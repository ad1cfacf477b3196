"""Stage 3: the top-k COMPLETE trials as one probability-averaging module, logged as a pyfunc."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mopflow.base.settings import Settings
from mopflow.base.tag_names import MANIFEST_HASH, STUDY
from mopflow.pipeline.context import stage
from mopflow.pipeline.records import (
    BestTrial,
    EnsembleRecord,
    RunContext,
    SearchRecord,
    ShardRecord,
    finite_or_none,
)

log = logging.getLogger(__name__)


def ensemble_stage(
    conf: Mapping[str, Any] | None,
    run: RunContext,
    shard: ShardRecord,
    search: SearchRecord,
    settings: Settings | None = None,
) -> EnsembleRecord:
    """Choose, evaluate and save the ensemble of the study's best trials; returns its URIs and
    figures. Predictions and accuracies are computed on the Dask workers shard by shard
    (:func:`mopflow.compression.ensemble_choice.choose_on_shards`); this process holds counts,
    not the data."""
    from mopflow.compression.ensemble import build_ensemble, save_ensemble
    from mopflow.compression.ensemble_choice import choose_on_shards, load_candidates
    from mopflow.registry.inputs import example_input
    from mopflow.registry.model_registry import log_bundle_model
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.data import load_manifest

    lineage = {MANIFEST_HASH: shard.manifest_hash, STUDY: search.study_name}
    with stage("ensemble", conf, run, settings, lineage) as st:
        so, ecfg = st.storage_options, st.cfg.ensemble
        manifest = load_manifest(shard.manifest_uri, so)
        candidates = load_candidates(search.study_name, st.settings.optuna_storage)
        with dask_client(st.settings.dask_address, st.settings.dask_workers) as client:
            choice = choose_on_shards(
                client,
                shard.manifest_uri,
                manifest,
                st.paths.predictions,
                so,
                candidates,
                ecfg.selection,
                ecfg.top_k,
            )
        ensemble, archs, columns = build_ensemble(choice.members, so, choice.weights)
        metrics = choice.metrics | {"num_params": float(sum(p.numel() for p in ensemble.parameters()))}
        bundle_uri = st.paths.ensemble
        numbers = [m.number for m in choice.members]
        meta = {"members": numbers, "study": search.study_name, "manifest_hash": shard.manifest_hash}
        save_ensemble(bundle_uri, ensemble, archs, columns, meta, so)
        st.tracker.log_params(
            st.run_id,
            {
                "top_k": ecfg.top_k,
                "selection": ecfg.selection,
                "members": numbers,
                "member_weights": [round(w, 4) for w in ensemble.weights.tolist()],
            },
        )
        st.tracker.log_metrics(st.run_id, metrics)
        example = example_input(shard.manifest_uri, manifest, so)
        model_uri = log_bundle_model(st.run_id, "ensemble", bundle_uri, example, so)
    log.info(
        "ensemble: members %s val_acc=%.4f test_acc=%.4f (%d params)",
        numbers,
        metrics["val_acc"],
        metrics["test_acc"],
        int(metrics["num_params"]),
    )
    best, figures = choice.best, finite_or_none(metrics)
    return EnsembleRecord(
        bundle_uri=bundle_uri,
        model_uri=model_uri,
        run_id=st.run_id,
        members=numbers,
        member_weights=ensemble.weights.tolist(),
        best_trial_bundle=str(best.bundle_uri),
        best_trial=BestTrial(
            number=best.number,
            params=dict(best.params),
            val_acc=best.value,
            test_acc=figures["best_trial_test_acc"],
        ),
        val_acc=metrics["val_acc"],
        test_acc=metrics["test_acc"],
        best_trial_val_acc=figures["best_trial_val_acc"],
        best_trial_test_acc=figures["best_trial_test_acc"],
        num_params=metrics["num_params"],
    )
