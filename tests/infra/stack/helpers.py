"""Builders shared by the local stack's unit tests: settings under a temporary home, configs on
made-up ports, a recorded state, and tiny real services started with ``python -c``."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

from mopflow.base.settings import Settings
from mopflow.infra.stack import config_from_env
from mopflow.infra.stack.config import StackConfig
from mopflow.infra.stack.probes import free_port
from mopflow.infra.stack.processes import spawn
from mopflow.infra.stack.services import HealthCheck, ServiceRecord, ServiceSpec
from mopflow.infra.stack.specs import build_specs
from mopflow.infra.stack.state import StackState, dask_dashboard_url

REPO = Path(__file__).resolve().parents[3]
BIN = str(Path(sys.executable).parent)


def counter(start: int = 20000) -> Callable[[], int]:
    """A ``pick_free`` that hands out consecutive ports."""
    numbers = itertools.count(start)
    return lambda: next(numbers)


def settings_at(home: Path, **env: str) -> Settings:
    return Settings.from_env({"MOPFLOW_HOME": str(home), **env})


def stack_config(host: str | None = None, **ports: int) -> StackConfig:
    """Free (made-up) ports but for those given, two Dask workers, on ``host`` (default loopback)."""
    return config_from_env({}, dict(ports), True, 2, counter(), host=host)


def sample_state(home: Path) -> StackState:
    """A state as ``up`` records it, every service with a made-up pid."""
    config = stack_config()
    specs = build_specs(settings_at(home), config, BIN, {})
    records = tuple(
        ServiceRecord(
            name=s.name,
            pid=1000 + i,
            create_time=1.5,
            argv=s.argv,
            log=f"/logs/{s.name}.log",
            url=s.url,
            checks=s.checks,
            ports=s.ports,
        )
        for i, s in enumerate(specs)
    )
    return StackState(
        home=str(home), started_at="2026-11-22T10:00:00+00:00", ports=config.ports, services=records,
        airflow_password_file="/pw/file", logs="/logs",
        dask_dashboard=dask_dashboard_url(config.ports.dask_dashboard, has_bokeh=True),
    )  # fmt: skip


def python_service(name: str, code: str, port: int, env: dict[str, str]) -> ServiceSpec:
    """A service running ``code`` (given ``port`` as its argument), checked over HTTP and TCP."""
    url = f"http://127.0.0.1:{port}"
    return ServiceSpec(
        name=name,
        argv=(sys.executable, "-c", code, str(port)),
        env=env,
        url=url,
        checks=(HealthCheck(kind="http", url=url + "/"), HealthCheck(kind="tcp", url=f"tcp://127.0.0.1:{port}")),
        ports=(port,),
    )  # fmt: skip


def live_record(name: str, tmp_path: Path, env: dict[str, str]) -> ServiceRecord:
    """A started process that sleeps, recorded without health checks."""
    spec = python_service(name, "import time; time.sleep(120)", free_port(), env)
    return spawn(spec, tmp_path / "logs").model_copy(update={"checks": ()})
