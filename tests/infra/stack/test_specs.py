"""The services' command lines and environments: wired to one another and to one home, on
127.0.0.1; settings pointing at other hosts refused; MLflow's basic auth handed to every client."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mopflow.infra.stack.auth import prepare_mlflow_auth
from mopflow.infra.stack.config import StackError, config_from_env
from mopflow.infra.stack.services import SERVICE_ORDER
from mopflow.infra.stack.specs import build_specs
from tests.infra.stack.helpers import BIN, REPO, counter, settings_at, stack_config


def test_services_are_wired_to_one_another(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = stack_config()
    p = config.ports
    environ = {"PATH": "/usr/bin", "MLFLOW_TRACKING_URI": "sqlite:///elsewhere.db", "HOME": "/root"}
    specs = {s.name: s for s in build_specs(settings_at(home), config, BIN, environ)}
    assert list(specs) == list(SERVICE_ORDER)
    airflow = specs["airflow"].env
    assert airflow["MOPFLOW_TRACKING_URI"] == f"http://127.0.0.1:{p.mlflow}"
    assert airflow["MOPFLOW_DASK_ADDRESS"] == f"tcp://127.0.0.1:{p.dask_scheduler}"
    assert airflow["MOPFLOW_HOME"] == str(home.resolve())
    assert airflow["MOPFLOW_OPTUNA_STORAGE"] == str(home.resolve() / "optuna" / "journal.log")
    assert airflow["AIRFLOW_HOME"] == str(home.resolve() / "airflow")
    assert airflow["AIRFLOW__CORE__DAGS_FOLDER"] == str(REPO / "mopflow" / "dags")  # the package's
    # not the package's plugins/: the plugin loads through its entry point, and only once
    assert airflow["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(home.resolve() / "airflow" / "plugins")
    assert airflow["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False"
    assert airflow["AIRFLOW__API__PORT"] == str(p.airflow)
    assert airflow["AIRFLOW__API__BASE_URL"] == f"http://127.0.0.1:{p.airflow}"
    assert airflow["MOPFLOW_MLFLOW_UI_URL"] == f"http://127.0.0.1:{p.mlflow}"  # the plugin's links
    assert airflow["MOPFLOW_OPTUNA_DASHBOARD_URL"] == f"http://127.0.0.1:{p.optuna}"
    assert airflow["PATH"].split(os.pathsep)[0] == BIN
    for spec in specs.values():
        assert not any(k.startswith("MLFLOW_") for k in spec.env if k != "MLFLOW_SERVER_ENABLE_JOB_EXECUTION")
        assert spec.env["MOPFLOW_HOME"] == str(home.resolve())  # workers and servers share the home
    mlflow = specs["mlflow"].argv
    assert (
        mlflow[mlflow.index("--backend-store-uri") + 1]
        == f"sqlite:///{home.resolve() / 'mlflow' / 'mlflow.db'}"
    )
    assert mlflow[mlflow.index("--port") + 1] == str(p.mlflow)
    assert "127.0.0.1" in mlflow and "0.0.0.0" not in " ".join(mlflow)
    optuna = specs["optuna-dashboard"].argv
    assert optuna[1] == str(home.resolve() / "optuna" / "journal.log")
    assert f"tcp://127.0.0.1:{p.dask_scheduler}" in specs["dask-workers"].argv
    assert specs["dask-workers"].checks[0].min_workers == 2


def test_a_users_ui_url_for_the_plugin_wins(tmp_path: Path) -> None:
    environ = {"MOPFLOW_MLFLOW_UI_URL": "https://mlflow.example"}
    specs = {s.name: s for s in build_specs(settings_at(tmp_path), stack_config(), BIN, environ)}
    assert specs["airflow"].env["MOPFLOW_MLFLOW_UI_URL"] == "https://mlflow.example"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MOPFLOW_TRACKING_URI": "http://127.0.0.1:5000"}, "MOPFLOW_TRACKING_URI='http://127.0.0.1:5000'"),
        ({"MOPFLOW_DASK_ADDRESS": "tcp://10.0.0.1:8786"}, "MOPFLOW_DASK_ADDRESS='tcp://10.0.0.1:8786'"),
    ],
)
def test_settings_pointing_at_other_servers_are_refused(
    tmp_path: Path, env: dict[str, str], needle: str
) -> None:
    with pytest.raises(StackError, match=needle):
        build_specs(settings_at(tmp_path, **env), stack_config(), BIN, {})


def test_mlflow_auth_wires_the_server_and_its_clients(tmp_path: Path) -> None:
    config = config_from_env({"MOPFLOW_STACK_AUTH": "1"}, {}, True, 2, counter())
    assert config.mlflow_auth
    with pytest.raises(StackError, match="no credentials"):
        build_specs(settings_at(tmp_path), config, BIN, {})
    auth = prepare_mlflow_auth(tmp_path)
    specs = {s.name: s for s in build_specs(settings_at(tmp_path), config, BIN, {}, auth=auth)}
    assert specs["mlflow"].argv[-2:] == ("--app-name", "basic-auth")
    assert specs["mlflow"].env["MLFLOW_AUTH_CONFIG_PATH"] == auth.config_file
    for name in ("airflow", "dask-workers"):
        assert specs[name].env["MLFLOW_TRACKING_USERNAME"] == "admin"
        assert specs[name].env["MLFLOW_TRACKING_PASSWORD"] == auth.password.get_secret_value()
    plain = {s.name: s for s in build_specs(settings_at(tmp_path), stack_config(), BIN, {})}
    assert "--app-name" not in plain["mlflow"].argv and "MLFLOW_TRACKING_PASSWORD" not in plain["airflow"].env


def test_the_stacks_workers_use_the_storage_options_a_task_sends(tmp_path: Path) -> None:
    """The stack's Dask workers share its host: they set no storage options of their own, so a
    task's (an Airflow connection's included, which they never see) are the ones they use."""
    options = '{"endpoint_url": "http://127.0.0.1:9000"}'
    settings = settings_at(tmp_path, MOPFLOW_STORAGE_OPTIONS=options)
    specs = {s.name: s for s in build_specs(settings, stack_config(), BIN, {})}
    assert specs["airflow"].env["MOPFLOW_STORAGE_OPTIONS"] == options
    assert specs["dask-workers"].env["MOPFLOW_STORAGE_OPTIONS"] == ""


CELERY = {
    "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg2://postgres@10.0.0.5:5432/mopflow_airflow",
    "AIRFLOW__CELERY__BROKER_URL": "redis://10.0.0.5:6379/0",
}


@pytest.mark.parametrize("environ", [{}, CELERY], ids=["standalone", "celery"])
def test_every_server_binds_and_advertises_the_stacks_address(
    tmp_path: Path, environ: dict[str, str]
) -> None:
    config = stack_config(host="10.0.0.5")
    p = config.ports
    specs = {s.name: s for s in build_specs(settings_at(tmp_path), config, BIN, environ)}
    for name, flag in [("mlflow", "--host"), ("optuna-dashboard", "--host"), ("serve", "--host")]:
        argv = specs[name].argv
        assert argv[argv.index(flag) + 1] == "10.0.0.5", name
    scheduler = specs["dask-scheduler"].argv
    assert scheduler[scheduler.index("--host") + 1] == "10.0.0.5"
    assert scheduler[scheduler.index("--dashboard-address") + 1] == f"10.0.0.5:{p.dask_dashboard}"
    workers = specs["dask-workers"].argv
    assert (
        f"tcp://10.0.0.5:{p.dask_scheduler}" in workers and workers[workers.index("--host") + 1] == "10.0.0.5"
    )
    airflow = specs["airflow"].env
    assert airflow["AIRFLOW__API__HOST"] == "10.0.0.5"
    assert airflow["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == f"http://10.0.0.5:{p.airflow}/execution/"
    for spec in specs.values():  # tasks, workers and servers find one another there
        assert spec.env["MOPFLOW_TRACKING_URI"] == f"http://10.0.0.5:{p.mlflow}"
        assert spec.env["MOPFLOW_DASK_ADDRESS"] == f"tcp://10.0.0.5:{p.dask_scheduler}"
        assert spec.env["MOPFLOW_MLFLOW_UI_URL"] == f"http://10.0.0.5:{p.mlflow}"
        # and the health checks look for them there
        where = [spec.url, *(c.url for c in spec.checks)]
        assert all("127.0.0.1" not in url for url in where), (spec.name, where)
        assert "127.0.0.1" not in " ".join(spec.argv)


def test_a_server_setting_on_the_stacks_own_address_names_the_stack(tmp_path: Path) -> None:
    """The profile's loopback URIs and URIs on the stack's address (a setting shared by every host)
    name the stack's servers; another host's is refused, naming the stack's address."""
    backend = {"MOPFLOW_MLFLOW_BACKEND_STORE": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    on_host = {"MOPFLOW_TRACKING_URI": "http://10.0.0.5:5000", "MOPFLOW_DASK_ADDRESS": "tcp://10.0.0.5:8786"}
    config = stack_config(host="10.0.0.5")
    specs = {s.name: s for s in build_specs(settings_at(tmp_path, **on_host), config, BIN, backend)}
    assert specs["airflow"].env["MOPFLOW_TRACKING_URI"] == f"http://10.0.0.5:{config.ports.mlflow}"
    loopback = {
        "MOPFLOW_TRACKING_URI": "http://127.0.0.1:5000",
        "MOPFLOW_DASK_ADDRESS": "tcp://localhost:8786",
    }
    build_specs(settings_at(tmp_path, **loopback), config, BIN, backend)
    with pytest.raises(StackError, match=r"MOPFLOW_TRACKING_URI='http://10.0.0.5:5000'.*on 127.0.0.1"):
        build_specs(settings_at(tmp_path, **on_host), stack_config(), BIN, backend)
    elsewhere = {"MOPFLOW_DASK_ADDRESS": "tcp://10.0.0.6:8786"}
    with pytest.raises(
        StackError, match=r"'tcp://10.0.0.6:8786'.*its own on 10.0.0.5: unset it or point it at 10.0.0.5"
    ):
        build_specs(settings_at(tmp_path, **elsewhere), config, BIN, {})


def test_shared_airflow_secrets_go_to_every_airflow_component_only(tmp_path: Path) -> None:
    secrets = {
        "AIRFLOW__CORE__FERNET_KEY": "f",
        "AIRFLOW__API__SECRET_KEY": "s",
        "AIRFLOW__API_AUTH__JWT_SECRET": "j",
    }
    specs = build_specs(
        settings_at(tmp_path), stack_config(host="10.0.0.5"), BIN, CELERY, airflow_secrets=secrets
    )
    for spec in specs:
        given = {k: spec.env.get(k) for k in secrets}
        assert given == (secrets if spec.name.startswith("airflow") else dict.fromkeys(secrets)), spec.name
