"""Stage 5: register the ensemble and the student; the student becomes the challenger, and the
champion too when it passes the promotion gate. Writes the pipeline run's summary."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mopflow.base import storage
from mopflow.base.settings import Settings
from mopflow.base.tag_names import MANIFEST_HASH, PROMOTED, PROMOTION_REASON, STUDY
from mopflow.pipeline.context import SUMMARY_FILE, Stage, stage, summary_uri
from mopflow.pipeline.search import BEST_PARAMS_TAG

if TYPE_CHECKING:
    from mopflow.compression.registry.model_registry import PromotionDecision

log = logging.getLogger(__name__)


def register_stage(
    conf: Mapping[str, Any] | None,
    ctx_dict: Mapping[str, Any],
    shard: Mapping[str, Any],
    search: Mapping[str, Any],
    ensemble: Mapping[str, Any],
    distill: Mapping[str, Any],
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Register both models, apply the promotion gate, and return (and store) the run's summary."""
    from mopflow.compression.registry.model_registry import CHALLENGER, CHAMPION, registry_client

    lineage = {MANIFEST_HASH: str(shard["manifest_hash"])}
    with stage("register", conf, ctx_dict, settings, lineage) as st:
        client = registry_client(st.settings)
        names = {
            "student": f"{st.cfg.registry.model_name}-student",
            "ensemble": f"{st.cfg.registry.model_name}-ensemble",
        }
        version_tags = {
            MANIFEST_HASH: str(shard["manifest_hash"]),
            STUDY: str(search["study_name"]),
        }
        versions = _register_versions(client, names, st.run.run_key, version_tags, ensemble, distill)
        decision, champion_acc = _promotion(
            client, names["student"], versions["student"], st, shard, ensemble, distill
        )
        aliases = _set_aliases(client, names, versions, decision.promote)
        st.tracker.set_tags(
            st.run_id,
            {PROMOTED: str(decision.promote).lower(), PROMOTION_REASON: decision.reason},
        )
        st.tracker.log_params(
            st.run_id, {"student_model": names["student"], "student_version": versions["student"]}
        )
        log.info(
            "register: %s v%s aliases %s (%s)",
            names["student"],
            versions["student"],
            aliases,
            decision.reason,
        )
        summary = run_summary(st, shard, search, ensemble, distill, names, versions)
        summary["registered"] |= {
            "aliases": aliases,
            "promoted": decision.promote,
            "reason": decision.reason,
            "previous_champion_test_acc": champion_acc,
            "model_uri": f"models:/{names['student']}@{CHAMPION if decision.promote else CHALLENGER}",
        }
        st.tracker.log_dict(st.run.parent_run_id, summary, SUMMARY_FILE)
        storage.write_json_atomic(summary_uri(st.settings, st.run.run_key), summary, st.storage_options)
    return summary


def _register_versions(
    client: Any,
    names: Mapping[str, str],
    run_key: str,
    version_tags: Mapping[str, str],
    ensemble: Mapping[str, Any],
    distill: Mapping[str, Any],
) -> dict[str, str]:
    """Register the ensemble and the student with ``version_tags`` (the student with its
    accuracy and the best trial's parameters too); their versions, by ``names``' kinds."""
    from mopflow.compression.registry.model_registry import register_version

    ens_version = register_version(
        client, names["ensemble"], str(ensemble["model_uri"]), run_key, version_tags
    )
    student_tags = {
        **version_tags,
        "mopflow.test_acc": f"{distill['test_acc']:.6f}",
        # what a warm-started retraining sweep tries first
        BEST_PARAMS_TAG: json.dumps(ensemble["best_trial"]["params"], sort_keys=True),
    }
    student_version = register_version(
        client, names["student"], str(distill["model_uri"]), run_key, student_tags
    )
    return {"student": str(student_version.version), "ensemble": str(ens_version.version)}


