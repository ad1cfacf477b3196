"""What ``mopflow up`` starts: every service's command line, environment and health checks,
wired to one another on the stack's address (``StackConfig.host``, 127.0.0.1 unless
``MOPFLOW_STACK_HOST`` says otherwise; pure: nothing is started here).

The backends follow the settings: MLflow's on ``MOPFLOW_MLFLOW_BACKEND_STORE`` with its artifacts
at ``MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION``, Optuna's on ``MOPFLOW_OPTUNA_STORAGE``. A tracking URI
or Dask address on loopback or on the stack's address names the server the stack itself serves;
one on another host is refused (the stack would not be the one the tasks use)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from mopflow.base.hosts import SAME_HOST_WORKER_ENV
from mopflow.base.optuna_storage import journal_path, storage_kind
from mopflow.base.settings import Settings
from mopflow.infra.stack.airflow_services import airflow_executor, airflow_specs
from mopflow.infra.stack.auth import MlflowAuth
from mopflow.infra.stack.config import DEFAULT_HOST, StackConfig, StackError, StackPorts, url_host
from mopflow.infra.stack.environment import airflow_env, base_env, mopflow_env
from mopflow.infra.stack.services import HealthCheck, ServiceSpec
from mopflow.infra.stack.state import stack_dir

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(url: str) -> bool:
    """Whether a URL (``http://...``, ``tcp://...``) names a host on this machine's loopback."""
    return (urlsplit(url).hostname or "") in LOOPBACK


def names_the_stack(url: str, host: str = DEFAULT_HOST) -> bool:
    """Whether a URL names a server the stack on ``host`` serves: one on loopback (the profile's
    127.0.0.1 defaults), or on the stack's own address (a setting written for every host)."""
    return is_loopback(url) or (urlsplit(url).hostname or "") == host.lower()


def mlflow_server_stores(
    settings: Settings, environ: Mapping[str, str], host: str = DEFAULT_HOST
) -> tuple[str, str]:
    """The stack's MLflow server: (backend store URI, artifacts destination).

    The backend store is ``MOPFLOW_MLFLOW_BACKEND_STORE``, else the tracking URI when it is a
    database. A tracking URI that is a server (``http://...``, as in the scale-out profile) is
    accepted when it names the stack's (:func:`names_the_stack`) and a backend store is given:
    the stack serves it."""
    store = environ.get("MOPFLOW_MLFLOW_BACKEND_STORE", "").strip()
    uri = settings.tracking_uri
    if uri.startswith(("http://", "https://")):
        if not store:
            raise StackError(
                f"MOPFLOW_TRACKING_URI={uri!r} already points at a tracking server; `mopflow up` starts "
                "its own: give it a database in MOPFLOW_MLFLOW_BACKEND_STORE (as the scale-out profile does) "
                "or set MOPFLOW_TRACKING_URI to a database URI (e.g. sqlite:///...)"
            )
        if not names_the_stack(uri, host):
            raise StackError(
                f"MOPFLOW_TRACKING_URI={uri!r} points at a tracking server on another host; `mopflow up` "
                f"serves MLflow on {host}: unset it or point it at {host}"
            )
    backend = store or uri
    if backend.startswith(("http://", "https://")):
        raise StackError(f"MOPFLOW_MLFLOW_BACKEND_STORE={backend!r} must be a database URI, not a server")
    destination = (
        environ.get("MOPFLOW_MLFLOW_ARTIFACTS_DESTINATION", "").strip()
        or settings.mlflow_artifact_location
        or str(Path(settings.home) / "mlflow" / "artifacts")
    )
    return backend, destination


def build_specs(
    settings: Settings,
    config: StackConfig,
    bin_dir: str,
    environ: Mapping[str, str],
    auth: MlflowAuth | None = None,
    airflow_secrets: Mapping[str, str] | None = None,
) -> list[ServiceSpec]:
    """The services' command lines, environments and health checks (nothing is started), in
    start order (``SERVICE_ORDER``, then the Celery components if any), every server bound to and
    advertised on ``config.host``.

    With ``auth`` the MLflow server runs its basic-auth app and every client (tasks, workers, the
    Airflow plugin) gets the admin's credentials through ``MLFLOW_TRACKING_USERNAME/PASSWORD``.
    ``airflow_secrets`` (:func:`~mopflow.infra.stack.auth.prepare_airflow_secrets`) go to every
    Airflow component, so that components on other hosts can share them."""
    if config.mlflow_auth and auth is None:
        raise StackError("the stack config asks for MLflow auth but no credentials were prepared")
    host = config.host
    stores = mlflow_server_stores(settings, environ, host)
    if settings.dask_address and not names_the_stack(settings.dask_address, host):
        raise StackError(
            f"MOPFLOW_DASK_ADDRESS={settings.dask_address!r} points at an existing Dask scheduler; "
            f"`mopflow up` starts its own on {host}: unset it or point it at {host}"
        )
    executor = airflow_executor(environ)
    p = config.ports
    common = _common_env(settings, p, host, bin_dir, environ, auth)
    airflow = {
        **common,
        **airflow_env(settings.airflow_home, environ, bin_dir, p, host),
        **(airflow_secrets or {}),
    }
    return [
        _mlflow_spec(bin_dir, p, host, stores, common, environ, auth),
        *_dask_specs(bin_dir, config, stack_dir(settings.home), common),
        _optuna_spec(bin_dir, p, host, settings.optuna_storage, common),
        _serve_spec(bin_dir, config, common),
        *airflow_specs(executor, airflow, p, bin_dir, host),
    ]


def _exe(bin_dir: str, name: str) -> str:
    """One of the venv's console scripts."""
    return str(Path(bin_dir) / name)


def _common_env(
    settings: Settings,
    p: StackPorts,
    host: str,
    bin_dir: str,
    environ: Mapping[str, str],
    auth: MlflowAuth | None,
) -> dict[str, str]:
    """What every service gets: the inherited environment, the ``MOPFLOW_*`` settings pointing at
    the stack, the UI links of the Airflow "Sweeps" page, and with ``auth`` MLflow's credentials."""
    # Where the Sweeps page (plugins/sweeps_page.py) links to; a user's value (a proxy) wins.
    ui_urls = {
        "MOPFLOW_MLFLOW_UI_URL": f"http://{url_host(host)}:{p.mlflow}",
        "MOPFLOW_OPTUNA_DASHBOARD_URL": f"http://{url_host(host)}:{p.optuna}",
    }
    common = {
        **base_env(environ, bin_dir),
        **mopflow_env(settings, p, host),
        **{k: v for k, v in ui_urls.items() if not environ.get(k)},
    }
    if auth is not None:
        common["MLFLOW_TRACKING_USERNAME"] = auth.username
        common["MLFLOW_TRACKING_PASSWORD"] = auth.password.get_secret_value()
    return common


def _mlflow_spec(
    bin_dir: str,
    p: StackPorts,
    host: str,
    stores: tuple[str, str],
    common: dict[str, str],
    environ: Mapping[str, str],
    auth: MlflowAuth | None,
) -> ServiceSpec:
    """The MLflow tracking server on its backend store, serving the artifacts (basic auth with ``auth``)."""
    backend_store, artifacts_destination = stores
    app: tuple[str, ...] = ()
    server_env: dict[str, str] = {}
    if auth is not None:
        app = ("--app-name", "basic-auth")
        server_env["MLFLOW_AUTH_CONFIG_PATH"] = auth.config_file
        server_env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = auth.secret_key.get_secret_value()
    url = f"http://{url_host(host)}:{p.mlflow}"
    return ServiceSpec(
        name="mlflow",
        argv=(
            _exe(bin_dir, "mlflow"),
            "server",
            "--backend-store-uri",
            backend_store,
            "--artifacts-destination",
            artifacts_destination,
            "--serve-artifacts",
            "--host",
            host,
            "--port",
            str(p.mlflow),
            "--workers",
            "1",
            *app,
        ),
        # The server's job runner (GenAI scorers) starts seven huey processes (~1.4 GB): off by default.
        env={
            **common,
            **server_env,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"),
        },
        url=url,
        checks=(HealthCheck(kind="http", url=f"{url}/health", expect="OK"),),
        ports=(p.mlflow,),
    )


def _dask_specs(bin_dir: str, config: StackConfig, folder: Path, common: dict[str, str]) -> list[ServiceSpec]:
    """The Dask scheduler (with its HTTP dashboard) and one nanny process of ``config.dask_workers``
    single-threaded workers, their scratch space under the stack folder."""
    p, host, where = config.ports, config.host, url_host(config.host)
    scheduler = f"tcp://{where}:{p.dask_scheduler}"
    dask_http = f"http://{where}:{p.dask_dashboard}"
    return [
        ServiceSpec(
            name="dask-scheduler",
            argv=(
                _exe(bin_dir, "dask"),
                "scheduler",
                "--host",
                host,
                "--port",
                str(p.dask_scheduler),
                "--dashboard-address",
                f"{where}:{p.dask_dashboard}",
            ),
            env=common,
            url=scheduler,
            checks=(
                HealthCheck(kind="tcp", url=scheduler),
                HealthCheck(kind="http", url=f"{dask_http}/health", expect="ok"),
            ),
            ports=(p.dask_scheduler, p.dask_dashboard),
        ),
        ServiceSpec(
            name="dask-workers",
            argv=(
                _exe(bin_dir, "dask"),
                "worker",
                scheduler,
                "--nworkers",
                str(config.dask_workers),
                "--nthreads",
                "1",
                "--host",
                host,
                "--no-dashboard",
                "--local-directory",
                str(folder / "dask-worker-space"),
            ),
            # On the stack's host the options a task sends are right (an Airflow connection's
            # included, which the workers never see): the workers set none of their own.
            env={**common, **SAME_HOST_WORKER_ENV},
            url=f"{dask_http}/json/counts.json",
            checks=(
                HealthCheck(
                    kind="dask_workers", url=f"{dask_http}/json/counts.json", min_workers=config.dask_workers
                ),
            ),
        ),
    ]


def _optuna_spec(bin_dir: str, p: StackPorts, host: str, storage: str, common: dict[str, str]) -> ServiceSpec:
    """optuna-dashboard on the study storage."""
    args: tuple[str, ...] = (storage,)
    if storage_kind(storage) == "journal":
        # The journal file may not exist yet: name the storage class so the dashboard creates it.
        args = (journal_path(storage), "--storage-class", "JournalFileStorage")
    url = f"http://{url_host(host)}:{p.optuna}"
    return ServiceSpec(
        name="optuna-dashboard",
        argv=(_exe(bin_dir, "optuna-dashboard"), *args, "--host", host, "--port", str(p.optuna)),
        env=common,
        url=url,
        checks=(HealthCheck(kind="http", url=f"{url}/", expect="Optuna Dashboard"),),
        ports=(p.optuna,),
    )


def _serve_spec(bin_dir: str, config: StackConfig, common: dict[str, str]) -> ServiceSpec:
    """``mopflow serve`` of the configured model's champion."""
    url = f"http://{url_host(config.host)}:{config.ports.serve}"
    return ServiceSpec(
        name="serve",
        # Starts before any model exists: it answers /health at once and /ping (200) once the
        # champion alias points at a version, which it then follows.
        argv=(
            _exe(bin_dir, "mopflow"),
            "serve",
            "--model",
            config.serve_model,
            "--host",
            config.host,
            "--port",
            str(config.ports.serve),
            "--wait",
        ),
        env=common,
        url=url,
        checks=(HealthCheck(kind="serve", url=f"{url}/health"),),
        ports=(config.ports.serve,),
    )
