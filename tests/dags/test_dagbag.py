"""DAG integrity: every DAG imports, every task has retries and a timeout, every Param a schema;
the sweep form refuses bad values; the retrain schedule; the promote DAG's wiring; the training pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_IDS = {"mopflow_retrain", "mopflow_sweep", "mopflow_promote"}
PIPELINE_ORDER = ["start", "shard", "search", "ensemble", "distill", "register", "finalize"]


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory: pytest.TempPathFactory) -> Any:
    home = tmp_path_factory.mktemp("airflow_home")
    os.environ.setdefault("AIRFLOW_HOME", str(home))
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def _validated(dag: Any, **changes: Any) -> dict[str, Any]:
    """Validate the DAG's Params with ``changes`` applied, as the trigger form and REST API do."""
    from airflow.sdk.definitions.param import ParamsDict

    params = ParamsDict(dict(dag.params.items()))
    for key, value in changes.items():
        params[key] = value
    return params.validate()


def test_every_dag_imports(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert set(dagbag.dags) == DAG_IDS


def test_every_task_has_retries_and_a_timeout(dagbag: Any) -> None:
    for dag in dagbag.dags.values():
        for task in dag.tasks:
            assert task.retries is not None and task.retries >= 1, (dag.dag_id, task.task_id)
            assert task.execution_timeout is not None, (dag.dag_id, task.task_id)


@pytest.mark.parametrize("dag_id", ["mopflow_retrain", "mopflow_sweep"])
def test_pipeline_dag_shape(dagbag: Any, dag_id: str) -> None:
    dag = dagbag.dags[dag_id]
    assert set(dag.task_ids) == set(PIPELINE_ORDER)
    for upstream, downstream in zip(PIPELINE_ORDER, PIPELINE_ORDER[1:], strict=False):
        assert downstream in dag.get_task(upstream).downstream_task_ids
    assert dag.get_task("finalize").trigger_rule == "all_done"
    # Transient failures are retried with exponential backoff, capped.
    search = dag.get_task("search")
    assert search.retry_exponential_backoff >= 2 and search.max_retry_delay is not None


@pytest.mark.parametrize("dag_id", ["mopflow_retrain", "mopflow_sweep"])
def test_training_tasks_use_the_pool_and_nothing_else_does(dagbag: Any, dag_id: str) -> None:
    dag = dagbag.dags[dag_id]
    pools = {t.task_id: t.pool for t in dag.tasks}
    assert pools.pop("search") == "mopflow_training"
    assert pools.pop("distill") == "mopflow_training"
    assert "mopflow_training" not in pools.values()


def _first_timed_run(dag: Any, now: datetime) -> datetime | None:
    """When the scheduler would start ``dag``'s first timed run, with the wall clock at ``now``
    (the DAG round-tripped through serialization, as the scheduler sees it)."""
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.timetables import trigger
    from airflow.timetables.base import TimeRestriction

    timetable = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).timetable
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trigger, "utcnow", lambda: now)
        first = timetable.next_dagrun_info(
            last_automated_data_interval=None,
            restriction=TimeRestriction(earliest=dag.start_date, latest=None, catchup=dag.catchup),
        )
    return None if first is None else first.run_after


def test_retrain_runs_on_its_timetable_or_new_sharded_data(dagbag: Any) -> None:
    from airflow.sdk import Asset, AssetOrTimeSchedule

    dag = dagbag.dags["mopflow_retrain"]
    if os.environ.get("MOPFLOW_RETRAIN_SCHEDULE", "@weekly").lower() in {"", "none"}:
        pytest.skip("schedule disabled by MOPFLOW_RETRAIN_SCHEDULE")
    assert isinstance(dag.timetable, AssetOrTimeSchedule)
    assert dag.timetable.asset_condition == Asset("mopflow_sharded_dataset")
    # No loop: retrain publishes nothing; only a sweep's shard task does (through the alias).
    assert all(not t.outlets for t in dag.tasks)
    assert [o.name for o in dagbag.dags["mopflow_sweep"].get_task("shard").outlets] == ["mopflow_new_shards"]


