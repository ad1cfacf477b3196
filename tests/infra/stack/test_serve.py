"""`mopflow serve` follows the champion alias: requests flowing while it moves all succeed, and
each answer comes from one whole model version. What goes wrong around it (a version that does not
load, a deleted alias, an unreadable registry, a malformed request) leaves the served model
answering.

One ``mopflow serve`` process serves the module's tests; each test first makes the version it
starts from the champion, so none depends on what another left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1
from tests.dags.test_end_to_end import REPO
from tests.server_waits import wait_for_output, wait_until_answering

COLUMNS = [f"x{i:03d}" for i in range(40)]
ROWS = np.random.default_rng(0).normal(size=(3, 40)).astype(np.float32)
# A registered name JSON must escape: the server's JSON answers are built by a JSON library.
MODEL = 'the "served" model'
BROKEN = "3"  # the served registry's version whose artifacts were deleted after registration
ENOUGH = 10  # answers from a version that show it is being served


def _register_two_versions(home: Path, name: str = "served") -> str:
    import mlflow
    from mlflow import MlflowClient

    from mopflow.registry.model_registry import log_bundle_model
    from mopflow.training.models.builtin import ArchSpec, build_model
    from mopflow.training.models.bundle import save_bundle

    uri = f"sqlite:///{home / 'mlflow.db'}"
    while mlflow.active_run() is not None:  # a run another test left open in this process
        mlflow.end_run()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)  # an earlier test may have pointed the registry elsewhere
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    # artifacts under the test's folder (a sqlite store's default is ./mlruns in the working directory)
    client.create_experiment("serve", artifact_location=(home / "artifacts").as_uri())
    mlflow.set_experiment("serve")
    arch = ArchSpec("cnn", {"width": 4, "depth": 2}, 40, 10)
    for seed in (1, 2):
        torch.manual_seed(seed)
        bundle = str(home / f"bundle-{seed}")
        save_bundle(bundle, [build_model(arch)], [arch], COLUMNS)
        with mlflow.start_run() as run:
            pass
        model_uri = log_bundle_model(run.info.run_id, "model", bundle, pd.DataFrame(ROWS, columns=COLUMNS))
        mlflow.register_model(model_uri, name)
    client.set_registered_model_alias(name, "champion", "1")
    return uri


def _register_a_version_without_artifacts(client: Any, home: Path, name: str) -> str:
    """A version registered from a copy of version 1's artifacts, which are then deleted."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    artifacts = home / "deleted-artifacts"
    shutil.copytree(local_file_uri_to_path(client.get_model_version_download_uri(name, "1")), artifacts)
    version = str(client.create_model_version(name, source=artifacts.as_uri()).version)
    shutil.rmtree(artifacts)
    return version


def _expected(uri: str, version: str, name: str = "served") -> np.ndarray:
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}/{version}")
    return np.asarray(model.predict(pd.DataFrame(ROWS, columns=COLUMNS)).to_numpy())


def _post(url: str) -> tuple[int, str, np.ndarray | None]:
    """Score ROWS: the status, the answering version and the probabilities (status 0: no answer)."""
    body = json.dumps({"dataframe_split": {"columns": COLUMNS, "data": ROWS.tolist()}}).encode()
    request = urllib.request.Request(
        f"{url}/invocations", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            rows = json.loads(response.read())["predictions"]
            values = np.array([[row[f"prob_{i}"] for i in range(10)] for row in rows])
            return response.status, response.headers["X-Model-Version"], values
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("X-Model-Version", ""), None
    except OSError:  # refused or cut off: the server is gone
        return 0, "", None


def _get(url: str) -> tuple[int, str, str]:
    """GET ``url``: the status, the answering version and the body."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers.get("X-Model-Version", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("X-Model-Version", ""), exc.read().decode()


@dataclass
class Server:
    """The module's ``mopflow serve`` process of :data:`MODEL` and its registry."""

    process: subprocess.Popen[Any]
    url: str
    uri: str
    home: Path
    log: Path
    expected: dict[str, np.ndarray]  # each good version's answer to ROWS

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self) -> Any:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def move_alias(self, version: str) -> None:
        self.client().set_registered_model_alias(MODEL, "champion", version)

    def make_champion(self, version: str) -> None:
        """Point the alias at ``version`` and wait until the server answers with it."""
        self.move_alias(version)
        deadline = time.monotonic() + 60
        while _get(f"{self.url}/ping")[:2] != (200, version):
            assert self.process.poll() is None, f"mopflow serve exited: {self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"version {version} not served: {self.output()[-3000:]}"
            time.sleep(0.1)

    def wait_for_log(self, text: str, since: int, fail_on: tuple[str, ...] = ()) -> None:
        wait_for_output(self.process, self.output, text, since, fail_on)


