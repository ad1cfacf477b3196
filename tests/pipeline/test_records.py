"""The stages' records at the Airflow boundary: each one goes to XCom as a small JSON-able dict
and comes back equal; a value that is not the record a stage expects is refused naming the field."""

from __future__ import annotations

import json
import math

import pytest

from mopflow.pipeline.records import (
    KIND_KEY,
    BestTrial,
    DistillRecord,
    EnsembleRecord,
    Record,
    RecordError,
    RegisterRecord,
    RunContext,
    RunResult,
    SearchRecord,
    ShardRecord,
    finite_or_none,
    from_xcom,
)

SHARD = ShardRecord(manifest_uri="/data/shards/ab12/manifest.json", manifest_hash="ab12", reused=False)
RECORDS: list[Record] = [
    RunContext(dag_id="mopflow_retrain", airflow_run_id="manual__1", run_key="k1", parent_run_id="p1"),
    SHARD,
    SearchRecord(
        study_name="m-k1",
        storage_url="postgresql://mopflow:***@db/optuna",
        counts={"COMPLETE": 3, "PRUNED": 1, "FAIL": 0},
        best_trial=2,
        best_val_acc=0.91,
    ),
    EnsembleRecord(
        bundle_uri="/art/runs/k1/ensemble",
        model_uri="runs:/r1/ensemble",
        run_id="r1",
        members=[2, 0],
        member_weights=[2.0, 1.0],
        best_trial_bundle="/art/trials/2",
        best_trial=BestTrial(number=2, params={"family": "mlp", "width": 32}, val_acc=0.91, test_acc=0.9),
        val_acc=0.93,
        test_acc=0.92,
        best_trial_val_acc=0.91,
        best_trial_test_acc=0.9,
        num_params=1234.0,
    ),
    DistillRecord(
        bundle_uri="/art/runs/k1/student",
        model_uri="runs:/r2/student",
        run_id="r2",
        arch={"family": "cnn", "params": {"width": 8}},
        kept={"student": "distilled", "reason": "better on validation"},
        evaluation=[{"model": "ensemble", "test_acc": 0.92}],
        val_acc=0.9,
        test_acc=0.89,
        num_params=100.0,
        param_ratio=0.08,
        distilled_val_acc=0.9,
        distilled_test_acc=0.89,
        hard_label_val_acc=0.85,
        hard_label_test_acc=0.84,
        int8_test_acc=0.88,
    ),
    RegisterRecord(
        summary_uri="/art/runs/k1/summary.json",
        name="m-student",
        version="3",
        ensemble_version="3",
        aliases=["challenger", "champion"],
        promoted=True,
        reason="there is no champion yet",
        previous_champion_test_acc=None,
        model_uri="models:/m-student@champion",
    ),
    RunResult(run_key="k1", summary_uri="/art/runs/k1/summary.json"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_goes_through_xcom_as_json_and_comes_back_equal(record: Record) -> None:
    xcom = json.loads(json.dumps(record.to_xcom(), allow_nan=False))  # what XCom stores: plain JSON
    assert xcom[KIND_KEY] == record.KIND
    assert from_xcom(xcom) == record
    assert type(record).from_xcom(xcom) == record


def test_a_record_is_frozen_and_read_by_attribute() -> None:
    assert SHARD.manifest_hash == "ab12" and SHARD.reused is False
    with pytest.raises(ValueError, match="frozen"):
        SHARD.reused = True  # type: ignore[misc]


def test_a_missing_field_is_named() -> None:
    xcom = SHARD.to_xcom()
    del xcom["manifest_hash"]
    with pytest.raises(RecordError, match=r"bad shard record in XCom: field 'manifest_hash': Field required"):
        from_xcom(xcom)


def test_a_field_of_the_wrong_type_is_named() -> None:
    xcom = RECORDS[2].to_xcom() | {"counts": {"COMPLETE": "many"}}
    with pytest.raises(RecordError, match=r"bad search record in XCom: field 'counts.COMPLETE'"):
        from_xcom(xcom)


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(RecordError, match=r"field 'rows'"):
        ShardRecord.from_xcom(SHARD.to_xcom() | {"rows": 10})


def test_a_value_that_is_no_record_is_refused_clearly() -> None:
    with pytest.raises(RecordError, match="not a mopflow record"):
        from_xcom(["manifest.json"])
    old = {"manifest_uri": "/m.json", "manifest_hash": "ab12", "reused": True}  # an older mopflow's XCom
    with pytest.raises(RecordError, match=r"no 'record' field .*clear the upstream tasks"):
        from_xcom(old)
    with pytest.raises(RecordError, match=r"'record' is 'trial'; expected one of"):
        from_xcom(old | {KIND_KEY: "trial"})


def test_a_record_of_another_kind_is_refused_where_one_kind_is_expected() -> None:
    with pytest.raises(RecordError, match="a 'shard' record where a 'search' record was expected"):
        SearchRecord.from_xcom(SHARD.to_xcom())


def test_figures_that_json_cannot_carry_become_none() -> None:
    figures = finite_or_none({"test_acc": 0.9, "recovered_gain": math.nan, "ratio": math.inf})
    assert figures == {"test_acc": 0.9, "recovered_gain": None, "ratio": None}
