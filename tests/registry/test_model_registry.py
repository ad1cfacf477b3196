"""Promotion and rollback against a real MLflow registry (SQLite)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from mopflow.registry.model_registry import CHAMPION, RegistryError, promote, rollback, set_alias

REPO = Path(__file__).resolve().parents[2]


def _client_with_versions(tmp_path: Path, n: int) -> tuple[MlflowClient, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("m-student")
    for _ in range(n):
        client.create_model_version("m-student", source=str(tmp_path / "model"))
    return client, uri


def test_promote_then_rollback_brings_the_previous_champion_back(tmp_path: Path) -> None:
    client, _ = _client_with_versions(tmp_path, 3)
    set_alias(client, "m-student", CHAMPION, "1")
    set_alias(client, "m-student", CHAMPION, "2")
    assert "champion 2 -> 3" in promote(client, "m-student", "3")
    assert str(client.get_model_version_by_alias("m-student", CHAMPION).version) == "3"
    rollback(client, "m-student")
    assert str(client.get_model_version_by_alias("m-student", CHAMPION).version) == "2"
    rollback(client, "m-student")
    assert str(client.get_model_version_by_alias("m-student", CHAMPION).version) == "1"
    with pytest.raises(RegistryError, match="no previous champion"):
        rollback(client, "m-student")
    with pytest.raises(RegistryError, match="no version '9'"):
        promote(client, "m-student", "9")


def test_cli_promote_and_rollback(tmp_path: Path) -> None:
    _, uri = _client_with_versions(tmp_path, 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    env |= {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_TRACKING_URI": uri}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mopflow.infra.cli", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert cli("promote", "m-student", "1").returncode == 0
    out = cli("promote", "m-student", "2")
    assert out.returncode == 0 and "champion 1 -> 2" in out.stdout
    back = cli("rollback", "m-student")
    assert back.returncode == 0 and "-> 1" in back.stdout
    bad = cli("promote", "m-student", "7")
    assert bad.returncode == 2 and "no version '7'" in bad.stderr


def test_the_installed_packages_are_indexed_once_ahead_of_any_model_log() -> None:
    """The warm executors index the installed distributions before they fork: a task that logs a
    model then finds MLflow's index built (MLflow builds it only while it is missing)."""
    from mlflow.utils import requirements_utils

    from mopflow.registry.model_registry import index_installed_packages

    assert index_installed_packages()
    distributions = requirements_utils._MODULES_TO_PACKAGES  # the costly part, built once
    assert requirements_utils._PACKAGES_TO_MODULES["mlflow"] == "mlflow"
    assert index_installed_packages()
    assert requirements_utils._MODULES_TO_PACKAGES is distributions


def test_the_package_zips_whole_without_caches_and_the_same_code_to_the_same_bytes(tmp_path: Path) -> None:
    """A logged model's code is one file: every file of the package (the pyfunc's own module among
    them, no bytecode caches), under ``mopflow/``, the same bytes from the same code."""
    import zipfile

    import mopflow
    from mopflow.registry.model_registry import zip_package

    package = Path(mopflow.__file__).resolve().parent
    first, second = zip_package(tmp_path / "a.zip"), zip_package(tmp_path / "b.zip")
    assert first.read_bytes() == second.read_bytes()
    names = set(zipfile.ZipFile(first).namelist())
    expected = {
        f"mopflow/{f.relative_to(package).as_posix()}"
        for f in package.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"
    }
    assert names == expected and "mopflow/registry/pyfunc_model.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
