"""The stack's secrets: Airflow's password file where Airflow puts it, MLflow's basic-auth
files and the Airflow secrets shared across hosts private and reused, and a server with auth on
refusing anonymous clients."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from mopflow.infra.stack.auth import (
    AIRFLOW_SECRETS,
    airflow_password_file,
    owner_only,
    prepare_airflow_secrets,
    prepare_mlflow_auth,
)
from mopflow.infra.stack.config import config_from_env
from mopflow.infra.stack.probes import free_port
from mopflow.infra.stack.processes import spawn, stop_services, wait_healthy
from mopflow.infra.stack.specs import build_specs
from mopflow.infra.stack.state import stack_dir
from tests.infra.stack.helpers import BIN, settings_at
from tests.rest import request_json


def test_airflow_password_file_follows_airflow_config(tmp_path: Path) -> None:
    default = airflow_password_file(str(tmp_path), {})
    assert default == str(tmp_path / "simple_auth_manager_passwords.json.generated")
    custom = {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": "/x/pw.json"}
    assert airflow_password_file(str(tmp_path), custom) == "/x/pw.json"


def test_mlflow_auth_secrets_are_private_and_reused(tmp_path: Path) -> None:
    auth = prepare_mlflow_auth(tmp_path)
    password = auth.password.get_secret_value()
    assert len(password) >= 20 and password not in repr(auth)
    for file in (auth.password_file, auth.config_file):
        assert os.stat(file).st_mode & 0o777 == 0o600
    config = Path(auth.config_file).read_text()
    assert f"admin_password = {password}" in config
    assert f"database_uri = sqlite:///{tmp_path / 'mlflow' / 'basic_auth.db'}" in config
    assert prepare_mlflow_auth(tmp_path).password.get_secret_value() == password


def test_owner_only_hides_a_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw.json"
    secret.write_text("{}")
    secret.chmod(0o644)
    owner_only(secret)
    assert secret.stat().st_mode & 0o777 == 0o600
    owner_only(tmp_path / "missing")  # Airflow writes it only when it generates a password


@pytest.mark.slow
def test_mlflow_with_auth_refuses_anonymous_clients(tmp_path: Path) -> None:
    import base64

    config = config_from_env({}, {}, True, 1, free_port, mlflow_auth=True)
    auth = prepare_mlflow_auth(tmp_path)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOPFLOW_")}
    spec = next(
        s for s in build_specs(settings_at(tmp_path), config, BIN, environ, auth=auth) if s.name == "mlflow"
    )
    rec = spawn(spec, tmp_path / "logs")
    try:
        wait_healthy([rec], 180, lambda _: None)  # /health needs no credentials
        url = f"{rec.url}/api/2.0/mlflow/experiments/search?max_results=1"
        assert request_json("GET", url)[0] == 401
        token = base64.b64encode(f"admin:{auth.password.get_secret_value()}".encode()).decode()
        req = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(req, timeout=30) as response:
            assert response.status == 200
    finally:
        stop_services([rec], grace_s=10)


def test_shared_airflow_secrets_are_generated_once_private_and_reused(tmp_path: Path) -> None:
    from cryptography.fernet import Fernet

    home, airflow_home = tmp_path / "home", str(tmp_path / "airflow")
    first = prepare_airflow_secrets(home, airflow_home, {})
    assert set(first) == set(AIRFLOW_SECRETS)
    assert len(set(first.values())) == 3
    # The keys of Airflow's HS512 tokens: 64 random bytes, as RFC 7518 asks for.
    for var in ("AIRFLOW__API__SECRET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET"):
        assert len(first[var]) == 86  # 64 bytes in URL-safe base64
    Fernet(first["AIRFLOW__CORE__FERNET_KEY"].encode())  # a key Airflow can use
    for name in AIRFLOW_SECRETS.values():
        assert os.stat(stack_dir(home) / name).st_mode & 0o777 == 0o600
    assert prepare_airflow_secrets(home, airflow_home, {}) == first  # the same on every later start
    assert prepare_airflow_secrets(tmp_path / "other", airflow_home, {}) != first  # another stack's own


def test_shared_airflow_secrets_keep_airflows_fernet_key_and_yield_to_the_environment(tmp_path: Path) -> None:
    """Airflow's airflow.cfg holds the Fernet key its connections were encrypted with: it is kept.
    A secret the environment sets (or has a command for) is the user's: not generated."""
    airflow_home = tmp_path / "airflow"
    airflow_home.mkdir()
    (airflow_home / "airflow.cfg").write_text("[core]\nfernet_key = kept%fernet\n[api]\nsecret_key = short\n")
    environ = {"AIRFLOW__API_AUTH__JWT_SECRET_CMD": "cat /run/jwt"}
    chosen = prepare_airflow_secrets(tmp_path / "home", str(airflow_home), environ)
    assert set(chosen) == {"AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API__SECRET_KEY"}
    assert chosen["AIRFLOW__CORE__FERNET_KEY"] == "kept%fernet"
    assert chosen["AIRFLOW__API__SECRET_KEY"] != "short"  # a signing key is made long enough
    assert not (stack_dir(tmp_path / "home") / "airflow_jwt_secret").exists()
    later = prepare_airflow_secrets(tmp_path / "home", str(airflow_home), {"AIRFLOW__API__SECRET_KEY": "x"})
    assert set(later) == {"AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET"}  # the JWT's made now
    assert later["AIRFLOW__CORE__FERNET_KEY"] == "kept%fernet"


def test_without_generating_only_the_secrets_an_earlier_stack_kept_are_given(tmp_path: Path) -> None:
    """A stack on loopback makes none, but keeps in force those an earlier stack on another
    address made: connections may be encrypted with their Fernet key."""
    home, airflow_home = tmp_path / "home", str(tmp_path / "airflow")
    assert prepare_airflow_secrets(home, airflow_home, {}, generate=False) == {}
    assert not stack_dir(home).exists()
    made = prepare_airflow_secrets(home, airflow_home, {})
    assert prepare_airflow_secrets(home, airflow_home, {}, generate=False) == made
