"""MLflow's log records under an Airflow-style root logger: through the root, at their own level."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A child process: its root logger is configured (as Airflow's task runner does) or not at all.
SCRIPT = """
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()])
if sys.argv[1] == "configured":
    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)
import mlflow  # installs MLflow's own stderr handler
from mopflow.base.tracking import route_mlflow_logs_to_root
routed = route_mlflow_logs_to_root()
logging.getLogger("mlflow.store.model_registry").info("Registered model 'm'.")
from mlflow.utils.logging_utils import eprint
eprint("Created version '1' of model 'm'.")  # how mlflow.register_model reports it
print(json.dumps({"routed": routed, "records": records}))
"""


def _run(mode: str) -> tuple[dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_mlflow_info_goes_through_a_configured_root_logger_as_info_not_to_stderr() -> None:
    found, stderr = _run("configured")
    assert found["routed"] is True
    assert found["records"] == [
        ["mlflow.store.model_registry", "INFO", "Registered model 'm'."],
        ["mlflow", "INFO", "Created version '1' of model 'm'."],
    ]
    assert "model 'm'" not in stderr  # stderr lines read as errors in an Airflow task log


def test_without_a_configured_root_logger_mlflow_keeps_its_own_handler() -> None:
    found, stderr = _run("bare")
    assert found == {"routed": False, "records": []}
    assert "Registered model 'm'." in stderr and "Created version '1' of model 'm'." in stderr