# (the wall clock when the DAG is unpaused, the first timed run of @weekly: Sunday 00:00 UTC)
UNPAUSED_AT = [
    ("2026-11-29T00:00:00", "2026-11-29T00:00:00"),  # on the cron time itself: that run is due
    ("2026-11-29T00:18:51", "2026-12-06T00:00:00"),  # minutes after it (Airflow's default ran it)
    ("2026-11-29T16:00:00", "2026-12-06T00:00:00"),  # within a tenth of the week after it
    ("2026-12-01T09:30:00", "2026-12-06T00:00:00"),  # a Tuesday
    ("2026-12-05T23:59:59", "2026-12-06T00:00:00"),  # a second before the next
    ("2026-12-31T23:00:00", "2027-01-03T00:00:00"),  # across a year's end
]


@pytest.mark.parametrize(("now", "expected"), UNPAUSED_AT)
def test_unpausing_the_retrain_waits_for_the_next_cron_time(dagbag: Any, now: str, expected: str) -> None:
    """The promise: unpausing ``mopflow_retrain`` never starts a retrain at once; its first timed
    run is the next cron time (a run due at that very second is the next one)."""
    if os.environ.get("MOPFLOW_RETRAIN_SCHEDULE", "@weekly").lower() != "@weekly":
        pytest.skip("the cases are those of the default @weekly schedule")
    clock = datetime.fromisoformat(now).replace(tzinfo=UTC)
    first = _first_timed_run(dagbag.dags["mopflow_retrain"], clock)
    assert first is not None and first >= clock
    assert first == datetime.fromisoformat(expected).replace(tzinfo=UTC)


def test_retrain_warm_starts_and_sweep_does_not_by_default(dagbag: Any) -> None:
    assert dagbag.dags["mopflow_retrain"].params["warm_start"] is True
    assert dagbag.dags["mopflow_sweep"].params["warm_start"] is False
    assert dagbag.dags["mopflow_retrain"].params["warm_start_studies"] == 1
    assert dagbag.dags["mopflow_sweep"].params["warm_start_studies"] == 0


@pytest.mark.parametrize("dag_id", ["mopflow_retrain", "mopflow_sweep"])
def test_every_param_has_a_schema_and_a_description(dagbag: Any, dag_id: str) -> None:
    from mopflow.pipeline.config import CONF_FIELDS, PipelineConfig

    dag = dagbag.dags[dag_id]
    assert set(dag.params.keys()) == set(CONF_FIELDS)
    for key in dag.params:
        param = dag.params.get_param(key)
        assert param.schema.get("type") or param.schema.get("anyOf"), key
        assert param.description, key
    # The defaults form a valid pipeline config (what a trigger with no conf runs).
    PipelineConfig.from_conf(_validated(dag))


def _form_requires(schema: dict[str, Any]) -> bool:
    """Airflow's trigger form rule: a field is required unless its schema's type allows null."""
    kind = schema.get("type")
    return bool(kind) and (not isinstance(kind, list) or "null" not in kind)


@pytest.mark.parametrize("dag_id", sorted(DAG_IDS))
def test_the_trigger_form_accepts_every_dag_s_defaults(dagbag: Any, dag_id: str) -> None:
    dag = dagbag.dags[dag_id]
    for key in dag.params:
        param = dag.params.get_param(key)
        if _form_requires(param.schema):
            # A required field may not start empty: the form would disable its Trigger button.
            assert param.value not in (None, ""), (dag_id, key, param.schema, param.value)
    _validated(dag)  # every default is valid input for the form's schema


def test_the_form_rule_flags_an_empty_required_string() -> None:
    assert _form_requires({"type": "string"}) and _form_requires({"type": ["string"]})
    assert not _form_requires({"type": ["null", "string"]}) and not _form_requires({"anyOf": []})


@pytest.mark.parametrize("key", ["worker_schedule", "spot_trace"])
@pytest.mark.parametrize("blank", [None, ""])
def test_optional_text_params_accept_a_blank_field(dagbag: Any, key: str, blank: Any) -> None:
    from mopflow.pipeline.config import PipelineConfig

    config = PipelineConfig.from_conf(_validated(dagbag.dags["mopflow_sweep"], **{key: blank}))
    assert config.search.worker_schedule is None and config.search.spot_trace == ""