class Traffic:
    """Scoring requests sent one after another from a thread while a test changes things; every
    answer is kept, in order."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.answers: list[tuple[int, str, np.ndarray | None]] = []
        self._answered = threading.Condition()
        self._done = threading.Event()
        self._sender = threading.Thread(target=self._flow, name="traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sender.join(timeout=60)

    def _flow(self) -> None:
        while not self._done.is_set():
            answer = _post(self.server.url)
            with self._answered:
                self.answers.append(answer)
                self._answered.notify_all()

    def wait_for(self, version: str, count: int = ENOUGH) -> None:
        """Wait until ``count`` answers from ``version`` arrived after those already there; fails
        at the first failed request (with the server's log)."""
        since = len(self.answers)

        def arrived() -> bool:
            fresh = self.answers[since:]
            return any(status != 200 for status, _, _ in fresh) or (
                sum(answered == version for _, answered, _ in fresh) >= count
            )

        with self._answered:
            assert self._answered.wait_for(arrived, timeout=60), (
                f"no {count} answers from version {version} within 60 s: {self.server.output()[-3000:]}"
            )
        failed = [answer[:2] for answer in self.answers[since:] if answer[0] != 200]
        assert not failed, f"failed requests {failed[:5]}: {self.server.output()[-3000:]}"

    def check(self, versions: list[str]) -> None:
        """Every request answered 200 by one whole model, by ``versions`` in this order."""
        assert self.answers and all(status == 200 for status, _, _ in self.answers), [
            a[:2] for a in self.answers if a[0] != 200
        ][:5]
        answered = [version for _, version, _ in self.answers]
        runs = [v for i, v in enumerate(answered) if i == 0 or answered[i - 1] != v]
        assert runs == versions  # once switched, every answer is the new version's
        for _, version, values in self.answers:
            assert values is not None and np.allclose(values, self.server.expected[version], atol=1e-6)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One ``mopflow serve`` of :data:`MODEL` (versions 1 and 2, and :data:`BROKEN`) polling its
    alias every 0.5 s; version 1 is the champion when it starts."""
    home = tmp_path_factory.mktemp("serve")
    uri = _register_two_versions(home, MODEL)
    expected = {v: _expected(uri, v, MODEL) for v in ("1", "2")}
    assert not np.allclose(expected["1"], expected["2"])
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert _register_a_version_without_artifacts(client, home, MODEL) == BROKEN
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    env |= {"MOPFLOW_HOME": str(home / "home"), "MOPFLOW_TRACKING_URI": uri}
    server_log = home / "serve.log"  # a file: a full pipe would block the server
    command = ["serve", "--model", MODEL, "--port", str(port), "--poll-s", "0.5"]
    with server_log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "mopflow.infra.cli", *command],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(f"{url}/ping", process, "mopflow serve", server_log.read_text, poll_s=0.2)
        yield Server(process, url, uri, home, server_log, expected)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


@pytest.mark.slow
def test_serve_switches_to_a_new_champion_without_a_failed_request(server: Server) -> None:
    server.make_champion("1")
    with Traffic(server) as traffic:
        traffic.wait_for("1")
        server.move_alias("2")
        traffic.wait_for("2")
    traffic.check(["1", "2"])


@pytest.mark.slow
def test_a_version_that_does_not_load_leaves_the_served_one_answering(server: Server) -> None:
    server.make_champion("1")
    with Traffic(server) as traffic:
        traffic.wait_for("1")
        since = len(server.output())
        server.move_alias(BROKEN)
        server.wait_for_log(
            f"{MODEL} version {BROKEN} did not load; still serving 1", since, fail_on=("could not read",)
        )
        traffic.wait_for("1")  # answered after the failed load, by the version it kept
        assert _get(f"{server.url}/ping")[:2] == (200, "1")
        server.move_alias("2")  # and a loadable champion after it is still taken up
        traffic.wait_for("2")
    traffic.check(["1", "2"])


@pytest.mark.slow
def test_a_deleted_alias_keeps_the_served_model(server: Server) -> None:
    server.make_champion("1")
    with Traffic(server) as traffic:
        traffic.wait_for("1")
        since = len(server.output())
        server.client().delete_registered_model_alias(MODEL, "champion")
        server.wait_for_log(f"{MODEL}@champion no longer exists; still serving version 1", since)
        traffic.wait_for("1")
        assert _get(f"{server.url}/ping")[:2] == (200, "1")
        assert json.loads(_get(f"{server.url}/health")[2])["version"] == "1"
        server.move_alias("2")  # the alias back, on another version: followed again
        traffic.wait_for("2")
    traffic.check(["1", "2"])


@pytest.mark.slow
def test_an_unreadable_registry_is_logged_and_survived(server: Server) -> None:
    server.make_champion("1")
    registry = server.home / "mlflow.db"
    with Traffic(server) as traffic:
        traffic.wait_for("1")
        saved = registry.read_bytes()
        since = len(server.output())
        try:
            # overwritten in place: the server's open connections read it too
            registry.write_bytes(b"not a database " * 100)
            server.wait_for_log(f"could not read {MODEL}@champion; keeping version 1", since)
            traffic.wait_for("1")
        finally:
            registry.write_bytes(saved)
        server.move_alias("2")  # the watcher still runs: the next move is followed
        traffic.wait_for("2")
    traffic.check(["1", "2"])


MALFORMED: dict[str, tuple[str, bytes]] = {
    "not JSON": ("application/json", b'{"dataframe_split": '),
    "not UTF-8": ("application/json", b"\xff\xfe{}"),
    "a JSON list": ("application/json", b"[[1.0, 2.0]]"),
    "no input field": ("application/json", json.dumps({"rows": ROWS.tolist()}).encode()),
    "two input fields": ("application/json", json.dumps({"inputs": [[0.0]], "instances": [[0.0]]}).encode()),
    "other columns": (
        "application/json",
        json.dumps({"dataframe_split": {"columns": ["a"], "data": [[1]]}}).encode(),
    ),
    "text in a float column": (
        "application/json",
        json.dumps({"dataframe_records": [dict.fromkeys(COLUMNS, "x")]}).encode(),
    ),
    "a short row": (
        "application/json",
        json.dumps({"dataframe_split": {"columns": COLUMNS, "data": [[1.0]]}}).encode(),
    ),
    "CSV of other columns": ("text/csv", b"a,b\n1,2\n"),
    "an unsupported type": ("text/plain", b"hello"),
}


@pytest.mark.slow
def test_a_malformed_request_is_answered_4xx_and_serving_goes_on(server: Server) -> None:
    server.make_champion("1")
    answers: dict[str, tuple[int, str | None]] = {}
    for what, (content_type, body) in MALFORMED.items():
        request = urllib.request.Request(
            f"{server.url}/invocations", data=body, headers={"Content-Type": content_type}
        )
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        answers[what] = (answer.value.code, answer.value.headers.get("X-Model-Version"))
        if answer.value.code == 400:  # MLflow's error JSON, saying what is wrong
            assert json.loads(answer.value.read())["error_code"], what
    assert all(400 <= code < 500 and version == "1" for code, version in answers.values()), answers
    status, version, values = _post(server.url)
    assert (status, version) == (200, "1") and values is not None
    assert np.allclose(values, server.expected["1"], atol=1e-6)


@pytest.mark.slow
def test_version_and_health_are_json_of_the_served_model(server: Server) -> None:
    server.make_champion("2")
    status, version, body = _get(f"{server.url}/version")
    assert (status, version) == (200, "2")
    assert json.loads(body) == {"model": MODEL, "version": "2"}  # the name's quotes escaped
    assert json.loads(_get(f"{server.url}/health")[2]) == {
        "model": MODEL,
        "alias": "champion",
        "version": "2",
    }


def test_serve_without_a_champion_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    env |= {"MOPFLOW_HOME": str(tmp_path), "MOPFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mopflow.infra.cli",
            "serve",
            "--model",
            "nothing",
            "--port",
            str(free_port()),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "cannot serve nothing@champion" in proc.stderr and "mopflow promote" in proc.stderr


def test_a_waiting_server_is_up_without_a_champion_and_serves_one_once_it_exists(tmp_path: Path) -> None:
    import warnings

    from mlflow import MlflowClient

    from mopflow.infra.stack.serve import ChampionFollower, make_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    follower = ChampionFollower(MlflowClient(tracking_uri=uri, registry_uri=uri), "served")
    client = TestClient(make_app(follower))
    assert follower.champion_version() is None and not follower.refresh()  # no model at all yet
    assert client.get("/health").json() == {"model": "served", "alias": "champion", "version": None}
    assert client.get("/ping").status_code == 503
    assert client.post("/invocations", json={"inputs": [[0.0]]}).status_code == 503

    uri = _register_two_versions(tmp_path)  # the same registry, now with a champion (version 1)
    assert follower.refresh() and follower.served_version == "1"
    assert client.get("/health").json()["version"] == "1"
    ping = client.get("/ping")
    assert ping.status_code == 200 and ping.headers["X-Model-Version"] == "1"
