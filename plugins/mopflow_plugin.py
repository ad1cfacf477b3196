"""Airflow 3 plugin: a "Sweeps" page in the Airflow UI and menu links to the MLflow UI and optuna-dashboard.

A FastAPI app is mounted at ``/mopflow`` on Airflow's api-server; the nav item "Sweeps" shows
its page in an iframe. The routes need an authenticated Airflow user (the UI's session cookie or
a bearer token): Airflow does not protect plugin endpoints by itself. Page logic lives in
``sweeps_page`` (data -> HTML); the routes here only read settings and call it.
"""

from __future__ import annotations

import logging
from typing import Any

import sweeps_page
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response

log = logging.getLogger(__name__)

URL_PREFIX = "/mopflow"


def _require_user() -> Any:
    """An authenticated Airflow user, or 401 (Airflow's own dependency, resolved lazily)."""
    from airflow.api_fastapi.core_api.security import requires_authenticated

    return requires_authenticated()


require_user = _require_user()


def _client_and_settings() -> tuple[Any, Any]:
    from infra.settings import Settings
    from infra.tracking import bound_mlflow_retries

    bound_mlflow_retries()  # a down tracking server must not hang the page for minutes
    from mlflow import MlflowClient

    settings = Settings.from_env()
    return MlflowClient(tracking_uri=settings.tracking_uri), settings


def create_app() -> FastAPI:
    """The plugin's FastAPI app (Sweeps page and Gantt images)."""
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
        data = sweeps_page.PageData(found, links, settings.experiment_name, errors)
        return HTMLResponse(sweeps_page.render_page(data, base=request.scope.get("root_path", "")))

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

    return app


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


class MopflowPlugin(AirflowPlugin):
    """Registers the Sweeps app and the menu links."""

    name = "mopflow"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "mopflow sweeps"}]
    external_views = _external_views()
