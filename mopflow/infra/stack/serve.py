"""`mopflow serve`: the champion over HTTP, following the ``champion`` alias as it moves.

MLflow's scoring protocol (``/ping``, ``/version``, ``/invocations`` with ``dataframe_split``,
``dataframe_records``, ``instances`` or ``inputs``; MLflow's own request parsing) on
``models:/<name>@champion``. A watcher polls the registry; when the alias points at another
version, that version is loaded beside the serving one and then swapped in by one assignment.
A request uses the model it started with, so every answer comes from one whole model, and no
request fails during the switch. Each answer names its version (``X-Model-Version``).

Nothing around the registry stops the serving: a version that does not load, a deleted alias and
a registry that cannot be read are logged and the served model kept. A request the model cannot
score is answered with MLflow's 4xx status and error JSON.

With ``wait`` the server starts before any champion exists (as ``mopflow up`` starts it):
``/health`` answers at once with what it serves, ``/ping`` and ``/invocations`` answer 503 until
the alias points at a version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

# at module level: FastAPI resolves the handlers' (postponed) annotations in this module's globals
from fastapi import FastAPI, Request
from fastapi.responses import Response

log = logging.getLogger("mopflow.serve")

CHAMPION = "champion"
VERSION_HEADER = "X-Model-Version"
# What the registry answers for a missing model or alias: "no champion yet", not a failure.
_ABSENT_CODES = frozenset({"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"})


class NoChampion(LookupError):
    """The registered model has no version under the alias (yet)."""


@dataclass(frozen=True)
class Served:
    """The model being served: its registry version, the loaded pyfunc and its input schema."""

    version: str
    model: Any
    input_schema: Any


class ChampionFollower:
    """Holds the served model and replaces it when the alias moves (:meth:`refresh`)."""

    def __init__(self, client: Any, name: str, alias: str = CHAMPION) -> None:
        self.client, self.name, self.alias = client, name, alias
        self.current: Served | None = None
        self._alias_gone = False  # the alias was seen missing while a model is served (logged once)
        self._stop = threading.Event()

    def champion_version(self) -> str | None:
        """The version the alias points at; None when the model or the alias does not exist."""
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.name, self.alias).version)
        except MlflowException as exc:
            if exc.error_code in _ABSENT_CODES:
                return None
            raise

    def refresh(self) -> bool:
        """Load the alias's version if it is not the one served; whether the model changed.
        A version that fails to load is logged and the served one kept (it is tried again at the
        next refresh); with no alias (yet or any more) the served model, if any, is kept, and an
        alias gone from under a served model is logged once."""
        import mlflow

        version = self.champion_version()
        if version is None:
            if self.current is not None and not self._alias_gone:
                log.warning(
                    "serve: %s@%s no longer exists; still serving version %s",
                    self.name,
                    self.alias,
                    self.current.version,
                )
            self._alias_gone = True
            return False
        self._alias_gone = False
        if self.current is not None and self.current.version == version:
            return False
        try:
            model = mlflow.pyfunc.load_model(f"models:/{self.name}/{version}")
            loaded = Served(version, model, model.metadata.get_input_schema())
        except Exception:
            if self.current is None:
                raise
            log.exception(
                "serve: %s version %s did not load; still serving %s",
                self.name,
                version,
                self.current.version,
            )
            return False
        previous = self.current.version if self.current else None
        self.current = loaded  # one assignment: the swap
        log.info("serve: %s@%s is version %s (was %s)", self.name, self.alias, version, previous)
        return True

    def watch(self, poll_s: float) -> threading.Thread:
        """Refresh every ``poll_s`` seconds in a daemon thread until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.wait(poll_s):
                try:
                    self.refresh()
                except Exception:
                    log.exception(
                        "serve: could not read %s@%s; keeping version %s",
                        self.name,
                        self.alias,
                        self.served_version,
                    )

        thread = threading.Thread(target=loop, name="champion-watcher", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    @property
    def served_version(self) -> str | None:
        return self.current.version if self.current else None


def make_app(follower: ChampionFollower) -> Any:
    """The FastAPI app of MLflow's scoring protocol over the follower's current model."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc.scoring_server import invocations

    app = FastAPI(title="mopflow serve")

    @app.get("/ping")
    async def ping() -> Response:
        served = follower.current
        return Response("\n", status_code=200 if served else 503, headers=_headers(served))

    @app.get("/health")
    async def health() -> Response:  # the server is up, whether or not a champion exists yet
        served = follower.current
        return Response(
            json.dumps({"model": follower.name, "alias": follower.alias, "version": follower.served_version}),
            media_type="application/json",
            headers=_headers(served),
        )

    @app.get("/version")
    async def version() -> Response:
        served = follower.current
        return Response(
            json.dumps({"model": follower.name, "version": served.version if served else ""}),
            media_type="application/json",
            headers=_headers(served),
        )

    @app.post("/invocations")
    async def invoke(request: Request) -> Response:
        served = follower.current  # this request's model, whatever the watcher does meanwhile
        if served is None:
            return Response("no model loaded yet", status_code=503)
        body = await request.body()
        content_type = request.headers.get("content-type", "application/json")
        try:
            result = await asyncio.to_thread(
                invocations, body, content_type, served.model, served.input_schema
            )
        except MlflowException as exc:  # a request the model cannot score: MLflow's status (4xx), not 500
            return Response(
                exc.serialize_as_json(),
                status_code=exc.get_http_status_code(),
                media_type="application/json",
                headers=_headers(served),
            )
        return Response(
            result.response, status_code=result.status, media_type=result.mimetype, headers=_headers(served)
        )

    return app


def _headers(served: Served | None) -> dict[str, str]:
    return {VERSION_HEADER: served.version} if served else {}


def serve(tracking_uri: str, name: str, host: str, port: int, poll_s: float, wait: bool = False) -> None:
    """Serve ``models:/<name>@champion`` on ``host:port`` until interrupted. Without a champion,
    raise :class:`NoChampion`, or with ``wait`` start anyway and serve it once it exists."""
    import mlflow
    import uvicorn
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(tracking_uri)
    follower = ChampionFollower(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri), name)
    try:
        follower.refresh()
    except Exception:
        if not wait:
            raise
        log.exception("serve: could not read %s@%s yet; retrying every %g s", name, CHAMPION, poll_s)
    if follower.current is None and not wait:
        raise NoChampion(f"{name} has no version with the alias {CHAMPION!r}")
    if follower.current is None:
        log.info("serve: no %s@%s yet; /ping answers 503 until there is one", name, CHAMPION)
    follower.watch(poll_s)
    log.info(
        "serve: %s@%s version %s on http://%s:%d (the alias is checked every %g s)",
        name,
        CHAMPION,
        follower.served_version,
        host,
        port,
        poll_s,
    )
    try:
        uvicorn.run(make_app(follower), host=host, port=port, log_level="warning")
    finally:
        follower.stop()
