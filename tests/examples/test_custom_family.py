"""The example family package (examples/custom_family), installed as a package is (its entry
point, not an edit to mopflow), taken through shard -> search -> ensemble -> distill ->
register -> serve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dags.serving import invoke, served
from tests.dags.test_end_to_end import REPO, TINY, _env

# At 16 channels or more, any two members leave a budget (0.1 x the ensemble's parameters) of
# at least 523 parameters: room for the smallest depth-3 TCN student (334), whichever trials
# the search completes.
SPACE = {
    "families": {
        "tcn": {
            "channels": {"type": "int", "low": 16, "high": 24},
            "levels": {"type": "int", "low": 2, "high": 3},
            "kernel": {"type": "categorical", "choices": [3, 5]},
            "dropout": {"type": "float", "low": 0.0, "high": 0.1},
        }
    }
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package installed into its own folder (put on PYTHONPATH of the processes
    that train and serve, as a package installed into their environment would be)."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    source = build / "custom_family"  # a copy: building writes into the source folder
    shutil.copytree(REPO / "examples" / "custom_family", source)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(build)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (target / "mopflow_example_family").is_dir()
    return target


def _env_with(home: Path, site: Path) -> dict[str, str]:
    env = _env(home)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env


@pytest.mark.slow
def test_an_installed_family_goes_through_every_stage_and_is_served(tmp_path: Path, installed: Path) -> None:
    home = tmp_path / "home"
    config = tmp_path / "tcn.json"
    # the smallest run that still goes through every stage: two one-epoch trials, both ensembled
    small = {"n_trials": 2, "epochs": 1, "min_resource": 1, "top_k": 2, "distill_epochs": 1}
    conf = {
        **TINY,
        **small,
        "model_name": "tcn",
        "search_space": SPACE,
        "student_family": "tcn",
        "student_depth": 3,
    }
    config.write_text(json.dumps(conf))
    summary_file = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mopflow.infra.cli",
            "run",
            "--config",
            str(config),
            "--summary-json",
            str(summary_file),
        ],
        cwd=REPO,
        env=_env_with(home, installed),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads(summary_file.read_text())
    assert summary["best_trial"]["params"]["family"] == "tcn"
    assert {"channels", "levels", "kernel", "dropout"} <= set(summary["best_trial"]["params"])
    assert summary["student"]["arch"]["family"] == "tcn"
    assert summary["student"]["num_params"] <= 0.1 * summary["ensemble"]["num_params"]
    assert summary["registered"]["aliases"]

    # the model server needs the package too, as it needs torch
    pythonpath = {"PYTHONPATH": os.pathsep.join([str(installed), str(REPO)])}
    with served(home, "models:/tcn-student@champion", pythonpath) as url:
        columns = [f"x{i:03d}" for i in range(40)]
        rows = [[0.05 * i for i in range(40)]] * 2
        answer = invoke(url, {"dataframe_split": {"columns": columns, "data": rows}})
    rows = answer["predictions"]
    assert len(rows) == 2 and abs(sum(rows[0].values()) - 1.0) < 1e-4


def test_without_the_package_the_family_is_refused_naming_the_registered_ones(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", "run", "--set", f"search_space={json.dumps(SPACE)}"],
        cwd=REPO,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown model family 'tcn'" in proc.stderr and "registered: ['cnn'" in proc.stderr
    assert not (home / "data").exists()
