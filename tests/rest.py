"""A small JSON-over-HTTP client for the tests that talk to Airflow's REST API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def request_json(
    method: str, url: str, body: Any = None, token: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """(status, decoded JSON body or text) of one request; HTTP errors are returned, not raised."""
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
