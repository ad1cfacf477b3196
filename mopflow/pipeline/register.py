"""Stage 5: register the ensemble and the student; the student becomes the challenger, and the
champion too when it passes the promotion gate. Writes the pipeline run's summary."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mopflow.base import storage
from mopflow.base.settings import Settings
from mopflow.base.tag_names import (
    BEST_PARAMS,
    LATENCY_P95,
    MANIFEST_HASH,
    PROMOTED,
    PROMOTION_REASON,
    STUDENT_BUDGET_MS,
    STUDY,
)
from mopflow.pipeline.context import Stage, stage
from mopflow.pipeline.paths import SUMMARY_FILE
from mopflow.pipeline.records import (
    DistillRecord,
    EnsembleRecord,
    RegisterRecord,
    RunContext,
    SearchRecord,
    ShardRecord,
)

if TYPE_CHECKING:
    from mopflow.registry.model_registry import PromotionDecision

log = logging.getLogger(__name__)


def register_stage(
    conf: Mapping[str, Any] | None,
    run: RunContext,
    shard: ShardRecord,
    search: SearchRecord,
    ensemble: EnsembleRecord,
    distill: DistillRecord,
    settings: Settings | None = None,
) -> RegisterRecord:
    """Register both models, apply the promotion gate, and store the run's summary; returns the
    student's new version, the decision, and where the summary is."""
    from mopflow.registry.model_registry import CHALLENGER, CHAMPION, registry_client

    lineage = {MANIFEST_HASH: shard.manifest_hash}
    with stage("register", conf, run, settings, lineage) as st:
        client = registry_client(st.settings)
        names = {
            "student": f"{st.cfg.registry.model_name}-student",
            "ensemble": f"{st.cfg.registry.model_name}-ensemble",
        }
        version_tags = {MANIFEST_HASH: shard.manifest_hash, STUDY: search.study_name}
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
        registered = RegisterRecord(
            summary_uri=st.paths.summary,
            name=names["student"],
            version=versions["student"],
            ensemble_version=versions["ensemble"],
            aliases=aliases,
            promoted=decision.promote,
            reason=decision.reason,
            previous_champion_test_acc=champion_acc,
            model_uri=f"models:/{names['student']}@{CHAMPION if decision.promote else CHALLENGER}",
        )
        summary = run_summary(st, shard, search, ensemble, distill, registered)
        st.tracker.log_dict(st.run.parent_run_id, summary, SUMMARY_FILE)
        storage.write_json_atomic(registered.summary_uri, summary, st.storage_options)
    return registered


def _register_versions(
    client: Any,
    names: Mapping[str, str],
    run_key: str,
    version_tags: Mapping[str, str],
    ensemble: EnsembleRecord,
    distill: DistillRecord,
) -> dict[str, str]:
    """Register the ensemble and the student with ``version_tags`` (the student with its
    accuracy and the best trial's parameters too); their versions, by ``names``' kinds."""
    from mopflow.registry.model_registry import register_version

    ens_version = register_version(client, names["ensemble"], ensemble.model_uri, run_key, version_tags)
    student_tags = {
        **version_tags,
        "mopflow.test_acc": f"{distill.test_acc:.6f}",
        # what a warm-started retraining sweep tries first
        BEST_PARAMS: json.dumps(ensemble.best_trial.params, sort_keys=True),
    }
    if distill.latency_p95_ms is not None:
        student_tags[LATENCY_P95] = f"{distill.latency_p95_ms:.3f}"
    if distill.budget_ms is not None:
        student_tags[STUDENT_BUDGET_MS] = f"{distill.budget_ms:g}"
    student_version = register_version(client, names["student"], distill.model_uri, run_key, student_tags)
    return {"student": str(student_version.version), "ensemble": str(ens_version.version)}


