"""Spawning, probing and stopping services, on tiny real processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mopflow.infra.stack.config import StackError
from mopflow.infra.stack.probes import free_port, port_answers, probe_all
from mopflow.infra.stack.processes import is_running, spawn, stop_services, wait_healthy
from tests.infra.stack.helpers import python_service

# A web server whose child ignores SIGTERM: `stop_services` must still leave nothing behind.
STUBBORN_SERVER = """
import http.server, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_spawn_probe_and_stop_a_process_group(tmp_path: Path) -> None:
    import psutil

    port = free_port()
    rec = spawn(python_service("web", STUBBORN_SERVER, port, dict(os.environ)), tmp_path / "logs")
    try:
        wait_healthy([rec], 60, lambda _: None)
        assert is_running(rec)
        assert probe_all(rec.checks) == (True, "")
        children = psutil.Process(rec.pid).children(recursive=True)
        assert children, "the server's child has started"
        # A record whose start time differs is another process that got the same pid: not ours.
        assert not is_running(rec.model_copy(update={"create_time": rec.create_time - 100}))
    finally:
        stopped = stop_services([rec], grace_s=2.0)
    assert stopped == ["web"]
    assert not is_running(rec)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert not port_answers(port)
    ok, detail = probe_all(rec.checks)
    assert not ok and str(port) in detail


def test_a_service_that_dies_at_start_fails_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('cannot open the backend store', flush=True); sys.exit(3)"
    rec = spawn(python_service("broken", code, free_port(), dict(os.environ)), tmp_path / "logs")
    with pytest.raises(StackError, match="broken exited during start-up(.|\n)*cannot open the backend store"):
        wait_healthy([rec], 60, lambda _: None)


def test_health_timeout_names_the_waiting_service(tmp_path: Path) -> None:
    code = "import time; time.sleep(60)"
    rec = spawn(python_service("sleepy", code, free_port(), dict(os.environ)), tmp_path / "logs")
    ticks = iter(range(0, 1000, 5))
    try:
        with pytest.raises(StackError, match="not healthy after 10 s: sleepy"):
            wait_healthy([rec], 10, lambda _: None, clock=lambda: float(next(ticks)), sleep=lambda _: None)
    finally:
        stop_services([rec], grace_s=2.0)
