"""`mopflow serve` follows the champion alias: requests flowing while it moves all succeed, and
each answer comes from one whole model version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1
from tests.dags.test_end_to_end import REPO
from tests.server_waits import wait_until_answering

COLUMNS = [f"x{i:03d}" for i in range(40)]
ROWS = np.random.default_rng(0).normal(size=(3, 40)).astype(np.float32)


def _register_two_versions(home: Path) -> str:
    import mlflow
    from mlflow import MlflowClient

    from mopflow.compression.registry.model_registry import log_bundle_model
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
        mlflow.register_model(model_uri, "served")
    client.set_registered_model_alias("served", "champion", "1")
    return uri


def _expected(uri: str, version: str) -> np.ndarray:
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/served/{version}")
    return np.asarray(model.predict(pd.DataFrame(ROWS, columns=COLUMNS)).to_numpy())


def _post(url: str) -> tuple[int, str, np.ndarray | None]:
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
        return exc.code, "", None


@pytest.mark.slow
def test_serve_switches_to_a_new_champion_without_a_failed_request(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    uri = _register_two_versions(tmp_path)
    expected = {v: _expected(uri, v) for v in ("1", "2")}
    assert not np.allclose(expected["1"], expected["2"])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    env |= {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_TRACKING_URI": uri}
    server_log = tmp_path / "serve.log"  # a file: a full pipe would block the server
    command = ["serve", "--model", "served", "--port", str(port), "--poll-s", "0.5"]
    with server_log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "mopflow.infra.cli", *command],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    answers: list[tuple[int, str, np.ndarray | None]] = []
    done = threading.Event()
    try:
        wait_until_answering(f"{url}/ping", server, "mopflow serve", server_log.read_text, poll_s=0.5)

        def flow() -> None:
            while not done.is_set():
                answers.append(_post(url))

        sender = threading.Thread(target=flow)
        sender.start()
        time.sleep(2.0)
        MlflowClient(tracking_uri=uri, registry_uri=uri).set_registered_model_alias("served", "champion", "2")
        deadline = time.monotonic() + 60
        while not any(a[1] == "2" for a in answers):
            assert time.monotonic() < deadline, server_log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        done.set()
        sender.join(timeout=60)
    finally:
        done.set()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert answers and all(status == 200 for status, _, _ in answers)
    versions = [version for _, version, _ in answers]
    assert versions[0] == "1" and versions[-1] == "2"
    assert versions == sorted(versions)  # once switched, every answer comes from the new version
    for _, version, values in answers:  # each answer is one whole model's
        assert values is not None and np.allclose(values, expected[version], atol=1e-6)


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