def test_sweep_form_shows_the_sweep_keys_first() -> None:
    from mopflow import operators as common
    from mopflow.pipeline.config import CONF_FIELDS, FORM_KEYS

    expected = list(FORM_KEYS)  # the config's form order: the one source
    assert expected[:3] == ["dataset", "search_space", "strategy"] and set(expected) <= set(CONF_FIELDS)
    params = common.conf_params()
    assert list(params)[: len(expected)] == expected
    assert all("section" not in params[k].schema for k in expected)
    assert params["n_shards"].schema["section"] == "Advanced"
    with pytest.raises(ValueError, match="no_such_key"):
        common.conf_params({"no_such_key": 1})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("strategy", "threads"),
        ("parallel_trials", 0),
        ("epochs", -3),
        ("n_trials", "many"),
        ("timeout_minutes", 0),
        ("sampler", "nope"),
        ("pruner", "sometimes"),
        ("seed", 1.5),
        ("top_k", 0),
        ("student_max_param_ratio", 2.0),
        ("promotion", "maybe"),
        ("search_space", 12),
        ("dataset", 7),
    ],
)
def test_sweep_params_refuse_bad_values(dagbag: Any, key: str, value: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError) as info:
        _validated(dagbag.dags["mopflow_sweep"], **{key: value})
    assert key in str(info.value)


def test_sweep_params_accept_good_values(dagbag: Any) -> None:
    good = {
        "dataset": "s3://bucket/table.parquet",
        "search_space": '{"families": {"mlp": {"width": {"type": "int", "low": 8, "high": 32}}}}',
        "strategy": "mop",
        "parallel_trials": 3,
        "epochs": 5,
        "n_trials": 6,
        "timeout_minutes": 30,
        "sampler": "random",
        "pruner": "none",
        "seed": 7,
        "top_k": 2,
        "student_max_param_ratio": 0.2,
        "promotion": "never",
    }
    validated = _validated(dagbag.dags["mopflow_sweep"], **good)
    assert {k: validated[k] for k in good} == good


def test_promote_dag_wiring_and_params(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    dag = dagbag.dags["mopflow_promote"]
    assert set(dag.task_ids) == {"choose", "promote", "rollback"}
    assert dag.get_task("choose").downstream_task_ids == {"promote", "rollback"}
    assert dag.schedule is None
    assert _validated(dag, action="rollback", name="mopflow-student")["action"] == "rollback"
    assert _validated(dag, action="promote", name="m.v-2", version=3)["version"] == 3
    for key, value in [("action", "delete"), ("name", "1bad name"), ("version", 0), ("version", "3")]:
        with pytest.raises(ParamValidationError) as info:
            _validated(dag, **{key: value})
        assert key in str(info.value)


WIRING_IMPORTS = {
    "mopflow.base.settings",
    "mopflow.pipeline.config",
    "mopflow.operators",
    "mopflow.operators.tasks",
}


def test_dag_files_only_wire() -> None:
    for name in (
        "dags/retrain.py",
        "dags/sweep.py",
        "dags/promote.py",
        "operators/__init__.py",
        "operators/tasks.py",
    ):
        text = (REPO / "mopflow" / name).read_text()
        module_level = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
        assert module_level, name
        for line in module_level:
            module = line.split()[1]
            if module.startswith("mopflow."):
                # names only (settings imports no library), the config model (pydantic only),
                # and the tasks (mopflow.operators)
                assert module in WIRING_IMPORTS, (name, line)
                continue
            assert module.split(".")[0] not in {"torch", "optuna", "mlflow", "dask"}, (name, line)
    shared = (REPO / "mopflow" / "base" / "settings.py").read_text()
    imported = {
        line.split()[1].split(".")[0] for line in shared.splitlines() if line.startswith(("import ", "from "))
    }
    assert imported <= {"__future__", "json", "os", "collections", "dataclasses", "pathlib", "typing"}, (
        imported
    )
    probe = "import json, sys, mopflow.pipeline.config; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    heavy = {"torch", "optuna", "mlflow", "dask", "distributed", "lightning"} & set(json.loads(loaded.stdout))
    assert not heavy, f"the config model imports {sorted(heavy)}: parsing a DAG file would too"
