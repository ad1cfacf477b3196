"""`mopflow run` refuses a malformed config before anything runs (no Airflow DB, no data, no runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PORT_RANGE_ENV

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("n_trails=3", ["unknown config key 'n_trails'; did you mean 'n_trials'?", "'many'"]),
        ("@" + json.dumps({"search_space": "x" * 140_000}), ["config is", "the limit is 131072"]),
        ("n_trials=1.5", ["n_trials", "'1.5'", "epochs", "'many'"]),
    ],
    ids=["unknown-key", "oversized", "wrong-type"],
)
def test_run_refuses_a_bad_config_before_anything_runs(
    tmp_path: Path, override: str, needles: list[str]
) -> None:
    home = tmp_path / "home"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_")) or k == PORT_RANGE_ENV
    }
    env["MOPFLOW_HOME"] = str(home)
    args = ["--set", override, "--set", "epochs=many"]  # an unknown key's error comes with the others
    if override.startswith("@"):  # too long for one argument: a config file
        config = tmp_path / "conf.json"
        config.write_text(override[1:])
        args = ["--config", str(config)]
    proc = subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", "run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "mopflow: invalid config:" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])
    assert not home.exists(), sorted(str(p) for p in home.rglob("*"))  # no Airflow DB, data or runs


def test_promote_says_only_what_it_refused(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_")) or k == PORT_RANGE_ENV
    }
    env["MOPFLOW_HOME"] = str(tmp_path / "home")  # a fresh MLflow database: MLflow creates its tables
    proc = subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", "promote", "nothing", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == "mopflow: registered model 'nothing' has no version '1'\n"


def test_the_shell_completes_commands_and_flags(tmp_path: Path) -> None:
    """What `eval "$(register-python-argcomplete mopflow)"` asks the command (argcomplete's protocol)."""
    answers = {}
    for line in ("mopflow con", "mopflow runs --for"):
        out = tmp_path / "completions.txt"
        env = dict(os.environ) | {
            "_ARGCOMPLETE": "1",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
            "_ARGCOMPLETE_IFS": "\n",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "mopflow.infra.cli"], cwd=REPO, env=env, capture_output=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        answers[line] = out.read_text().split()
    assert answers == {"mopflow con": ["config-keys"], "mopflow runs --for": ["--format"]}
