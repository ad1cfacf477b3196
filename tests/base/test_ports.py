"""Ports for services that bind a moment after they are chosen."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mopflow.base import ports


def test_ports_are_free_outside_the_kernels_range_and_never_handed_out_twice() -> None:
    """Expected: 200 ports in a row, none in the range port-0 binds draw from (where a Dask
    process could take one before its service binds it), none twice, each bindable."""
    low, high = ports.ephemeral_range()
    chosen = [ports.free_port() for _ in range(200)]
    assert len(set(chosen)) == len(chosen)
    assert all(ports.LOWEST <= p < low or p > high for p in chosen), [p for p in chosen if low <= p <= high]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", chosen[-1]))


def test_a_port_bound_elsewhere_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: every random draw lands on a port taken by a listening socket. Expected: the next
    free port of the range, in order, never the taken one and never a kernel's port-0 choice."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv(ports.RANGE_ENV, f"{port}-{port + 200}")
        monkeypatch.setattr(ports._draw, "randint", lambda start, end: port)
        chosen = ports.free_port()
        assert port < chosen <= port + 200
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", chosen))


def test_a_range_without_a_free_port_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports, "draw_range", lambda: (port, port))
        with pytest.raises(
            OSError,
            match=rf"no free TCP port on 127.0.0.1 in {port}-{port} \(widen or unset MOPFLOW_PORT_RANGE\)",
        ):
            ports.free_port()


def test_the_kernels_range_is_read_and_a_missing_setting_falls_back(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(setting)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == ports.LINUX_EPHEMERAL


def test_the_range_setting_narrows_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expected: with MOPFLOW_PORT_RANGE set (as tests/conftest.py does per xdist worker), every
    port comes from it; a malformed setting is refused naming the variable."""
    monkeypatch.setenv(ports.RANGE_ENV, "23000-23499")
    assert all(23000 <= ports.free_port() <= 23499 for _ in range(50))
    for bad in ("23000", "a-b", "500-600", "30000-20000"):
        with pytest.raises(ValueError, match=ports.RANGE_ENV):
            ports.draw_range({ports.RANGE_ENV: bad})
