"""The one place where XCom meets the stages (``operators.call_stage``): the upstream tasks' XCom
dicts arrive at a stage as its typed records, its record leaves as an XCom dict, and a value that
is not the record expected fails the task at once, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from mopflow import operators
from mopflow.pipeline.records import RunContext, SearchRecord, ShardRecord

RUN = RunContext(dag_id="mopflow_retrain", airflow_run_id="manual__x", run_key="k", parent_run_id="p")
SHARD = ShardRecord(manifest_uri="/d/manifest.json", manifest_hash="ab12", reused=True)


@pytest.fixture(autouse=True)
def task_context(monkeypatch: pytest.MonkeyPatch) -> None:
    context = {"params": {"n_trials": 2}, "triggering_asset_events": {}}
    monkeypatch.setattr("airflow.sdk.get_current_context", lambda: context)


def fake_search(conf: dict[str, Any], run: RunContext, shard: ShardRecord) -> SearchRecord:
    assert conf == {"n_trials": 2} and isinstance(run, RunContext) and isinstance(shard, ShardRecord)
    return SearchRecord(
        study_name=f"m-{run.run_key}",
        storage_url="sqlite:///optuna.db",
        counts={"COMPLETE": 2},
        best_trial=0,
        best_val_acc=0.5,
    )


def test_a_task_hands_its_stage_records_and_returns_one_as_xcom() -> None:
    xcom = operators.call_stage(fake_search, RUN.to_xcom(), SHARD.to_xcom())
    assert xcom["record"] == "search"
    assert SearchRecord.from_xcom(xcom).study_name == "m-k"


def test_a_bad_xcom_value_fails_the_task_at_once_naming_the_field() -> None:
    bad = SHARD.to_xcom()
    del bad["manifest_uri"]
    with pytest.raises(
        AirflowFailException, match="RecordError: bad shard record in XCom: field 'manifest_uri'"
    ):
        operators.call_stage(fake_search, RUN.to_xcom(), bad)