def _promotion(
    client: Any,
    student: str,
    version: str,
    st: Stage,
    shard: ShardRecord,
    ensemble: EnsembleRecord,
    distill: DistillRecord,
) -> tuple[PromotionDecision, float | None]:
    """Whether ``version`` of the ``student`` model becomes the champion, and the current
    champion's accuracy it was compared with (None: no champion, or this version already is)."""
    from mopflow.registry.model_registry import (
        CHAMPION,
        PromotionDecision,
        alias_version,
        champion_accuracy,
        decide_promotion,
    )
    from mopflow.training.data import load_manifest

    champion = alias_version(client, student, CHAMPION)
    already = champion is not None and str(champion.version) == version
    # The gate compares against the current champion evaluated on *this* run's test set.
    champion_acc = None
    if champion is not None and not already:
        manifest = load_manifest(shard.manifest_uri, st.storage_options)
        champion_acc = champion_accuracy(student, shard.manifest_uri, manifest, st.storage_options)
    decision = decide_promotion(
        st.cfg.registry.promotion,
        distill.test_acc,
        champion_acc,
        ensemble.test_acc,
        st.cfg.registry.max_gap_to_ensemble,
    )
    if already:
        decision = PromotionDecision(True, "this version is already the champion")
    if distill.latency_p95_ms is not None:
        decision = PromotionDecision(decision.promote, f"{decision.reason}; {serving_line(distill)}")
    return decision, champion_acc


def serving_line(distill: DistillRecord) -> str:
    """The student's serving latency, and the budget it was sized for, in words."""
    line = f"serves {distill.latency_rows} rows in p95 {distill.latency_p95_ms:.2f} ms on one CPU thread"
    return line if distill.budget_ms is None else f"{line} (budget {distill.budget_ms:g} ms)"


def _set_aliases(
    client: Any, names: Mapping[str, str], versions: Mapping[str, str], promote: bool
) -> list[str]:
    """Point the challenger alias (and the champion's, when promoted) of both models at their new
    versions; the aliases set."""
    from mopflow.registry.model_registry import CHALLENGER, CHAMPION, set_alias

    aliases = [CHALLENGER] + ([CHAMPION] if promote else [])
    for alias in aliases:
        for kind, name in names.items():
            set_alias(client, name, alias, versions[kind])
    return aliases


def run_summary(
    st: Stage,
    shard: ShardRecord,
    search: SearchRecord,
    ensemble: EnsembleRecord,
    distill: DistillRecord,
    registered: RegisterRecord,
) -> dict[str, Any]:
    """What the pipeline run produced: trials, ensemble, student, evaluation, where to find them
    (``summary.json``: its shape is what ``mopflow run`` prints and earlier runs left)."""
    return {
        "run_key": st.run.run_key,
        "dag_id": st.run.dag_id,
        "airflow_run_id": st.run.airflow_run_id,
        "manifest_hash": shard.manifest_hash,
        "trials": search.counts,
        "best_trial": ensemble.best_trial.model_dump(mode="json"),
        "ensemble": {
            "members": ensemble.members,
            "member_weights": ensemble.member_weights,
            "val_acc": ensemble.val_acc,
            "test_acc": ensemble.test_acc,
            "num_params": int(ensemble.num_params),
            "registered": {
                "name": f"{st.cfg.registry.model_name}-ensemble",
                "version": registered.ensemble_version,
            },
        },
        "evaluation": distill.evaluation,
        "student": {
            "hard_label_test_acc": distill.hard_label_test_acc,
            "int8_test_acc": distill.int8_test_acc,
            "recovered_gain": distill.recovered_gain,
            "arch": distill.arch,
            "val_acc": distill.val_acc,
            "test_acc": distill.test_acc,
            "num_params": int(distill.num_params),
            "param_ratio": distill.param_ratio,
            "kept": distill.kept,  # the distilled or the hard-label student, and why
            "latency": {
                "p50_ms": distill.latency_p50_ms,
                "p95_ms": distill.latency_p95_ms,
                "rows": distill.latency_rows,
                "budget_ms": distill.budget_ms,
            },
            "search": distill.search,  # every candidate, the front and the choice (None: no search)
        },
        "registered": {
            "name": registered.name,
            "version": registered.version,
            "aliases": registered.aliases,
            "promoted": registered.promoted,
            "reason": registered.reason,
            "previous_champion_test_acc": registered.previous_champion_test_acc,
            "model_uri": registered.model_uri,
        },
        "mlflow": {
            "tracking_uri": st.settings.tracking_uri,
            "experiment": st.settings.experiment_name,
            "parent_run_id": st.run.parent_run_id,
        },
        "optuna": {"storage": search.storage_url, "study_name": search.study_name},
    }
