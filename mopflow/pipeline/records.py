"""What each stage hands the next: one typed, frozen record per stage, read by attribute.

A record holds small references only (URIs, ids, a few figures): the data stays where the stage
wrote it. At the Airflow boundary a record travels as XCom: :meth:`Record.to_xcom` makes it a
JSON-able dict that names its kind, and :func:`from_xcom` (or ``SomeRecord.from_xcom``) makes the
record again, or raises :class:`RecordError` naming the field that is missing or bad.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

KIND_KEY = "record"  # the XCom dict's field naming the record's kind


class RecordError(ValueError):
    """An XCom value is not the record a stage expects (a field missing or of the wrong type)."""


class Record(BaseModel):
    """A stage's output: frozen, typed, and no field beyond those declared."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    KIND: ClassVar[str]

    def to_xcom(self) -> dict[str, Any]:
        """The record as a JSON-able dict for XCom, its kind under :data:`KIND_KEY`."""
        return {KIND_KEY: self.KIND, **self.model_dump(mode="json")}

    @classmethod
    def from_xcom(cls, value: Any) -> Self:
        """The record an XCom dict holds; :class:`RecordError` names what is missing or bad."""
        if not isinstance(value, Mapping):
            raise RecordError(
                f"XCom value for a {cls.KIND} record is a {type(value).__name__}, not a mapping"
            )
        fields = dict(value)
        kind = fields.pop(KIND_KEY, cls.KIND)
        if kind != cls.KIND:
            raise RecordError(f"XCom value is a {kind!r} record where a {cls.KIND!r} record was expected")
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            problems = "; ".join(
                f"field {'.'.join(str(part) for part in error['loc']) or '?'!r}: {error['msg']}"
                for error in exc.errors()
            )
            raise RecordError(f"bad {cls.KIND} record in XCom: {problems}") from None


class RunContext(Record):
    """Identity of one pipeline run: the DAG run, the run key, the parent MLflow run, and the config
    keys an upstream task of the user's DAG gave it (over the run's Params, in every stage)."""

    KIND = "run"
    dag_id: str
    airflow_run_id: str
    run_key: str
    parent_run_id: str
    conf_overrides: dict[str, Any] = {}


class ShardRecord(Record):
    """The shard stage's output: the sharded dataset's manifest."""

    KIND = "shard"
    manifest_uri: str
    manifest_hash: str
    reused: bool  # the shards were there already (content-addressed): nothing was written


class SearchRecord(Record):
    """The search stage's output: the study and how its trials ended."""

    KIND = "search"
    study_name: str
    storage_url: str  # redacted: no password travels in XCom
    counts: dict[str, int]  # trials per state (COMPLETE, PRUNED, FAIL)
    best_trial: int
    best_val_acc: float | None


class BestTrial(Record):
    """The ensemble's best member: its trial, parameters and accuracies."""

    KIND = "best_trial"
    number: int
    params: dict[str, Any]
    val_acc: float | None
    test_acc: float | None


class EnsembleRecord(Record):
    """The ensemble stage's output: the saved and logged ensemble, its members and figures."""

    KIND = "ensemble"
    bundle_uri: str
    model_uri: str
    run_id: str
    members: list[int]
    member_weights: list[float]
    best_trial_bundle: str
    best_trial: BestTrial
    val_acc: float
    test_acc: float
    best_trial_val_acc: float | None
    best_trial_test_acc: float | None
    num_params: float


class DistillRecord(Record):
    """The distill stage's output: the kept student (logged as a pyfunc), its figures and the
    evaluation report of every model on the test set."""

    KIND = "distill"
    bundle_uri: str
    model_uri: str
    run_id: str
    arch: dict[str, Any]
    kept: dict[str, Any]  # which student was kept, and why (KeptStudent.to_dict)
    evaluation: list[dict[str, Any]]
    val_acc: float
    test_acc: float
    num_params: float
    param_ratio: float
    distilled_val_acc: float | None
    distilled_test_acc: float | None
    hard_label_val_acc: float | None
    hard_label_test_acc: float | None
    int8_test_acc: float | None
    int8_static_test_acc: float | None = None  # only the quantizable families have it
    recovered_gain: float | None = None  # None when the ensemble gained nothing to recover
    # the kept student served by its logged pyfunc on one CPU thread, requests of latency_rows rows
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
    latency_rows: int | None = None
    budget_ms: float | None = None  # student_budget_ms it was sized for (None: none given)
    search: dict[str, Any] | None = None  # the student search (StudentSearchResult.to_dict), when one ran


class RegisterRecord(Record):
    """The register stage's output: the student's new version, the promotion decision, and where
    the run's summary is."""

    KIND = "register"
    summary_uri: str
    name: str
    version: str
    ensemble_version: str
    aliases: list[str]
    promoted: bool
    reason: str
    previous_champion_test_acc: float | None
    model_uri: str


class RunResult(Record):
    """The last task's output: the succeeded run and its summary."""

    KIND = "result"
    run_key: str
    summary_uri: str


RECORDS: dict[str, type[Record]] = {
    cls.KIND: cls
    for cls in (
        RunContext,
        ShardRecord,
        SearchRecord,
        EnsembleRecord,
        DistillRecord,
        RegisterRecord,
        RunResult,
    )
}


def from_xcom(value: Any) -> Record:
    """The record an XCom value holds, of the kind it names; :class:`RecordError` otherwise."""
    if not isinstance(value, Mapping):
        raise RecordError(f"XCom value is a {type(value).__name__}, not a mopflow record")
    if KIND_KEY not in value:
        raise RecordError(
            f"XCom value has no {KIND_KEY!r} field (fields: {sorted(value)}): not a mopflow record, or one "
            "written by an older mopflow; clear the upstream tasks to run them again"
        )
    cls = RECORDS.get(str(value[KIND_KEY]))
    if cls is None:
        raise RecordError(
            f"XCom value's {KIND_KEY!r} is {value[KIND_KEY]!r}; expected one of {sorted(RECORDS)}"
        )
    return cls.from_xcom(value)


def finite_or_none(figures: Mapping[str, float]) -> dict[str, float | None]:
    """Figures for a record, which travels as JSON: NaN and infinities become None."""
    return {k: (float(v) if math.isfinite(v) else None) for k, v in figures.items()}
