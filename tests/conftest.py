"""Shared fixtures: an isolated MOPFLOW_HOME, a real Dask LocalCluster, a small sharded dataset."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parent.parent

# Each pytest-xdist worker (and every process it starts) draws the ports of its servers from its
# own range, below the kernel's ephemeral range: two workers never draw the same port, and no
# port-0 bind of a Dask process can take one between its choice and the server's bind
# (mopflow.base.ports).
PORT_RANGE_LOW, PORT_RANGE_HIGH = 12000, 32000
PORT_RANGE_ENV = "MOPFLOW_PORT_RANGE"  # kept in a child's environment when the rest of MOPFLOW_* is not


def worker_port_range(worker: str, workers: int) -> str:
    """The ``MOPFLOW_PORT_RANGE`` of xdist worker ``worker`` (``gw0``, ``gw1``, ...; ``master``
    without xdist) among ``workers``."""
    index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    span = (PORT_RANGE_HIGH - PORT_RANGE_LOW) // max(workers, 1)
    low = PORT_RANGE_LOW + index * span
    return f"{low}-{low + span - 1}"


os.environ[PORT_RANGE_ENV] = worker_port_range(
    os.environ.get("PYTEST_XDIST_WORKER", "master"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
)


def service_available(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip when a service is down, or fail under MOPFLOW_REQUIRE_SERVICES=1 (CI)."""
    if service_available(host, port):
        return
    skip_unless_required(f"{name} is not reachable at {host}:{port}")


def skip_unless_required(message: str) -> NoReturn:
    """Skip with ``message``, or fail under MOPFLOW_REQUIRE_SERVICES=1 (CI), where nothing a
    test needs may be missing."""
    if os.environ.get("MOPFLOW_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " and MOPFLOW_REQUIRE_SERVICES=1")
    pytest.skip(message)


def pg_admin_sql(sql: str) -> None:
    """Run one statement as postgres on the local server, on a fresh connection (a test may restart it)."""
    import psycopg2

    conn = psycopg2.connect(host=PG[0], port=PG[1], user="postgres", dbname="postgres")
    conn.autocommit = True
    try:
        conn.cursor().execute(sql)
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Nothing a test sets in the process outlives it: ``os.environ``, MLflow's tracking and
    registry URIs and its active runs are as before (test files share an xdist worker)."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    environ = dict(os.environ)
    tracking, registry = tracking_utils._tracking_uri, registry_utils._registry_uri
    yield
    while mlflow.active_run() is not None:
        try:
            mlflow.end_run()
        except Exception:  # its store may be gone with the test's folder: forget the run
            mlflow.tracking.fluent._active_run_stack.set([])
    if tracking_utils._tracking_uri != tracking:
        mlflow.set_tracking_uri(tracking)  # type: ignore[arg-type]  # None: back to the default
    registry_utils._registry_uri = registry
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture()
def mopflow_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty MOPFLOW_HOME for one test, with every derived setting cleared."""
    home = tmp_path / "home"
    for var in list(os.environ):
        if var.startswith("MOPFLOW_") and var not in {"MOPFLOW_REQUIRE_SERVICES"}:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOPFLOW_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def dask_client() -> Iterator[object]:
    """One real LocalCluster (2 worker processes) shared by the tests that need Dask."""
    from mopflow.training.compute.cluster import dask_client as make_client

    with make_client("", 2) as client:
        yield client


@pytest.fixture(scope="session")
def small_manifest(tmp_path_factory: pytest.TempPathFactory, dask_client: object) -> str:
    """MNIST-1D with 1000 samples, sharded into 2 train shards."""
    from mopflow.training.data import shard_dataset
    from mopflow.training.data.config import DataConfig

    root = tmp_path_factory.mktemp("data")
    result = shard_dataset(DataConfig(num_samples=1000, n_shards=2), str(root), dask_client)
    return result.manifest_uri


PG = ("127.0.0.1", 5432)


@pytest.fixture()
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    require_service("PostgreSQL", *PG)

    name = f"mopflow_test_{uuid.uuid4().hex[:10]}"

    admin_sql = pg_admin_sql

    admin_sql(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+psycopg2://postgres@{PG[0]}:{PG[1]}/{name}"
    finally:
        admin_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test`'s workers take whole test files (their module fixtures are set up once), the
    heaviest first (tests/workers.py)."""
    from tests.workers import HeaviestFileFirstScheduling

    return HeaviestFileFirstScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of the local servers (marked ``services``, or using ``pg_url``) are never in the fast
    tier; tests marked ``gpu`` run only where torch sees a CUDA device."""
    for item in items:
        if item.get_closest_marker("services") or "pg_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
