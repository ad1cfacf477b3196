"""Waits on a server process a test started: until its URL answers, failing early (with what the
server said) when it exits instead."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def wait_until_answering(
    url: str,
    server: subprocess.Popen[Any],
    what: str,
    output: Callable[[], str] = lambda: "",
    timeout_s: float = 120,
    poll_s: float = 1.0,
) -> None:
    """Wait until a GET of ``url`` answers 200. Fails when ``server`` exits first (with the last
    of its ``output``) or when ``timeout_s`` pass; ``what`` names the server in the message."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet, or an HTTP error while it starts
            pass
        assert server.poll() is None, f"{what} exited: {output()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not answer {url} within {timeout_s:g} s"
        time.sleep(poll_s)
