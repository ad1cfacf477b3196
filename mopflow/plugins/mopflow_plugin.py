"""Airflow 3 plugin: a "Sweeps" page in the Airflow UI and menu links to the MLflow UI and optuna-dashboard.

A FastAPI app is mounted at ``/mopflow`` on Airflow's api-server; the nav item "Sweeps" shows
its page in an iframe. The routes need an authenticated Airflow user (the UI's session cookie or
a bearer token): Airflow does not protect plugin endpoints by itself. Page logic lives in
``sweeps_page`` (the data) and ``sweeps_html`` (its templates); the routes here only read settings
and call them.

A root middleware (``trigger_guard``) refuses, at trigger time, a run conf of a DAG tagged
``mopflow`` that has unknown keys, is larger than ``[mopflow] max_conf_bytes`` or (pipeline DAGs)
is no valid pipeline config; :func:`resolve_trigger` tells it which DAG a request is for, whether
the caller may trigger it and what it accepts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from http.cookies import SimpleCookie
from typing import Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response

from mopflow.plugins import sweep_figures, sweeps_html, sweeps_page, trigger_guard

log = logging.getLogger(__name__)

URL_PREFIX = "/mopflow"


def _require_user() -> Any:
    """An authenticated Airflow user, or 401 (Airflow's own dependency, resolved lazily)."""
    from airflow.api_fastapi.core_api.security import requires_authenticated

    return requires_authenticated()


require_user = _require_user()


def _client_and_settings() -> tuple[Any, Any]:
    from mopflow.base.settings import Settings
    from mopflow.base.tracking import bound_mlflow_retries

    bound_mlflow_retries()  # a down tracking server must not hang the page for minutes
    from mlflow import MlflowClient

    settings = Settings.from_env()
    return MlflowClient(tracking_uri=settings.tracking_uri), settings


def create_app() -> FastAPI:
    """The plugin's FastAPI app (Sweeps page, search figures and Gantt images)."""
    app = FastAPI(title="mopflow", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/sweeps", response_class=HTMLResponse, dependencies=[Depends(require_user)])
    def sweeps(
        request: Request,
        limit: int = Query(10, ge=1, le=100),
        dag_id: str | None = Query(None, pattern=r"^(mopflow_sweep|mopflow_retrain)$"),
    ) -> HTMLResponse:
        errors: list[str] = []
        links = sweeps_page.Links()
        try:
            links = sweeps_page.ui_links()
        except ValueError as exc:
            errors.append(str(exc))
        client, settings = _client_and_settings()
        study_ids: dict[str, int] = {}
        try:
            study_ids = sweeps_page.optuna_study_ids(settings.optuna_storage)
        except Exception as exc:  # the page still works without study links
            log.warning("sweeps page: cannot read the Optuna storage: %s", exc)
            errors.append(
                f"Optuna storage not readable ({type(exc).__name__}); study links go to the dashboard"
            )
        try:
            found = sweeps_page.load_sweeps(client, settings.experiment_name, limit, dag_id, study_ids)
        except Exception as exc:
            log.exception("sweeps page: cannot read MLflow at %s", settings.tracking_uri)
            found = []
            errors.append(f"MLflow at {settings.tracking_uri} not readable: {type(exc).__name__}: {exc}")
        found = _with_figures(found, settings.optuna_storage) if study_ids else found
        data = sweeps_page.PageData(found, links, settings.experiment_name, errors)
        return HTMLResponse(sweeps_html.render_page(data, base=request.scope.get("root_path", "")))

    @app.get("/sweeps/figures/{study}/{name}", dependencies=[Depends(require_user)])
    def figure(study: str, name: str) -> Response:
        """A figure of a study (``<kind>.png``), drawn from the Optuna storage as it is now."""
        from mopflow.base.settings import Settings
        from mopflow.training.search.figures import FigureUnavailable

        try:
            if not name.endswith(".png"):
                raise ValueError(f"figure {name!r} is not a <kind>.png name")
            optuna_storage = sweep_figures.storage(Settings.from_env().optuna_storage)
            png = sweep_figures.figure_png(optuna_storage, study, name.removesuffix(".png"))
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=f"no study {study} in the Optuna storage") from exc
        except FigureUnavailable as exc:
            raise HTTPException(status_code=404, detail=f"{name} of {study}: {exc.reason}") from exc
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-cache"})

    @app.get("/sweeps/gantt/{run_id}/{name}", dependencies=[Depends(require_user)])
    def gantt(run_id: str, name: str) -> Response:
        client, _ = _client_and_settings()
        try:
            png = sweeps_page.download_gantt(client, run_id, name)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        except Exception as exc:
            raise HTTPException(status_code=404, detail=f"no chart {name} in run {run_id}") from exc
        return Response(png, media_type="image/png")

    @app.get("/sweeps/student-front/{run_id}", dependencies=[Depends(require_user)])
    def student_front(run_id: str) -> Response:
        """The Pareto front of a run's student search (accuracy against serving latency)."""
        client, _ = _client_and_settings()
        try:
            png = sweeps_page.download_student_front(client, run_id)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        except Exception as exc:
            raise HTTPException(status_code=404, detail=f"no student search front in run {run_id}") from exc
        return Response(png, media_type="image/png")

    return app


def _with_figures(sweeps: list[sweeps_page.Sweep], storage_url: str) -> list[sweeps_page.Sweep]:
    """The sweeps with which of their study's figures can be drawn (none where it cannot be read)."""
    try:
        studies = [s.study for s in sweeps if s.study]
        found = sweep_figures.statuses(sweep_figures.storage(storage_url), studies)
    except Exception as exc:  # the page still shows the leaderboards
        log.warning("sweeps page: cannot read the studies' trials: %s", exc)
        return sweeps
    return [dataclasses.replace(s, figures=found.get(s.study or "", {})) for s in sweeps]


def _external_views() -> list[dict[str, Any]]:
    try:
        links = sweeps_page.ui_links()
    except ValueError as exc:
        log.warning("mopflow plugin: %s; using the default UI addresses", exc)
        links = sweeps_page.Links()
    return [
        # url_route makes it a page inside the Airflow UI (an iframe on href, relative to the UI base).
        {
            "name": "Sweeps",
            "href": f"{URL_PREFIX.lstrip('/')}/sweeps",
            "url_route": "mopflow-sweeps",
            "destination": "nav",
            "nav_top_level": True,
        },
        {"name": "MLflow UI", "href": links.mlflow_ui, "destination": "nav", "category": "browse"},
        {
            "name": "Optuna dashboard",
            "href": links.optuna_study(None),
            "destination": "nav",
            "category": "browse",
        },
    ]


# --- trigger-time conf checks (the Airflow side of trigger_guard) -------------------------------

GUARD_TAG = "mopflow"  # the DAGs whose run confs are checked


def _token(headers: dict[str, str] | Any) -> str | None:
    """The caller's credential as Airflow's ``get_user`` reads it: a bearer token, else the UI cookie."""
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN

    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return str(credentials.strip())
    cookie: SimpleCookie = SimpleCookie()
    try:
        cookie.load(headers.get("cookie", ""))
    except Exception:
        return None
    morsel = cookie.get(COOKIE_NAME_JWT_TOKEN)
    return morsel.value if morsel else None


def _guarded_dag(call: trigger_guard.Call, user: Any) -> trigger_guard.GuardedDag | None:
    """The DAG the request triggers when it is tagged mopflow and the user may trigger it."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.models.asset import TaskOutletAssetReference
    from airflow.models.dag import DagModel
    from airflow.models.dagbag import DBDagBag
    from airflow.serialization.definitions.notset import is_arg_set
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from mopflow.pipeline.config import CONF_FIELDS

    with create_session() as session:
        dag_id = call.dag_id or call.endpoint.dag_id
        if dag_id is None and call.endpoint.asset_id is not None:
            producers = session.scalars(
                select(TaskOutletAssetReference.dag_id)
                .where(TaskOutletAssetReference.asset_id == call.endpoint.asset_id)
                .group_by(TaskOutletAssetReference.dag_id)
                .limit(2)
            ).all()
            dag_id = producers[0] if len(producers) == 1 else None
        if dag_id is None:
            return None
        dag = DBDagBag().get_latest_version_of_dag(dag_id, session=session)
        if dag is None or GUARD_TAG not in dag.tags:
            return None
        details = DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id, session=session))
    if not get_auth_manager().is_authorized_dag(
        method="POST", access_entity=DagAccessEntity.RUN, details=details, user=user
    ):
        return None  # Airflow answers 403
    params = dict(dag.params.items())
    defaults = {key: p.value for key, p in params.items() if is_arg_set(p.value)}
    # The pipeline DAGs' Params are the pipeline config's keys (conf_json_schema): validate it whole.
    pipeline = set(params) == set(CONF_FIELDS)
    return trigger_guard.GuardedDag(
        dag_id, frozenset(params), defaults, validate_pipeline_trigger if pipeline else None
    )


def validate_pipeline_trigger(conf: Mapping[str, Any]) -> object:
    """A pipeline DAG's merged conf, valid and reading only from the data roots (ValueError if not)."""
    from mopflow.base.settings import Settings
    from mopflow.pipeline.conf_input import validate_trigger_conf

    return validate_trigger_conf(conf, Settings.from_env().allowed_data_roots)


async def authenticate_caller(headers: dict[str, str] | Any) -> Any:
    """The Airflow user behind a request's token or UI cookie, or Airflow's own refusal (401/403)."""
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    try:
        return await resolve_user_from_token(_token(headers))
    except HTTPException as exc:
        return trigger_guard.Refusal(exc.status_code, str(exc.detail))


async def resolve_trigger(call: trigger_guard.Call, user: Any) -> trigger_guard.GuardedDag | None:
    """What the guard checks a request against, or None: let Airflow answer (403/404/other DAGs)."""
    from fastapi.concurrency import run_in_threadpool

    return await run_in_threadpool(_guarded_dag, call, user)


def guard_kwargs() -> dict[str, Any]:
    """The trigger guard's injected Airflow side and its limits."""
    from mopflow.pipeline.config import MAX_CONF_BYTES

    return {
        "authenticate": authenticate_caller,
        "resolve": resolve_trigger,
        "limit": conf_limit(),
        "default_limit": MAX_CONF_BYTES,
    }


def conf_limit() -> int | ValueError:
    """``[mopflow] max_conf_bytes`` (default and most: the pipeline's own limit), or why it is bad."""
    from airflow.configuration import conf

    from mopflow.pipeline.config import MAX_CONF_BYTES

    try:
        return trigger_guard.parse_limit(conf.get("mopflow", "max_conf_bytes", fallback=None), MAX_CONF_BYTES)
    except ValueError as exc:
        log.error("mopflow plugin: %s; every mopflow trigger is refused until it is fixed", exc)
        return exc


class MopflowPlugin(AirflowPlugin):
    """Registers the Sweeps app, the menu links and the trigger-time conf checks."""

    name = "mopflow"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "mopflow sweeps"}]
    fastapi_root_middlewares = [
        {
            "middleware": trigger_guard.TriggerGuard,
            "kwargs": guard_kwargs(),
            "name": "mopflow trigger guard",
        }
    ]
    external_views = _external_views()
