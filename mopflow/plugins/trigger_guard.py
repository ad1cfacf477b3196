"""Trigger-time checks of a mopflow DAG run's conf: unknown keys, oversized JSON, invalid values.

Airflow validates each Param against its own JSON schema when a run is triggered, but it merges
conf keys that are no Param into the run without a word, and it has no size limit. This module is
an ASGI middleware for the api-server (``fastapi_root_middlewares`` of the mopflow plugin) that
looks at the requests that create runs with a conf:

- ``POST .../api/v2/dags/{dag_id}/dagRuns`` (the REST API, the UI's trigger form, airflowctl),
- ``POST .../api/v2/backfills`` and ``.../backfills/dry_run`` (``dag_run_conf``),
- ``POST .../api/v2/assets/{asset_id}/materialize``,

In this order, and before any run exists:

1. the caller: without valid credentials the request is answered as Airflow answers it (401 or
   403) before the body is read (it is drained unread, so the client gets the answer);
2. the body: at most :func:`max_body_bytes` are read (HTTP 413 beyond) and it may nest at most
   :data:`MAX_DEPTH` arrays or objects deep (HTTP 400), so no input can make the parser recurse
   without bound (a deeply nested body raised ``RecursionError``, an HTTP 500);
3. the conf of a guarded DAG: larger than the limit (HTTP 413), keys that are none of the DAG's
   Params, or, for the pipeline DAGs, no valid pipeline config (HTTP 400).

The answer is JSON ``{"detail": "..."}`` like Airflow's own errors, naming the bad key, size or
depth and what is accepted.

No Airflow here: who the caller is comes from an injected async ``authenticate``, and which DAG a
request is for, whether the caller may trigger it and what the DAG accepts from an injected async
``resolve`` (both Airflow-bound, in ``mopflow_plugin``). Requests it resolves to None (another
DAG, an unauthorised caller, an unknown DAG) go through untouched, so Airflow answers them as
usual (403, 404, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

# The Airflow config option that sets the limit (environment: AIRFLOW__MOPFLOW__MAX_CONF_BYTES).
LIMIT_OPTION = "[mopflow] max_conf_bytes"
LIMIT_ENV = "AIRFLOW__MOPFLOW__MAX_CONF_BYTES"
MIN_LIMIT = 1024
# How deep a run-creating body may nest arrays and objects: the pipeline's deepest conf (a search
# space inside the conf inside the body) is 6 levels; Python's JSON parser fails near 1,000.
MAX_DEPTH = 32
# The body around the conf (run id, dates, note, whitespace) may add this much to the conf limit.
BODY_FACTOR = 4

_DAG_RUNS = re.compile(r"/api/v2/dags/(?P<dag_id>[^/]+)/dagRuns/?$")
_BACKFILLS = re.compile(r"/api/v2/backfills(?:/dry_run)?/?$")
_MATERIALIZE = re.compile(r"/api/v2/assets/(?P<asset_id>\d+)/materialize/?$")


@dataclass(frozen=True)
class Endpoint:
    """A request that creates DAG runs: where its DAG is named and which body field is the conf."""

    conf_field: str
    dag_id: str | None = None  # from the path; None: from the body (backfills) or the asset
    asset_id: int | None = None
    dag_id_field: str | None = None


@dataclass(frozen=True)
class GuardedDag:
    """A DAG whose runs are checked: its Params (the accepted keys), their defaults and, for the
    pipeline DAGs, the pipeline config's validator."""

    dag_id: str
    accepted: frozenset[str]
    defaults: Mapping[str, Any]  # the Params that have a default
    # Raises ValueError (naming the key and value) when a merged conf is invalid; None: keys only.
    validate: Callable[[Mapping[str, Any]], object] | None = None


@dataclass(frozen=True)
class Refusal:
    status: int
    detail: str


@dataclass(frozen=True)
class Call:
    """What ``resolve`` gets: the endpoint, the DAG named in the body (if any) and the credentials."""

    endpoint: Endpoint
    dag_id: str | None
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names


# The caller's identity from the request headers (lower-case names), or the Refusal Airflow would
# answer without valid credentials (401 "Not authenticated", 401 "Token Expired", 403 ...).
Authenticate = Callable[[Mapping[str, str]], Awaitable[Any]]
Resolve = Callable[[Call, Any], Awaitable[GuardedDag | None]]


def match_endpoint(method: str, path: str) -> Endpoint | None:
    """The run-creating endpoint a request is for, or None for every other request."""
    if method.upper() != "POST":
        return None
    if found := _DAG_RUNS.search(path):
        return Endpoint(conf_field="conf", dag_id=found["dag_id"])
    if _BACKFILLS.search(path):
        return Endpoint(conf_field="dag_run_conf", dag_id_field="dag_id")
    if found := _MATERIALIZE.search(path):
        return Endpoint(conf_field="conf", asset_id=int(found["asset_id"]))
    return None


