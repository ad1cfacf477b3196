"""Stage 3: the top-k COMPLETE trials as one probability-averaging module, logged as a pyfunc."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from infra.settings import Settings
from infra.stages.context import stage
from training.families import DataSpec

log = logging.getLogger(__name__)


def ensemble_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    search: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Build, evaluate and save the ensemble of the study's best trials; returns its URIs and figures."""
    from compression.ensemble import build_ensemble, choose_members, save_ensemble
    from compression.registry import log_bundle_model
    from training.bundle import accuracy, load_bundle
    from training.data import load_split

    lineage = {
        "mopflow.manifest_hash": str(shard["manifest_hash"]),
        "mopflow.study": str(search["study_name"]),
    }
    with stage("ensemble", conf, ctx_dict, settings, lineage) as st:
        so, cfg = st.storage_options, st.cfg
        manifest_uri = str(shard["manifest_uri"])
        x_val, y_val = load_split(manifest_uri, "validation", so)
        x_test, y_test = load_split(manifest_uri, "test", so)
        candidates = load_candidates(str(search["study_name"]), st.settings.optuna_storage)
        members, weights = choose_members(
            candidates, cfg.ensemble.selection, cfg.ensemble.top_k, x_val, y_val, so
        )
        ensemble, archs, columns = build_ensemble(members, so, weights)
        best = sorted(members, key=lambda m: (-(m.value or 0.0), m.number))[0]
        best_test = accuracy(load_bundle(str(best.bundle_uri), so).module, x_test, y_test)
        metrics = {
            "val_acc": accuracy(ensemble, x_val, y_val),
            "test_acc": accuracy(ensemble, x_test, y_test),
            "num_params": float(sum(p.numel() for p in ensemble.parameters())),
            "best_trial_val_acc": float(best.value or 0.0),
            "best_trial_test_acc": best_test,
        }
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


def json_figures(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """Figures for XCom, which travels as JSON through the API server: NaN/inf become null."""
    return {k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}


def load_candidates(study_name: str, storage_url: str) -> list[Any]:
    """Every trial of the study that may join the ensemble (stale trials of an earlier attempt not)."""
    import optuna

    from compression.ensemble import Candidate
    from infra.optuna_storage import make_storage, quiet_optuna
    from training.search import STALE_ATTR
    from training.space import params_from_optuna

    quiet_optuna()
    study = optuna.load_study(study_name=study_name, storage=make_storage(storage_url))
    return [
        Candidate(
            t.number, t.state.name, t.value, t.user_attrs.get("bundle_uri"), params_from_optuna(t.params)
        )
        for t in study.get_trials(deepcopy=False)
        if not t.user_attrs.get(STALE_ATTR)
    ]


def example_input(manifest_uri: str, storage_options: Mapping[str, Any]) -> Any:
    """A few validation examples as the model's input example: a frame of a table's columns, or
    an array of tensors ``(n, *shape)`` for images and sequences."""
    import pandas as pd

    from training.data import load_manifest, load_split

    manifest = load_manifest(manifest_uri, storage_options)
    x, _ = load_split(manifest_uri, "validation", storage_options)
    data = DataSpec.from_manifest(manifest)
    if data.modality != "table":  # a tensor of examples: the signature is a TensorSpec
        return x[:5].reshape(-1, *data.input_shape)
    return pd.DataFrame(x[:5], columns=manifest["feature_columns"])
