"""``up``, ``down`` and ``status`` without starting the real services: refusals before anything
starts, a running stack left alone, and no stack at all."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mopflow.infra.stack.config import StackError, config_from_env
from mopflow.infra.stack.lifecycle import down, status, up
from mopflow.infra.stack.processes import stop_services
from mopflow.infra.stack.state import read_state, stack_dir, state_path, write_state
from tests.infra.stack.helpers import BIN, counter, live_record, sample_state, settings_at, stack_config


def test_auth_without_the_mlflow_auth_extra_is_refused_before_starting(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = config_from_env({}, {}, True, 2, counter(), mlflow_auth=True)
    with pytest.raises(
        StackError, match=r"needs the auth extra \(Flask-WTF\).*pip install 'mopflow\[auth\]'"
    ):
        up(
            settings_at(home),
            config,
            {},
            lambda _: None,
            bin_dir=BIN,
            has_module=lambda name, _: name != "flask_wtf",
        )
    assert not state_path(home).exists() and not (stack_dir(home) / "logs").exists()


def test_up_without_the_stack_extra_is_refused_naming_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(StackError, match=r"mopflow up \(optuna-dashboard.*pip install 'mopflow\[stack\]'"):
        up(
            settings_at(home),
            config_from_env({}, {}, True, 2, counter()),
            {},
            lambda _: None,
            bin_dir=BIN,
            has_module=lambda name, _: name != "optuna_dashboard",
        )
    assert not state_path(home).exists() and not (stack_dir(home) / "logs").exists()


def test_status_without_a_stack_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    assert status(tmp_path, said.append) is False
    assert "no mopflow stack" in said[0]
    said.clear()
    assert down(tmp_path, 1.0, said.append) == []
    assert "nothing to stop" in said[0]


def test_up_on_a_running_stack_starts_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    records = tuple(live_record(name, tmp_path, dict(os.environ)) for name in ("mlflow", "airflow"))
    try:
        state = sample_state(home).model_copy(update={"services": records})
        write_state(state_path(home), state)
        said: list[str] = []
        assert up(settings_at(home), stack_config(), {}, said.append, bin_dir=BIN) == state
        assert "already runs" in said[0]
        # One service gone: `up` refuses rather than start a second copy of the others.
        stop_services(records[1:], grace_s=2.0)
        with pytest.raises(StackError, match=r"partly running \(mlflow up; airflow gone\)"):
            up(settings_at(home), stack_config(), {}, said.append, bin_dir=BIN)
        assert read_state(state_path(home)) == state
    finally:
        stop_services(records, grace_s=2.0)


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StackError, match=f"port\\(s\\) already in use: mlflow port {port}"):
            up(settings_at(home), stack_config(mlflow=port), {}, lambda _: None, bin_dir=BIN)
    assert not state_path(home).exists()
    assert not (stack_dir(home) / "logs").exists()


@pytest.mark.parametrize(
    ("free", "fails", "starts", "succeeds"), [(True, 2, 3, True), (True, 5, 3, False), (False, 1, 1, False)]
)
def test_a_port_taken_before_its_service_bound_it_is_chosen_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: bool, fails: int, starts: int, succeeds: bool
) -> None:
    """Fault: a service of the stack dies at start-up with "Address already in use" (another
    process bound its chosen port first). Expected: with free ports, new ports and a new start,
    3 starts at most; with the user's own ports, the error at once."""
    from mopflow.infra.stack import lifecycle

    configs = [config_from_env({}, {}, free, 2, counter(30000 + 100 * i)) for i in range(5)]
    chosen: list[object] = []
    started: list[object] = []

    def choose() -> object:
        chosen.append(configs[len(chosen)])
        return chosen[-1]

    def fake_up(settings: object, config: object, environ: object, say: object) -> str:
        started.append(config)
        if len(started) <= fails:
            raise StackError("mlflow exited during start-up; last lines: [Errno 98] Address already in use")
        return "up"

    monkeypatch.setattr(lifecycle, "up", fake_up)
    said: list[str] = []
    run = lambda: lifecycle.up_choosing_ports(settings_at(tmp_path), choose, {}, said.append)  # noqa: E731
    if succeeds:
        assert run() == "up"
    else:
        with pytest.raises(StackError, match="Address already in use"):
            run()
    assert started == chosen[:starts] and len(started) == starts
    assert len({c.ports.mlflow for c in started}) == starts  # type: ignore[attr-defined]
    assert len(said) == starts - 1 and all("choosing new ports" in line for line in said)


def test_another_start_up_error_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mopflow.infra.stack import lifecycle

    calls: list[int] = []

    def fake_up(*args: object) -> None:
        calls.append(1)
        raise StackError("airflow exited during start-up; last lines: no such table")

    monkeypatch.setattr(lifecycle, "up", fake_up)
    with pytest.raises(StackError, match="no such table"):
        lifecycle.up_choosing_ports(settings_at(tmp_path), stack_config, {}, lambda _: None)
    assert calls == [1]
