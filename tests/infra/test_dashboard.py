"""`mopflow dashboard` serves optuna-dashboard on the study storage (a real server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna

from mopflow.base.optuna_storage import make_storage
from mopflow.infra.stack import free_port  # the stack's own: a TCP port free on 127.0.0.1

REPO = Path(__file__).resolve().parents[2]


def test_dashboard_on_a_storage_with_no_study_yet_starts(tmp_path: Path) -> None:
    """A fresh MOPFLOW_HOME has no journal file yet: the dashboard still starts (empty list)."""
    body = _dashboard_studies(tmp_path, tmp_path / "fresh" / "journal.log")
    assert body["study_summaries"] == []


def test_dashboard_serves_the_studies_of_the_configured_storage(tmp_path: Path) -> None:
    journal = tmp_path / "optuna" / "journal.log"
    study = optuna.create_study(
        study_name="sweep-abc", storage=make_storage(str(journal)), direction="maximize"
    )
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    body = _dashboard_studies(tmp_path, journal)
    studies = {s["study_name"]: s for s in body["study_summaries"]}
    assert "sweep-abc" in studies and studies["sweep-abc"]["directions"] == ["maximize"]


def _dashboard_studies(tmp_path: Path, journal: Path) -> dict:
    """Start `mopflow dashboard` on a free port with this journal as the storage; GET /api/studies."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    env |= {"MOPFLOW_HOME": str(tmp_path / "home"), "MOPFLOW_OPTUNA_STORAGE": str(journal)}
    mopflow = Path(sys.executable).with_name("mopflow")
    proc = subprocess.Popen(
        [str(mopflow), "dashboard", "--port", str(port)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2) as resp:
                    return dict(json.loads(resp.read()))
            except OSError:
                time.sleep(0.3)
        output = proc.stdout.read().decode() if proc.poll() is not None and proc.stdout else ""
        raise AssertionError(f"optuna-dashboard did not answer: {output[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
