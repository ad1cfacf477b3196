"""Health probes: whatever answers on a port that is not the service is "not healthy"."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from mopflow.infra.stack.probes import probe
from mopflow.infra.stack.services import HealthCheck


@pytest.fixture()
def garbage_server() -> Iterator[int]:
    """A TCP server that answers every connection with bytes that are not HTTP (as Dask's wire
    protocol does), then closes it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # the test's own listener: bound once, never released early
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x01\x02 not http at all\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join()
    server.close()


@pytest.fixture()
def other_http_server() -> Iterator[int]:
    """Some other program's HTTP server: 200 with a body of its own on every path."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = b'{"status": "fine", "hello": 1}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("kind", ["http", "airflow", "dask_workers", "serve"])
def test_a_protocol_error_is_not_healthy(garbage_server: int, kind: str) -> None:
    """Fault: a port held by a process that speaks another protocol. Expected: unhealthy, with
    the error named, never an exception out of the probe."""
    ok, detail = probe(HealthCheck(kind=kind, url=f"http://127.0.0.1:{garbage_server}/health"), timeout=2)
    assert not ok and f"127.0.0.1:{garbage_server}" in detail


@pytest.mark.parametrize(
    ("kind", "expect"), [("http", "OK"), ("airflow", ""), ("dask_workers", ""), ("serve", "")]
)
def test_another_programs_200_is_not_the_service(other_http_server: int, kind: str, expect: str) -> None:
    """Fault: another test's HTTP server holds the port and answers 200. Expected: unhealthy."""
    check = HealthCheck(kind=kind, url=f"http://127.0.0.1:{other_http_server}/health", expect=expect)
    ok, detail = probe(check, timeout=2)
    assert not ok, detail
