"""`make test`'s split of the suite between its workers."""

from __future__ import annotations

from tests.conftest import SERVICES_FILES
from tests.workers import SERVICES_UNIT, work_unit


def test_a_file_is_one_unit_and_the_files_of_the_local_servers_are_one_together() -> None:
    units = {
        work_unit(nodeid, SERVICES_FILES)
        for nodeid in (
            "tests/infra/test_airflow_executors.py::test_celery_executor_runs_a_sweep_through_a_redis_worker",
            "tests/infra/stages/test_faults.py::test_postgresql_restart_mid_sweep_loses_and_duplicates_no_trial",
            "tests/infra/stages/test_faults.py::test_dask_worker_killed_mid_unit_leaves_the_pipeline_result_complete",
        )
    }
    assert units == {SERVICES_UNIT}
    assert work_unit("tests/test_docs.py::test_x[a::b]", SERVICES_FILES) == "tests/test_docs.py"
