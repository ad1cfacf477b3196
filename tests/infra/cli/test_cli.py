"""`mopflow run` refuses a malformed config before anything runs (no Airflow DB, no data, no runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("unknown=1", ["unknown config key(s) ['unknown']", "expected some of", "'n_trials'"]),
        ("@" + json.dumps({"search_space": "x" * 140_000}), ["config is", "the limit is 131072"]),
        ("n_trials=many", ["n_trials", "'many'"]),
    ],
    ids=["unknown-key", "oversized", "wrong-type"],
)
def test_run_refuses_a_bad_config_before_anything_runs(
    tmp_path: Path, override: str, needles: list[str]
) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_"))}
    env["MOPFLOW_HOME"] = str(home)
    args = ["--set", override]
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
