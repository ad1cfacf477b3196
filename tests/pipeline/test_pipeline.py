"""The stage functions without Airflow: idempotent reruns and the final reconciliation."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from mopflow.base.optuna_storage import make_storage
from mopflow.base.settings import Settings
from mopflow.base.tag_names import BEST_PARAMS, LATENCY_P95, STUDENT_BUDGET_MS
from mopflow.pipeline.config import PipelineConfig
from mopflow.pipeline.context import make_run_key, tracker_for
from mopflow.pipeline.distill import distill_stage
from mopflow.pipeline.ensemble import ensemble_stage
from mopflow.pipeline.records import DistillRecord, RegisterRecord
from mopflow.pipeline.register import register_stage
from mopflow.pipeline.run import finalize_pipeline, start_pipeline
from mopflow.pipeline.search import champion_warm_start, search_stage
from mopflow.pipeline.shard import shard_stage
from mopflow.training.search.space import params_from_optuna
from mopflow.training.search.study import WARM_START_ATTR
from tests.pipeline.confs import SMALL_CONF

# "always": the warm-start test below needs a champion, whatever the accuracies
# a serving budget every student meets, and a student search of 3 candidates: the student is
# chosen, timed and recorded as under a tight budget
CONF = SMALL_CONF | {
    "model_name": "idem",
    "promotion": "always",
    "student_budget_ms": 1000,
    "student_trials": 3,
}


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings.from_env({"MOPFLOW_HOME": str(tmp_path_factory.mktemp("pipe"))})


@pytest.mark.slow
def test_rerunning_stages_creates_no_duplicates(settings: Settings) -> None:
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__test", settings)
    assert champion_warm_start(tracker_for(settings).client, PipelineConfig.from_conf(CONF)) is None
    assert start_pipeline(CONF, "mopflow_retrain", "manual__test", settings) == ctx
    shard = shard_stage(CONF, ctx, settings)
    search = search_stage(CONF, ctx, shard, settings)
    ens = ensemble_stage(CONF, ctx, shard, search, settings)
    student = distill_stage(CONF, ctx, shard, ens, settings)
    first = register_stage(CONF, ctx, shard, search, ens, student, settings)
    _assert_latency_recorded(settings, student, first)
    _assert_student_searched(settings, student)

    # The same run again, stage by stage (an Airflow "clear and rerun").
    shard2 = shard_stage(CONF, ctx, settings)
    assert shard2.reused and shard2.manifest_hash == shard.manifest_hash
    search2 = search_stage(CONF, ctx, shard2, settings)
    assert search2.study_name == search.study_name
    second = register_stage(CONF, ctx, shard2, search2, ens, student, settings)
    assert second.version == first.version == "1"

    study = optuna.load_study(study_name=search.study_name, storage=make_storage(settings.optuna_storage))
    assert len(study.trials) == CONF["n_trials"]
    # the study names its objective and the run it belongs to (optuna-dashboard shows both)
    assert study.metric_names == ["val_acc"]
    assert study.user_attrs["mopflow.run_key"] == ctx.run_key
    assert study.user_attrs["mopflow.airflow_run_id"] == "manual__test"
    assert study.user_attrs["mopflow.mlflow_parent_run_id"] == ctx.parent_run_id
    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)
    assert len(client.search_model_versions("name='idem-student'")) == 1
    assert len(client.search_model_versions("name='idem-ensemble'")) == 1
    experiment = client.get_experiment_by_name(settings.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{ctx.run_key}'")
    stage_tags = [r.data.tags["mopflow.stage"] for r in runs]
    assert (
        stage_tags.count("pipeline") == 1
        and stage_tags.count("search") == 1
        and stage_tags.count("register") == 1
    )
    assert stage_tags.count("trial") == CONF["n_trials"]

    # A run left RUNNING (a killed task) is closed by finalize; the parent ends FINISHED.
    tracker = tracker_for(settings)
    dangling = tracker.start_run("killed", {"mopflow.run_key": ctx.run_key, "mopflow.stage": "ghost"})
    finalize_pipeline(ctx, settings)
    assert client.get_run(dangling).info.status == "FAILED"
    assert client.get_run(ctx.parent_run_id).info.status == "FINISHED"


def _assert_latency_recorded(settings: Settings, student: DistillRecord, registered: RegisterRecord) -> None:
    """The student's serving latency and its budget: on the distill run, the registered version,
    the promotion reason and the run's summary."""
    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)
    p95 = student.latency_p95_ms
    assert p95 is not None and 0 < (student.latency_p50_ms or 0) <= p95 <= 1000
    assert client.get_run(student.run_id).data.metrics["latency_p95_ms"] == pytest.approx(p95)
    version = client.get_model_version(registered.name, registered.version)
    assert float(version.tags[LATENCY_P95]) == pytest.approx(p95, abs=1e-3)
    assert version.tags[STUDENT_BUDGET_MS] == "1000"
    assert f"serves 256 rows in p95 {p95:.2f} ms on one CPU thread (budget 1000 ms)" in registered.reason
    summary = json.loads(Path(registered.summary_uri).read_text())
    assert summary["student"]["latency"] == {
        "p50_ms": student.latency_p50_ms,
        "p95_ms": p95,
        "rows": 256,
        "budget_ms": 1000.0,
    }


