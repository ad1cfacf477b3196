"""What only some set-ups need comes with extras, and a missing one is named before anything starts."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mopflow.base.extras import (
    EXTRA_MODULES,
    MissingExtraError,
    extras_needed,
    importable,
    require_extras_of,
)

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {
        r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for r in requirements
    }


def test_the_core_install_leaves_the_stack_s3_postgresql_and_celery_to_their_extras() -> None:
    core = _names(PYPROJECT["dependencies"])
    extras = PYPROJECT["optional-dependencies"]
    optional = {"optuna-dashboard", "s3fs", "boto3", "psycopg2-binary", "asyncpg", "celery", "redis"}
    assert not core & optional and "apache-airflow-providers-celery" not in core
    assert optional | {"apache-airflow-providers-celery"} <= _names(
        [r for extra in ("stack", "s3", "postgres", "celery") for r in extras[extra]]
    )
    assert extras["scale-out"] == ["mopflow[stack,s3,postgres,celery]"]
    assert any(r.startswith("mopflow[") and "scale-out" in r for r in extras["dev"])  # the tests use all
    assert set(EXTRA_MODULES) <= set(extras)
    assert all(importable(m) for modules in EXTRA_MODULES.values() for m in modules)  # dev has them


def test_settings_say_which_extras_a_set_up_needs() -> None:
    assert extras_needed({}) == []  # the embedded defaults need none
    scale_out = {
        "MOPFLOW_OPTUNA_STORAGE": "postgresql+psycopg2://u:secret@db:5432/optuna",
        "MOPFLOW_DATA_ROOT": "s3://bucket/data",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor,CeleryExecutor",
    }
    assert extras_needed(scale_out) == [
        ("postgres", "MOPFLOW_OPTUNA_STORAGE"),
        ("s3", "MOPFLOW_DATA_ROOT"),
        ("celery", "AIRFLOW__CORE__EXECUTOR"),
    ]
    assert extras_needed({"AIRFLOW__CORE__EXECUTOR": "LocalExecutor", "MOPFLOW_DATA_ROOT": "/d"}) == []
    missing = {"psycopg2"}
    with pytest.raises(MissingExtraError) as refused:
        require_extras_of(scale_out, lambda name: name not in missing)
    message = str(refused.value)
    assert "needs the postgres extra" in message and "no module psycopg2" in message
    assert "pip install 'mopflow[postgres]'" in message and "secret" not in message  # no password shown
    require_extras_of(scale_out, lambda name: True)


def test_the_cli_refuses_a_set_up_whose_extra_is_missing_with_exit_2(tmp_path: Path) -> None:
    # a Python without s3fs (an import of it fails as for a package not installed)
    code = (
        "import sys; sys.modules['s3fs'] = None; "
        "from mopflow.infra.cli.parser import main; sys.exit(main(['settings']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_DATA_ROOT": "s3://bucket/data", "PATH": ""},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "mopflow: MOPFLOW_DATA_ROOT='s3://bucket/data' needs the s3 extra, which is not installed "
        "(no module s3fs): pip install 'mopflow[s3]'"
    )
