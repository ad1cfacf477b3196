"""`mopflow run` end to end through Airflow's dag.test() on a tiny config, then the outcomes.

The run is the accuracy benchmark's quick run (``benchmarks/mnist1d_accuracy.py --quick``, with the
tiny settings on top): one pipeline run serves both, and the benchmark's report is checked too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PORT_RANGE_ENV
from tests.dags.serving import invoke, served

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "num_samples": 1000,
    "n_shards": 2,
    "n_trials": 3,
    "epochs": 3,
    "min_resource": 1,
    "top_k": 2,
    "distill_epochs": 2,
    "model_name": "e2e",
    "max_gap_to_ensemble": 100,  # tiny models are far from their ensemble; the gate is tested elsewhere
}


def _env(home: Path) -> dict[str, str]:
    # MLflow exports its URIs into os.environ when set in-process: never leak them into a child.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_")) or k == PORT_RANGE_ENV
    }
    env["MOPFLOW_HOME"] = str(home)
    env["MOPFLOW_RETRY_DELAY_S"] = "1"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _mopflow(home: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", *args],
        cwd=REPO,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def quick_benchmark(home: Path, script: str, settings: list[str]) -> dict:
    """``benchmarks/<script> --quick`` run in ``home`` (kept) with ``settings`` on top; its report
    (written next to ``home``, never to ``benchmarks/results/``)."""
    report = home.parent / f"{Path(script).stem}.json"
    recorded = {p.name: p.stat().st_mtime_ns for p in (REPO / "benchmarks" / "results").iterdir()}
    sets = [arg for item in settings for arg in ("--set", item)]
    command = [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--home", str(home)]
    proc = subprocess.run(
        [*command, "--out", str(report), *sets],
        cwd=REPO,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert recorded == {p.name: p.stat().st_mtime_ns for p in (REPO / "benchmarks" / "results").iterdir()}
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    home = tmp_path_factory.mktemp("e2e") / "home"
    quick_benchmark(home, "mnist1d_accuracy.py", [f"{k}={v}" for k, v in TINY.items()])
    return home, json.loads((home / "summary.json").read_text())


@pytest.mark.slow
def test_the_run_gives_the_accuracy_benchmarks_quick_report(pipeline_run: tuple[Path, dict]) -> None:
    from tests.benchmarks.test_quick import check_mnist1d_accuracy

    home, summary = pipeline_run
    report = json.loads((home.parent / "mnist1d_accuracy.json").read_text())
    check_mnist1d_accuracy(report, home.parent)
    assert report["result"]["student_test_acc"] == summary["student"]["test_acc"]
    assert "mopflow run summary" in (home / "run.log").read_text()


@pytest.mark.slow
def test_student_is_registered_as_champion(pipeline_run: tuple[Path, dict]) -> None:
    home, summary = pipeline_run
    from mlflow import MlflowClient

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("e2e-student", "champion")
    assert str(version.version) == summary["registered"]["version"]
    assert client.get_model_version_by_alias("e2e-student", "challenger").version == version.version
    assert summary["student"]["num_params"] <= 0.1 * summary["ensemble"]["num_params"]
    assert 0.0 <= summary["ensemble"]["test_acc"] <= 1.0


@pytest.mark.slow
def test_champion_pyfunc_loads_in_a_fresh_process(pipeline_run: tuple[Path, dict]) -> None:
    home, _ = pipeline_run
    # Loading and predicting with warnings as errors: MLflow's own import-time warnings come first,
    # and the deprecations SQLAlchemy 2.1 reports from MLflow's SQLite store are not the model's.
    # The process cannot import the installed mopflow: only the one the model ships as a zip.
    code = f"""
import importlib.machinery, sys
class OnlyFromAZip:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "mopflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if p.endswith(".zip")])
        if spec is None:
            raise ModuleNotFoundError("mopflow is not installed here", name=name)
        return spec
