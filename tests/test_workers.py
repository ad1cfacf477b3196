"""`make test`'s split of the suite between its workers."""

from __future__ import annotations

from tests.workers import FILE_SECONDS, file_of, heaviest_first


def test_a_file_is_one_unit() -> None:
    assert file_of("tests/test_docs.py::test_x[a::b]") == "tests/test_docs.py"
    assert file_of("tests/pipeline/test_faults.py::Test::test_y") == "tests/pipeline/test_faults.py"
    # the files whose stacks hold PostgreSQL connections are one unit: they never run at once
    assert file_of("tests/infra/test_airflow_executors.py::test_x") == "tests/infra/test_across_hosts.py"


def test_the_heaviest_files_go_first_and_the_rest_keep_their_order() -> None:
    files = ["tests/a.py", "tests/infra/test_stack.py", "tests/b.py", "tests/infra/cli/test_local_runs.py"]
    assert heaviest_first(files) == [
        "tests/infra/cli/test_local_runs.py",
        "tests/infra/test_stack.py",
        "tests/a.py",
        "tests/b.py",
    ]


def test_every_weighed_file_exists() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    assert [f for f in FILE_SECONDS if not (root / f).is_file()] == []
