"""The edges that look at the stack from outside: TCP ports (free, taken, answering) and the
services' health checks."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Sequence

from mopflow.base import ports
from mopflow.infra.stack.config import DEFAULT_HOST
from mopflow.infra.stack.services import HealthCheck


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port free on ``host`` (the stack's address) now, outside the range the kernel gives to
    port-0 binds (``mopflow.base.ports``): no other process takes it before the service binds it."""
    return ports.free_port(host)


def port_answers(port: int, host: str = DEFAULT_HOST, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_bindable(port: int, host: str = DEFAULT_HOST) -> bool:
    """Whether this process could listen on host:port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _http_get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the stack's own URLs
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def probe(check: HealthCheck, timeout: float = 3.0) -> tuple[bool, str]:
    """Run one health check: (healthy, what was seen). Any error on the way (a refused
    connection, a broken HTTP answer, a body that is not the service's) is "not healthy"."""
    try:
        if check.kind == "tcp":
            host, _, port = check.url.removeprefix("tcp://").rpartition(":")
            ok = port_answers(int(port), host.strip("[]"), timeout)  # an IPv6 address is bracketed
            return ok, "" if ok else f"nothing listens on {check.url}"
        status, body = _http_get(check.url, timeout)
        if status != 200:
            return False, f"{check.url} answered HTTP {status}"
        if check.expect and check.expect not in body.decode(errors="replace"):
            return False, f"{check.url} answered, but not as the service: no {check.expect!r} in its body"
        if check.kind == "airflow":
            info = json.loads(body)
            parts = {k: (info.get(k) or {}).get("status") for k in ("metadatabase", "scheduler")}
            bad = {k: v for k, v in parts.items() if v != "healthy"}
            return not bad, ", ".join(f"{k} {v}" for k, v in bad.items())
        if check.kind == "dask_workers":
            workers = int(json.loads(body)["workers"])  # a body without it is not Dask's
            ok = workers >= check.min_workers
            return ok, "" if ok else f"{workers}/{check.min_workers} workers connected"
        if check.kind == "serve":
            info = json.loads(body)
            if "model" not in info:
                return False, f"{check.url} answered, but not as mopflow serve"
            version = info.get("version")
            return (
                True,
                f"{info.get('model')} v{version}" if version else f"no {info.get('model')}@champion yet",
            )
        return True, ""
    except Exception as exc:  # a protocol error is as much "not up" as a refused connection
        return False, f"{check.url}: {type(exc).__name__}: {exc}"


def probe_all(checks: Sequence[HealthCheck], timeout: float = 3.0) -> tuple[bool, str]:
    """All checks of one service: healthy when every one is; the first failure's detail, else
    what the healthy checks said (``mopflow serve``'s version)."""
    said = []
    for check in checks:
        ok, detail = probe(check, timeout)
        if not ok:
            return False, detail
        said.append(detail)
    return True, "; ".join(d for d in said if d)
