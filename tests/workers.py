"""How `make test` shares the suite between its pytest-xdist workers: whole files, the heaviest
first, so that no long file starts last and leaves one worker running alone at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

# Seconds a file took on one worker of a 2-CPU machine (`--durations`, 2026-11-29), for the files
# over about a minute; any other file weighs less than each of them. Only their order matters: a
# stale figure costs balance, never a test.
FILE_SECONDS: Mapping[str, float] = {
    # with the other file of SAME_WORKER
    "tests/infra/test_across_hosts.py": 700,
    "tests/infra/cli/test_local_runs.py": 420,
    "tests/benchmarks/test_quick.py": 400,
    "tests/infra/test_stack.py": 330,
    "tests/pipeline/test_faults.py": 200,
    "tests/dags/test_end_to_end_images.py": 110,
    "tests/dags/test_end_to_end.py": 110,
    "tests/test_packaging.py": 100,
    "tests/pipeline/test_pipeline.py": 80,
    "tests/training/volatile/test_volatile_sweeps.py": 70,
    "tests/training/volatile/test_spot_replay.py": 70,
    "tests/training/search/test_scaling.py": 60,
    "tests/benchmarks/test_strategies.py": 60,
}


# Files that run on one worker, one after the other, as one unit (named by the first): the files
# whose stacks and servers hold PostgreSQL connections (Airflow's, MLflow's and Optuna's pools,
# Celery's result backend). Two of them at once exhausted the server's 100 connections ("sorry,
# too many clients already"), and an Airflow scheduler died of it.
SAME_WORKER: Mapping[str, str] = {
    "tests/infra/test_airflow_executors.py": "tests/infra/test_across_hosts.py",
}


def file_of(nodeid: str) -> str:
    """The unit of work a test id belongs to: its file, or the file it runs beside
    (:data:`SAME_WORKER`)."""
    file = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(file, file)


def heaviest_first(files: list[str], seconds: Mapping[str, float] = FILE_SECONDS) -> list[str]:
    """``files`` in the order they are handed out: the known heavy ones by their seconds, then
    the rest as collected."""
    return sorted(files, key=lambda f: -seconds.get(f, 0.0))


class HeaviestFileFirstScheduling(LoadFileScheduling):
    """Whole test files go to the next free worker, as with ``--dist loadfile``, the heaviest
    (:data:`FILE_SECONDS`) first."""

    def __init__(self, config: pytest.Config, log: Any) -> None:
        super().__init__(config, log)
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return file_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # once, at the first hand-out, when the queue holds every file
            order = heaviest_first(list(self.workqueue))
            self.workqueue = type(self.workqueue)((f, self.workqueue[f]) for f in order)
            self._ordered = True
        super()._assign_work_unit(node)
