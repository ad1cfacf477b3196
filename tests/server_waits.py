"""Waits on a server process a test started: until its URL answers or until it says something,
failing early (with what the server said) when it exits instead."""

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


def wait_for_output(
    server: subprocess.Popen[Any],
    output: Callable[[], str],
    text: str,
    since: int = 0,
    fail_on: tuple[str, ...] = (),
    timeout_s: float = 60,
    poll_s: float = 0.1,
) -> str:
    """Wait until ``text`` appears in ``output()`` after its first ``since`` characters; the
    output from ``since`` on. Fails early when one of ``fail_on`` appears there instead or when
    ``server`` exits, and when ``timeout_s`` pass (each time with the last of that output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = output()[since:]
        if text in said:
            return said
        wrong = [other for other in fail_on if other in said]
        assert not wrong, f"{wrong[0]!r} instead of {text!r}: {said[-3000:]}"
        assert server.poll() is None, f"the server exited before {text!r}: {said[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:g} s: {said[-3000:]}"
        time.sleep(poll_s)