def parse_limit(raw: str | int | None, default: int) -> int:
    """The conf size limit from the setting; ``default`` (the pipeline's own limit) is also the most."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = -1
    if not MIN_LIMIT <= value <= default:
        raise ValueError(
            f"{LIMIT_OPTION} ({LIMIT_ENV}) = {raw!r} must be an integer number of bytes "
            f"from {MIN_LIMIT} to {default} (the pipeline's own limit)"
        )
    return value


def size_refusal(what: str, size: int, limit: int) -> Refusal | None:
    if size <= limit:
        return None
    return Refusal(
        413,
        f"{what} is {size} bytes; the limit is {limit} bytes ({LIMIT_OPTION}, environment {LIMIT_ENV})",
    )


def conf_refusal(dag: GuardedDag, conf: Mapping[str, Any], limit: int) -> Refusal | None:
    """Why ``conf`` cannot start a run of ``dag``, or None when it can."""
    too_big = size_refusal("the conf", len(json.dumps(conf, default=str)), limit)
    if too_big:
        return too_big
    accepted = sorted(dag.accepted)
    unknown = sorted(set(conf) - dag.accepted)
    if unknown:
        return Refusal(
            400,
            f"{dag.dag_id}: unknown conf key(s) {unknown}; the accepted keys are {accepted}",
        )
    if dag.validate is not None:
        try:
            dag.validate({**dag.defaults, **conf})
        except ValueError as exc:
            return Refusal(400, f"{dag.dag_id}: invalid conf: {exc}")
    return None


def max_body_bytes(limit: int | ValueError, default: int) -> int:
    """The most bytes of a run-creating request body the guard reads: BODY_FACTOR x the conf limit."""
    return BODY_FACTOR * (default if isinstance(limit, ValueError) else limit)


# A string (to its closing quote, or to the end when unterminated: never backtracks) or a bracket.
_TOKEN = re.compile(rb'"(?:[^"\\]+|\\.)*"?|[\[\]{}]', re.DOTALL)


def nesting_depth(raw: bytes) -> int:
    """How deep ``raw`` (JSON text, maybe invalid) nests arrays and objects, without parsing it.

    Brackets inside strings do not count. Linear in the length, no recursion: safe on any input.
    """
    depth = deepest = 0
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth = max(depth - 1, 0)
    return deepest


def body_size_refusal(size: int, max_bytes: int) -> Refusal | None:
    """413 for a request body over ``max_bytes`` (BODY_FACTOR x the conf limit), else None."""
    if size <= max_bytes:
        return None
    return Refusal(
        413,
        f"the request body is {size} bytes; the limit is {max_bytes} bytes ({BODY_FACTOR} x "
        f"{LIMIT_OPTION}, environment {LIMIT_ENV})",
    )


def body_refusal(raw: bytes, max_depth: int = MAX_DEPTH) -> Refusal | None:
    """Why a body that fits the size limit cannot be parsed safely (too deep), or None."""
    depth = nesting_depth(raw)
    if depth > max_depth:
        return Refusal(
            400,
            f"the request body nests arrays/objects {depth} levels deep; the limit is {max_depth} levels",
        )
    return None


async def _read_body(
    receive: Callable[[], Awaitable[dict[str, Any]]], max_bytes: int
) -> tuple[list[dict[str, Any]], bytes, int]:
    """The body's messages and bytes, up to ``max_bytes``; and its whole size.

    Past ``max_bytes`` the rest is read and dropped (the client then reads the answer instead of
    a reset connection) and the size says by how much it was over.
    """
    messages: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            messages.append(message)
            break  # the client went away: hand that on
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= max_bytes:
            messages.append(message)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return messages, b"".join(chunks), size


def _replay(
    messages: list[dict[str, Any]], receive: Callable[[], Awaitable[dict[str, Any]]]
) -> Callable[[], Awaitable[dict[str, Any]]]:
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _answer(send: Callable[[dict[str, Any]], Awaitable[None]], refusal: Refusal) -> None:
    body = json.dumps({"detail": refusal.detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": refusal.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TriggerGuard:
    """ASGI middleware: refuse a bad conf for a guarded DAG before Airflow creates a run.

    ``limit`` is the conf size limit in bytes, or the ValueError of a bad limit setting: then every
    guarded trigger is refused with that message (fail closed, not silently unguarded);
    ``default_limit`` is the pipeline's own limit (the body limit's base when the setting is bad).
    """

    def __init__(
        self,
        app: Any,
        authenticate: Authenticate,
        resolve: Resolve,
        limit: int | ValueError,
        default_limit: int,
        max_depth: int = MAX_DEPTH,
    ) -> None:
        self.app = app
        self.authenticate = authenticate
        self.resolve = resolve
        self.limit = limit
        self.max_body = max_body_bytes(limit, default_limit)
        self.max_depth = max_depth

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        endpoint = (
            match_endpoint(scope.get("method", ""), scope.get("path", ""))
            if scope["type"] == "http"
            else None
        )
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        caller = await self.authenticate(headers)
        if isinstance(caller, Refusal):  # the caller first: the body is only drained, unread
            await _read_body(receive, 0)  # so that the client reads the answer, not a reset
            await _answer(send, caller)
            return
        messages, raw, size = await _read_body(receive, self.max_body)
        refusal = body_size_refusal(size, self.max_body) or body_refusal(raw, self.max_depth)
        if refusal is None:
            refusal = await self.check(endpoint, headers, caller, raw)
        if refusal is not None:
            await _answer(send, refusal)
            return
        await self.app(scope, _replay(messages, receive), send)

    async def check(
        self, endpoint: Endpoint, headers: Mapping[str, str], caller: Any, raw: bytes
    ) -> Refusal | None:
        """The refusal for this request (its body within the size and depth limits), or None."""
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            body = None  # not JSON: Airflow answers 422
        body_dag = (
            body.get(endpoint.dag_id_field) if endpoint.dag_id_field and isinstance(body, dict) else None
        )
        if endpoint.dag_id_field and not isinstance(body_dag, str):
            return None  # no DAG named: Airflow answers 422
        dag = await self.resolve(Call(endpoint, body_dag, headers), caller)
        if dag is None:
            return None
        if isinstance(self.limit, ValueError):
            return Refusal(500, f"mopflow refuses to trigger {dag.dag_id}: {self.limit}")
        if not isinstance(body, dict):
            return None
        conf = body.get(endpoint.conf_field)
        if not isinstance(conf, dict):
            return None  # null / absent: the Params' defaults; another type: Airflow answers 422
        return conf_refusal(dag, conf, self.limit)
