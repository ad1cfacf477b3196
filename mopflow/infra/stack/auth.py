"""The stack's secrets on disk: MLflow's basic-auth app (its config and generated admin password)
and Airflow's admin password file, all readable by their owner only."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr

from mopflow.infra.stack.state import stack_dir


class MlflowAuth(BaseModel):
    """MLflow's basic-auth app: its config file and the admin's credentials (the password is kept in
    a 0600 file under the stack folder and handed to the tasks and workers as MLflow's client variables)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config_file: str
    password_file: str
    username: str = "admin"
    password: SecretStr
    secret_key: SecretStr  # the server's Flask key for CSRF tokens


def _private_file(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def owner_only(path: Path) -> None:
    """Make a secret file readable by its owner only (Airflow writes its password file 0644)."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, 0o600)


def airflow_password_file(airflow_home: str, environ: Mapping[str, str]) -> str:
    """Where the simple auth manager keeps the generated admin password (as Airflow computes it:
    ``[core] simple_auth_manager_passwords_file``, else ``AIRFLOW_HOME/simple_auth_manager_passwords.json.generated``)."""
    configured = environ.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", "")
    return configured or os.path.join(airflow_home, "simple_auth_manager_passwords.json.generated")


def prepare_mlflow_auth(home: str | Path) -> MlflowAuth:
    """The basic-auth app's config and admin password under ``<home>/stack`` (0600 files). The password
    is generated once and reused: MLflow only sets it when it creates the admin in an empty user store."""
    folder = stack_dir(home)

    def secret(name: str) -> str:
        file = folder / name
        if file.exists():
            return file.read_text().strip()
        value = secrets.token_urlsafe(24)
        _private_file(file, value + "\n")
        return value

    password_file = folder / "mlflow_admin_password"
    password = secret(password_file.name)
    secret_key = secret("mlflow_flask_secret_key")
    config_file = folder / "mlflow_basic_auth.ini"
    database = Path(home) / "mlflow" / "basic_auth.db"
    database.parent.mkdir(parents=True, exist_ok=True)
    _private_file(
        config_file,
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{database}\n"
        "admin_username = admin\n"
        f"admin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
    )
    return MlflowAuth(
        config_file=str(config_file),
        password_file=str(password_file),
        password=SecretStr(password),
        secret_key=SecretStr(secret_key),
    )
