"""`mlflow models serve` of a registered model on a free local port, for the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1
from tests.server_waits import wait_until_answering


@contextmanager
def served(
    home: Path,
    model_uri: str,
    extra_env: Mapping[str, str] | None = None,
    python: Path | None = None,
) -> Iterator[str]:
    """Serve ``model_uri`` from ``home``'s MLflow registry with the MLflow of ``python`` (default:
    this one's); yield the server's base URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(extra_env or {})
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    mlflow = [str(python), "-m", "mlflow"] if python else [str(Path(sys.executable).with_name("mlflow"))]
    command = [*mlflow, "models", "serve", "-m", model_uri, "--env-manager", "local"]
    server = subprocess.Popen(
        [*command, "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output = server.stdout
        wait_until_answering(
            f"http://127.0.0.1:{port}/ping",
            server,
            "the model server",
            lambda: output.read().decode() if output else "",
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited already
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def invoke(base_url: str, payload: Any) -> Any:
    """POST ``payload`` to the server's /invocations; the parsed answer."""
    request = urllib.request.Request(
        f"{base_url}/invocations",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