def _promotion(
    client: Any,
    student: str,
    version: str,
    st: Stage,
    shard: Mapping[str, Any],
    ensemble: Mapping[str, Any],
    distill: Mapping[str, Any],
) -> tuple[PromotionDecision, float | None]:
    """Whether ``version`` of the ``student`` model becomes the champion, and the current
    champion's accuracy it was compared with (None: no champion, or this version already is)."""
    from mopflow.compression.registry.model_registry import (
        CHAMPION,
        PromotionDecision,
        alias_version,
        decide_promotion,
    )

    champion = alias_version(client, student, CHAMPION)
    already = champion is not None and str(champion.version) == version
    # The gate compares against the current champion evaluated on *this* run's test set.
    champion_acc = None if champion is None or already else champion_accuracy(student, shard, st)
    decision = decide_promotion(
        st.cfg.registry.promotion,
        float(distill["test_acc"]),
        champion_acc,
        float(ensemble["test_acc"]),
        st.cfg.registry.max_gap_to_ensemble,
    )
    if already:
        decision = PromotionDecision(True, "this version is already the champion")
    return decision, champion_acc


def _set_aliases(
    client: Any, names: Mapping[str, str], versions: Mapping[str, str], promote: bool
) -> list[str]:
    """Point the challenger alias (and the champion's, when promoted) of both models at their new
    versions; the aliases set."""
    from mopflow.compression.registry.model_registry import CHALLENGER, CHAMPION, set_alias

    aliases = [CHALLENGER] + ([CHAMPION] if promote else [])
    for alias in aliases:
        for kind, name in names.items():
            set_alias(client, name, alias, versions[kind])
    return aliases


def champion_accuracy(name: str, shard: Mapping[str, Any], st: Stage) -> float:
    """The current champion's test accuracy on this run's test set (through its pyfunc), one test
    shard in memory at a time."""
    import mlflow

    from mopflow.compression.registry.inputs import served_examples
    from mopflow.compression.registry.model_registry import CHAMPION
    from mopflow.training.data import load_manifest, read_shard
    from mopflow.training.data.reading import shard_arrays
    from mopflow.training.models.metrics import top1_correct

    manifest_uri = str(shard["manifest_uri"])
    manifest = load_manifest(manifest_uri, st.storage_options)
    champion = mlflow.pyfunc.load_model(f"models:/{name}@{CHAMPION}")
    correct = rows = 0
    for entry in manifest["splits"]["test"]:
        frame = read_shard(manifest_uri, manifest, entry, st.storage_options)
        x, y = shard_arrays(frame, manifest)
        probs = champion.predict(served_examples(frame, x, manifest))
        correct, rows = correct + top1_correct(probs.to_numpy(), y), rows + len(y)
    return correct / rows if rows else 0.0


def run_summary(
    st: Stage,
    shard: Mapping[str, Any],
    search: Mapping[str, Any],
    ensemble: Mapping[str, Any],
    distill: Mapping[str, Any],
    names: Mapping[str, str],
    versions: Mapping[str, str],
) -> dict[str, Any]:
    """What the pipeline run produced: trials, ensemble, student, evaluation, where to find them."""
    return {
        "run_key": st.run.run_key,
        "dag_id": st.run.dag_id,
        "airflow_run_id": st.run.airflow_run_id,
        "manifest_hash": shard["manifest_hash"],
        "trials": search["counts"],
        "best_trial": ensemble["best_trial"],
        "ensemble": {
            "members": ensemble["members"],
            "member_weights": ensemble.get("member_weights"),
            "val_acc": ensemble["val_acc"],
            "test_acc": ensemble["test_acc"],
            "num_params": int(ensemble["num_params"]),
            "registered": {"name": names["ensemble"], "version": versions["ensemble"]},
        },
        "evaluation": distill.get("evaluation", []),
        "student": {
            "hard_label_test_acc": distill.get("hard_label_test_acc"),
            "int8_test_acc": distill.get("int8_test_acc"),
            "recovered_gain": distill.get("recovered_gain"),
            "arch": distill["arch"],
            "val_acc": distill["val_acc"],
            "test_acc": distill["test_acc"],
            "num_params": int(distill["num_params"]),
            "param_ratio": distill["param_ratio"],
            "kept": distill.get("kept"),  # the distilled or the hard-label student, and why
        },
        "registered": {"name": names["student"], "version": versions["student"]},
        "mlflow": {
            "tracking_uri": st.settings.tracking_uri,
            "experiment": st.settings.experiment_name,
            "parent_run_id": st.run.parent_run_id,
        },
        "optuna": {"storage": str(search["storage_url"]), "study_name": str(search["study_name"])},
    }
