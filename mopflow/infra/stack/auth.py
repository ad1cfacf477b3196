"""The stack's secrets on disk: MLflow's basic-auth app (its config and generated admin password),
Airflow's admin password file and the Airflow secrets every host of the stack shares, all readable
by their owner only."""

from __future__ import annotations

import base64
import configparser
import contextlib
import os
import secrets
from collections.abc import Callable, Mapping
from functools import partial
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


def private_file(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def _token() -> str:
    return secrets.token_urlsafe(24)


def _stored_secret(file: Path, make: Callable[[], str]) -> str:
    """The secret kept in ``file``; made by ``make`` and kept there (0600) the first time."""
    if file.exists():
        return file.read_text().strip()
    value = make()
    private_file(file, value + "\n")
    return value


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
    password_file = folder / "mlflow_admin_password"
    password = _stored_secret(password_file, _token)
    secret_key = _stored_secret(folder / "mlflow_flask_secret_key", _token)
    config_file = folder / "mlflow_basic_auth.ini"
    database = Path(home) / "mlflow" / "basic_auth.db"
    database.parent.mkdir(parents=True, exist_ok=True)
    private_file(
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


# The Airflow settings every host that runs an Airflow component must share, each kept under
# <home>/stack: the api-server's key, which signs the tokens a log fetch shows the log server of the
# worker that ran the task; the JWT secret of the Execution API tokens the scheduler gives each
# task; the Fernet key of the connections and variables in the metadata database. A host that
# makes its own refuses the others' tokens and cannot read their connections.
# variable -> file under <home>/stack
AIRFLOW_SECRETS: dict[str, str] = {
    "AIRFLOW__API__SECRET_KEY": "airflow_api_secret_key",
    "AIRFLOW__API_AUTH__JWT_SECRET": "airflow_jwt_secret",
    "AIRFLOW__CORE__FERNET_KEY": "airflow_fernet_key",
}
FERNET_KEY_ENV = "AIRFLOW__CORE__FERNET_KEY"


def set_in_environment(var: str, environ: Mapping[str, str]) -> bool:
    """Whether the environment gives Airflow the setting ``var``: itself, or as a command or a
    secrets backend's key (``_CMD``, ``_SECRET``), which every host runs or reads alike."""
    return any(environ.get(var + suffix, "").strip() for suffix in ("", "_CMD", "_SECRET"))


def _airflow_cfg_fernet_key(airflow_home: str, environ: Mapping[str, str]) -> str:
    """The Fernet key in the ``airflow.cfg`` Airflow wrote in its home (empty when there is none)."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    path = environ.get("AIRFLOW_CONFIG") or os.path.join(airflow_home, "airflow.cfg")
    try:
        parser.read(path)
    except configparser.Error:  # not a config Airflow could read either: nothing to keep
        return ""
    return parser.get("core", "fernet_key", fallback="").strip()


def _new_secret(var: str, airflow_home: str, environ: Mapping[str, str]) -> str:
    """A first value for one of :data:`AIRFLOW_SECRETS`. The Fernet key Airflow already wrote in
    its ``airflow.cfg`` is kept: connections may be encrypted with it. Else a Fernet key (32 random
    bytes, URL-safe base64, as ``Fernet.generate_key``), or 64 random bytes for the keys that sign
    Airflow's HS512 tokens (shorter keys are below what RFC 7518 asks for)."""
    if var == FERNET_KEY_ENV:
        return (
            _airflow_cfg_fernet_key(airflow_home, environ)
            or base64.urlsafe_b64encode(os.urandom(32)).decode()
        )
    return secrets.token_urlsafe(64)


def prepare_airflow_secrets(
    home: str | Path, airflow_home: str, environ: Mapping[str, str], generate: bool = True
) -> dict[str, str]:
    """The :data:`AIRFLOW_SECRETS` the environment does not set, as variables for every Airflow
    component: each kept in a 0600 file under ``<home>/stack`` and the same on every later call.

    With ``generate`` a missing one is made (:func:`_new_secret`); without it (a stack on loopback,
    where every component reads the one ``airflow.cfg``) only those an earlier stack kept are
    returned: what was encrypted with their Fernet key stays readable."""
    folder = stack_dir(home)
    chosen: dict[str, str] = {}
    for var, name in AIRFLOW_SECRETS.items():
        if set_in_environment(var, environ) or not (generate or (folder / name).exists()):
            continue
        chosen[var] = _stored_secret(folder / name, partial(_new_secret, var, airflow_home, environ))
    return chosen
