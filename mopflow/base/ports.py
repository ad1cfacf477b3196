"""A TCP port for a service that starts a moment later, chosen where no other process's port 0
lands.

Binding port 0 and closing the socket leaves a window between the close and the service's own
bind; in it, any process on the host that binds port 0 (a Dask scheduler or worker, a client's
outgoing connection) may be given the same port from the kernel's ephemeral range. Ports here
are drawn below that range (``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel hands
out none; each is checked free by binding it, and one process never hands out the same port
twice. ``MOPFLOW_PORT_RANGE`` (``LOW-HIGH``) narrows the draw, so that several groups of processes
on one host (the test suite's workers) never draw the same port.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from pathlib import Path

LINUX_EPHEMERAL = (32768, 60999)  # the kernel's default range
LOWEST = 10000  # below: well-known and registered services (PostgreSQL, Redis, RabbitMQ, ...)
ATTEMPTS = 200
RANGE_ENV = "MOPFLOW_PORT_RANGE"

_handed_out: set[tuple[str, int]] = set()
_lock = threading.Lock()
_draw = random.SystemRandom()  # not the global generator: a test may seed that one


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel gives to port-0 binds and outgoing connections (Linux's default
    where the setting cannot be read)."""
    try:
        low, high = Path(path).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return LINUX_EPHEMERAL


def draw_range(environ: os._Environ[str] | dict[str, str] | None = None) -> tuple[int, int]:
    """The ports :func:`free_port` draws from, both ends included: ``MOPFLOW_PORT_RANGE`` when set,
    else from :data:`LOWEST` up to the ephemeral range. A malformed setting is an error naming it."""
    value = (os.environ if environ is None else environ).get(RANGE_ENV, "").strip()
    if not value:
        return LOWEST, ephemeral_range()[0] - 1
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(f"{RANGE_ENV}={value!r}: expected LOW-HIGH, two port numbers") from None
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"{RANGE_ENV}={value!r}: expected 1024 <= LOW < HIGH <= 65535")
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, drawn from :func:`draw_range` (below the ephemeral range),
    never one this process handed out before: random draws first, then every port of the range in
    order. Never the kernel's choice (port 0), which any other process's port-0 bind may share; a
    range with no free port left is an error naming it."""
    low, high = draw_range()
    with _lock:
        drawn = (_draw.randint(low, high) for _ in range(ATTEMPTS))
        for port in itertools.chain(drawn, range(low, high + 1)):
            if (host, port) not in _handed_out and _bindable(host, port):
                _handed_out.add((host, port))
                return port
    raise OSError(f"no free TCP port on {host} in {low}-{high} (widen or unset {RANGE_ENV})")


# What a server's error says when its port was taken: Python's and uvicorn's OSError, gunicorn's
# "Connection in use", torch's TCPStore (EADDRINUSE).
ADDRESS_IN_USE = ("address already in use", "eaddrinuse", "errno 98", "connection in use")


def port_was_taken(error: BaseException | str | None) -> bool:
    """Whether ``error`` (an exception, or a log's text) says a server found its port taken."""
    text = str(error).lower()
    return any(needle in text for needle in ADDRESS_IN_USE)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
