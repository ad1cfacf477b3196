"""The stage context: one MLflow run per stage with the lineage tags, FINISHED when the body
returns, reopened (not duplicated) on a retry, and on failure ended with the root cause recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopflow.base.settings import Settings
from mopflow.base.tag_names import STAGE
from mopflow.pipeline.context import (
    RunContext,
    read_failure,
    stage,
    study_name_for,
    tracker_for,
)
from mopflow.pipeline.run import start_pipeline

CONF = {"n_trials": 2, "top_k": 1, "model_name": "ctx"}


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings.from_env({"MOPFLOW_HOME": str(tmp_path / "home")})


def test_a_stage_run_carries_the_lineage_and_is_reopened_on_a_retry(settings: Settings) -> None:
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__ctx", settings)

    def lineage(cfg: object, run: RunContext) -> dict[str, str]:
        return {"mopflow.study": study_name_for(cfg, run)}  # type: ignore[arg-type]

    for _attempt in range(2):
        with stage("search", CONF, ctx, settings, lineage) as st:
            assert st.cfg.search.n_trials == 2 and st.run.run_key == ctx.run_key
            first = st.run_id
    tracker = tracker_for(settings)
    runs = [r for r in tracker.find_runs({"mopflow.run_key": ctx.run_key}) if r.data.tags[STAGE] == "search"]
    assert [r.info.run_id for r in runs] == [first]  # the retry reopened the same run
    tags = runs[0].data.tags
    assert tags["mopflow.study"] == f"ctx-{ctx.run_key}" and tags["mlflow.parentRunId"] == ctx.parent_run_id
    assert runs[0].info.status == "FINISHED"
    assert read_failure(settings, ctx.run_key) is None


def test_a_failing_stage_ends_its_run_and_records_the_root_cause(settings: Settings) -> None:
    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__ctx_fail", settings)
    with pytest.raises(ValueError, match="no such column"), stage("ensemble", CONF, ctx, settings) as st:
        run_id = st.run_id
        raise ValueError("no such column 'px99'")
    assert tracker_for(settings).run_status(run_id) == "FAILED"
    failure = read_failure(settings, ctx.run_key)
    assert failure == {
        "stage": "ensemble",
        "error": "ValueError",
        "message": "no such column 'px99'",
        "permanent": False,
    }


def test_a_bad_conf_is_refused_before_any_run_opens(settings: Settings) -> None:
    from mopflow.pipeline.config import ConfigError

    ctx = start_pipeline(CONF, "mopflow_retrain", "manual__ctx_bad", settings)
    with pytest.raises(ConfigError, match="n_trials"), stage("shard", {"n_trials": -1}, ctx, settings):
        pass
    runs = tracker_for(settings).find_runs({"mopflow.run_key": ctx.run_key})
    assert [r.data.tags[STAGE] for r in runs] == ["pipeline"]
