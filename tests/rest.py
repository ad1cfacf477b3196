"""A small JSON-over-HTTP client for the tests that talk to Airflow's REST API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def request_json(
    method: str, url: str, body: Any = None, token: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """(status, decoded JSON body or text) of one request; HTTP errors are returned, not raised.

    An idempotent request (GET, PATCH) that times out or loses its connection is sent again, up to
    three times in all: an api-server on a machine busy with other tests' servers answers late
    now and then, and a poll must not fail on one late answer."""
    attempts = 3 if method in ("GET", "PATCH") else 1
    for attempt in range(1, attempts + 1):
        try:
            return _request_once(method, url, body, token, headers)
        except (TimeoutError, ConnectionError, urllib.error.URLError):
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _request_once(
    method: str, url: str, body: Any, token: str | None, headers: dict[str, str] | None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")