def _assert_student_searched(settings: Settings, student: DistillRecord) -> None:
    """The registered student is the search's choice, on its Pareto front and within the budget;
    each candidate is a nested run of the distill run."""
    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)
    found = client.download_artifacts(student.run_id, "student_search/candidates.json")
    search = json.loads(Path(found).read_text())
    assert len(search["candidates"]) == 3 and search["cost"] == "latency_p95_ms"
    chosen = next(c for c in search["candidates"] if c["number"] == search["chosen"])
    assert search["chosen"] in search["front"] and chosen["latency_p95_ms"] <= 1000
    assert {"family": chosen["family"], "params": chosen["params"]} == {
        "family": student.arch["family"],
        "params": student.arch["params"],
    }
    nested = client.search_runs(
        [client.get_run(student.run_id).info.experiment_id],
        f"tags.`mlflow.parentRunId` = '{student.run_id}'",
    )
    assert sorted(r.data.tags["mopflow.candidate"] for r in nested) == ["0", "1", "2"]
    assert "student_search/pareto_front.png" in [
        a.path for a in client.list_artifacts(student.run_id, "student_search")
    ]


@pytest.mark.slow
def test_retraining_warm_starts_from_the_champion(settings: Settings) -> None:
    """Runs after the test above, which registered a champion in this module's MLflow."""
    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)
    champion = client.get_model_version_by_alias("idem-student", "champion")
    best = json.loads(champion.tags[BEST_PARAMS])
    conf = CONF | {"warm_start": True, "sampler": "random", "seed": 5}
    ctx = start_pipeline(conf, "mopflow_retrain", "scheduled__warm", settings)
    shard = shard_stage(conf, ctx, settings)
    search = search_stage(conf, ctx, shard, settings)
    study = optuna.load_study(study_name=search.study_name, storage=make_storage(settings.optuna_storage))
    first = study.trials[0]
    assert params_from_optuna(first.params) == best  # the champion's configuration is tried first
    assert first.user_attrs[WARM_START_ATTR] == f"idem-student v{champion.version} (champion)"
    assert len(study.trials) == CONF["n_trials"]  # it counts towards the budget, nothing extra
    assert params_from_optuna(study.trials[1].params) != best


def test_finalize_fails_the_run_when_the_pipeline_did_not_finish(settings: Settings, tmp_path: Path) -> None:
    local = Settings.from_env({"MOPFLOW_HOME": str(tmp_path)})
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__broken", local)
    with pytest.raises(RuntimeError, match="did not complete"):
        finalize_pipeline(ctx, local)
    client = MlflowClient(tracking_uri=local.tracking_uri)
    assert client.get_run(ctx.parent_run_id).info.status == "FAILED"