sys.meta_path.insert(0, OnlyFromAZip)
import json, warnings, mlflow, mlflow.pyfunc, numpy as np, pandas as pd
warnings.simplefilter("error")
warnings.filterwarnings("default", category=DeprecationWarning)
mlflow.set_tracking_uri("sqlite:///{home / "mlflow" / "mlflow.db"}")
model = mlflow.pyfunc.load_model("models:/e2e-student@champion")
cols = [f"x{{i:03d}}" for i in range(40)]
out = model.predict(pd.DataFrame(np.random.default_rng(0).normal(size=(7, 40)).astype("float32"), columns=cols))
files = sorted({{m.__file__ for n, m in sys.modules.items() if n.split(".")[0] == "mopflow"}})
print(json.dumps({{"shape": list(out.shape), "sums": out.sum(axis=1).tolist(), "mopflow": files}}))
"""
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MOPFLOW_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/", env=clean_env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == [7, 10]
    assert all(abs(s - 1.0) < 1e-4 for s in result["sums"])
    # every mopflow module it ran came from the model's own artifact, mopflow.zip
    assert result["mopflow"] and all("/mopflow.zip/mopflow/" in f for f in result["mopflow"]), result[
        "mopflow"
    ]


@pytest.mark.slow
def test_runs_carry_lineage_and_match_the_study(pipeline_run: tuple[Path, dict]) -> None:
    home, summary = pipeline_run
    import optuna
    from mlflow import MlflowClient
    from optuna.trial import TrialState

    from mopflow.base import storage
    from mopflow.base.optuna_storage import make_storage

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("mopflow")
    runs = client.search_runs([experiment.experiment_id], f"tags.`mopflow.run_key` = '{summary['run_key']}'")
    manifest_files = list((home / "data").rglob("manifest.json"))
    assert len(manifest_files) == 1
    manifest = storage.read_json(str(manifest_files[0]))
    stages = {r.data.tags.get("mopflow.stage") for r in runs}
    assert {"pipeline", "shard", "search", "ensemble", "distill", "register", "trial"} <= stages
    for run in runs:
        assert run.info.status == "FINISHED", (run.info.run_name, run.info.status)
        if run.data.tags["mopflow.stage"] != "pipeline":
            assert run.data.tags["mopflow.manifest_hash"] == manifest["manifest_hash"], run.info.run_name
            assert run.data.tags["mlflow.parentRunId"]
        assert run.data.tags["mopflow.dag_id"] == "mopflow_retrain"
        assert run.data.tags["mopflow.airflow_run_id"] == summary["airflow_run_id"]
    trial_runs = [r for r in runs if r.data.tags["mopflow.stage"] == "trial"]
    study = optuna.load_study(
        study_name=summary["optuna"]["study_name"], storage=make_storage(summary["optuna"]["storage"])
    )
    finished = [
        t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    ]
    assert len(trial_runs) == len(finished) >= TINY["n_trials"]
    assert sum(t.state == TrialState.COMPLETE for t in finished) >= TINY["top_k"]
    assert {r.data.tags["mopflow.trial"] for r in trial_runs} == {str(t.number) for t in finished}
    for run in trial_runs:
        assert run.data.tags["mopflow.study"] == study.study_name
        assert client.get_metric_history(run.info.run_id, "val_acc"), "per-epoch metrics are logged"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("dataset=imagenet", "imagenet"),
        ("n_trials=0", "n_trials"),
        ("top_k=40", "top_k=40"),
        ("student_width=3000", "student_width=3000"),
    ],
)
def test_bad_input_fails_before_any_training(tmp_path: Path, override: str, needle: str) -> None:
    home = tmp_path / "home"
    proc = _mopflow(home, "run", "--set", override, timeout=120)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert not (home / "optuna").exists() and not (home / "data").exists() and not (home / "mlflow").exists()


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_probabilities(pipeline_run: tuple[Path, dict]) -> None:
    home, _ = pipeline_run
    with served(home, "models:/e2e-student@champion") as url:
        columns = [f"x{i:03d}" for i in range(40)]
        answer = invoke(
            url, {"dataframe_split": {"columns": columns, "data": [[0.1 * i for i in range(40)]] * 3}}
        )
    rows = answer["predictions"]
    assert len(rows) == 3 and len(rows[0]) == 10
    assert abs(sum(rows[0].values()) - 1.0) < 1e-4