def test_run_key_is_stable_and_distinct() -> None:
    assert make_run_key("d", "r1") == make_run_key("d", "r1")
    assert make_run_key("d", "r1") != make_run_key("d", "r2")


@pytest.mark.slow
def test_mop_strategy_runs_the_search_and_logs_gantt_charts(tmp_path: Path) -> None:
    local = Settings.from_env({"MOPFLOW_HOME": str(tmp_path)})
    conf = CONF | {"strategy": "mop", "n_trials": 3, "model_slots": 2, "epochs": 2, "model_name": "mop"}
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__mop", local)
    shard = shard_stage(conf, ctx, local)
    search = search_stage(conf, ctx, shard, local)
    assert sum(search.counts.values()) == 3 and search.counts["COMPLETE"] == 3
    client = MlflowClient(tracking_uri=local.tracking_uri)
    experiment = client.get_experiment_by_name(local.experiment_name)
    run = client.search_runs([experiment.experiment_id], "tags.`mopflow.stage` = 'search'")[0]
    names = [f.path for f in client.list_artifacts(run.info.run_id, "mop")]
    assert "mop/gantt-epoch-001.png" in names and "mop/units-epoch-002.json" in names
    assert client.get_metric_history(run.info.run_id, "mop_idle_fraction")
    assert 0 < run.data.metrics["worker_utilisation"] < 1  # inside training and validation passes
    trials = client.search_runs([experiment.experiment_id], "tags.`mopflow.stage` = 'trial'")
    assert len(trials) == 3


@pytest.mark.slow
def test_ddp_strategy_runs_the_search_on_the_dask_workers(tmp_path: Path) -> None:
    local = Settings.from_env({"MOPFLOW_HOME": str(tmp_path)})
    conf = CONF | {"strategy": "ddp", "ddp_world_size": 2, "n_trials": 2, "epochs": 2, "model_name": "ddp"}
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__ddp", local)
    shard = shard_stage(conf, ctx, local)
    search = search_stage(conf, ctx, shard, local)
    assert search.counts == {"COMPLETE": 2, "PRUNED": 0, "FAIL": 0}
    study = optuna.load_study(study_name=search.study_name, storage=make_storage(local.optuna_storage))
    for trial in study.trials:
        assert [h["epoch"] for h in trial.user_attrs["history"]] == [0, 1]
        assert Path(trial.user_attrs["bundle_uri"], "weights.safetensors").exists()


@pytest.mark.slow
def test_a_student_without_static_int8_is_distilled_and_reported_without_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``rescnn`` (residual, BatchNorm) is no quantizable family: the distill stage skips the
    static INT8 form for it instead of failing, and reports the other models."""
    conf = {
        **CONF,
        "search_space": json.dumps(
            {
                "families": {
                    "rescnn": {
                        "width": {"type": "int", "low": 8, "high": 12},
                        "depth": {"type": "int", "low": 1, "high": 2},
                        "shift": {"type": "int", "low": 0, "high": 2},
                    }
                }
            }
        ),
        "student_family": "rescnn",
        "student_depth": 1,
        "student_trials": 0,  # the family as configured, not a search's choice
        "munge_multiplier": 1,
        "model_name": "rescnn-student",
    }
    settings = Settings.from_env({"MOPFLOW_HOME": str(tmp_path_factory.mktemp("rescnn"))})
    ctx = start_pipeline(conf, "mopflow_retrain", "manual__rescnn", settings)
    shard = shard_stage(conf, ctx, settings)
    search = search_stage(conf, ctx, shard, settings)
    ens = ensemble_stage(conf, ctx, shard, search, settings)
    student = distill_stage(conf, ctx, shard, ens, settings)
    assert student.arch["family"] == "rescnn"
    assert student.param_ratio <= 0.1
    assert student.int8_static_test_acc is None and student.int8_test_acc is not None
    rows = [row["model"] for row in student.evaluation]
    assert "student int8 (static)" not in rows
    assert {"ensemble", "student", "student int8 (dynamic)", "hard-label student"} <= set(rows)
