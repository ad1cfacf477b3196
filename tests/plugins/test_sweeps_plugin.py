"""The Sweeps plugin: discovered by Airflow's plugins manager; its page over a real MLflow store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

EVIL = "<script>alert('x')</script>"
# The smallest valid PNG (1x1, transparent), standing in for a Gantt chart.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)


def _log_pipeline_run(tracker: Any, key: str, dag_id: str, finished: bool, tmp: Path) -> str:
    """A pipeline run as the stage layer tags it: parent, search, and trials or a leaderboard."""
    base = {"mopflow.dag_id": dag_id, "mopflow.airflow_run_id": f"manual__{key}", "mopflow.run_key": key}
    parent = tracker.start_run(f"pipeline-{key}", {**base, "mopflow.stage": "pipeline"})
    tracker.log_params(parent, {"strategy": "mop" if finished else "task"})
    study = f"mopflow-{key}"
    search = tracker.start_run(
        "search", {**base, "mopflow.stage": "search", "mopflow.study": study}, parent_run_id=parent
    )
    if finished:
        board = [
            {
                "trial": 1,
                "state": "COMPLETE",
                "val_acc": 0.91,
                "pruned_epoch": None,
                "params": {"family": "resnet", "lr": 0.0123456789, "width": 1024},
            },
            {"trial": 0, "state": "PRUNED", "val_acc": 0.42, "pruned_epoch": 3, "params": {"family": EVIL}},
        ]
        tracker.log_dict(search, board, "leaderboard.json")
        charts = tmp / key
        charts.mkdir()
        for epoch in (1, 2):
            (charts / f"gantt-epoch-{epoch:03d}.png").write_bytes(PNG)
        (charts / "units-epoch-001.json").write_text("[]")
        tracker.log_artifacts(search, str(charts), "mop")
        distill = tracker.start_run("distill", {**base, "mopflow.stage": "distill"}, parent_run_id=parent)
        front = tmp / f"{key}-front"
        front.mkdir()
        (front / "pareto_front.png").write_bytes(PNG)
        tracker.log_artifacts(distill, str(front), "student_search")
        register = tracker.start_run("register", {**base, "mopflow.stage": "register"}, parent_run_id=parent)
        tracker.set_tags(
            register,
            {"mopflow.promoted": "true", "mopflow.promotion_reason": "no champion yet; promotion=accuracy"},
        )
    else:  # still searching: only trial runs so far
        trial = tracker.start_run(
            "trial-0", {**base, "mopflow.stage": "trial", "mopflow.trial": "0"}, parent_run_id=search
        )
        tracker.log_params(trial, {"width": 64})
        tracker.log_metric_history(trial, "val_acc", [(0, 0.3), (1, 0.55)])
        tracker.set_tags(trial, {"mopflow.trial_state": "COMPLETE"})
    return search


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real MLflow SQLite store with a finished MOP sweep and a running retrain search."""
    home = tmp_path_factory.mktemp("plugin") / "home"
    with pytest.MonkeyPatch.context() as mp:
        for var in list(os.environ):
            if var.startswith(("MOPFLOW_", "MLFLOW_")):
                mp.delenv(var, raising=False)
        mp.setenv("MOPFLOW_HOME", str(home))
        mp.setenv("MOPFLOW_OPTUNA_DASHBOARD_URL", "http://127.0.0.1:18081")
        mp.setenv("MLFLOW_TRACKING_URI", "")  # restored by the monkeypatch after MLflow exports its own
        from mopflow.base.settings import Settings
        from mopflow.base.tracking import MlflowTracker

        settings = Settings.from_env()
        tracker = MlflowTracker(
            settings.tracking_uri, settings.experiment_name, settings.mlflow_artifact_location
        )
        searches = {
            "aaa111": _log_pipeline_run(tracker, "aaa111", "mopflow_retrain", False, home.parent),
            "bbb222": _log_pipeline_run(tracker, "bbb222", "mopflow_sweep", True, home.parent),
        }
        yield {"settings": settings, "searches": searches, "experiment_id": tracker.experiment_id}


@pytest.fixture()
def client(store: dict[str, Any]) -> Any:
    from fastapi.testclient import TestClient

    from mopflow.plugins import mopflow_plugin

    app = mopflow_plugin.create_app()
    app.dependency_overrides[mopflow_plugin.require_user] = lambda: None  # auth is tested below
    return TestClient(app)


def test_plugin_is_discovered_by_airflow(tmp_path: Path) -> None:
    code = """
import json
from airflow import plugins_manager as pm
plugins, errors = pm._get_plugins()
apps, _ = pm.get_fastapi_plugins()
plugin = next(p for p in plugins if p.name == "mopflow")
print(json.dumps({"errors": errors, "prefixes": [a["url_prefix"] for a in apps], "views": plugin.external_views}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MOPFLOW_"))}
    env |= {
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(tmp_path / "plugins"),  # none: the entry point loads it
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "MOPFLOW_MLFLOW_UI_URL": "http://127.0.0.1:15000",
    }
    # cwd outside the checkout: its mopflow.egg-info (from `pip install -e`) would be a second
    # distribution with the same plugin entry point
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["errors"] == {}
    assert found["prefixes"] == ["/mopflow"]
    views = {v["name"]: v for v in found["views"]}
    assert views["Sweeps"]["url_route"] == "mopflow-sweeps"
    assert views["Sweeps"]["href"] == "mopflow/sweeps"  # relative: resolved against the UI's base URL
    assert views["MLflow UI"]["href"] == "http://127.0.0.1:15000"
    assert views["Optuna dashboard"]["href"] == "http://127.0.0.1:8081/dashboard"


def test_sweeps_page_renders_the_leaderboards(client: Any, store: dict[str, Any]) -> None:
    response = client.get("/sweeps")
    assert response.status_code == 200, response.text
    page = response.text
    # newest first: the finished sweep was logged last
    assert page.index("mopflow_sweep") < page.index("mopflow_retrain")
    assert "0.9100" in page and "0.4200" in page and "PRUNED" in page
    # pruned_epoch 3 is Optuna's 0-based step: "pruned after epoch 4", as the task log says
    assert "<th>pruned after epoch</th>" in page and "<td>4</td>" in page and "<td>3</td>" not in page
    # params: a key/value list, floats rounded, no item wraps inside a number
    assert "<li><code>lr</code> 0.01235</li><li><code>width</code> 1024</li>" in page
    # each trial's family has its own column
    assert "<th>family</th>" in page and '<td class="family">resnet</td>' in page
    assert "<li><code>family</code>" not in page
    assert "break-all" not in page and "ul.params li{display:inline-block;white-space:nowrap" in page
    # the running search shows its trial runs
    assert "0.5500" in page and "still running" in page and "<li><code>width</code> 64</li>" in page
    # links: MLflow run and optuna-dashboard
    exp = store["experiment_id"]
    assert f"http://127.0.0.1:5000/#/experiments/{exp}/runs/" in page
    assert "http://127.0.0.1:18081/dashboard" in page
    # the last epoch's Gantt chart is shown, the others linked
    search = store["searches"]["bbb222"]
    assert f'src="/sweeps/gantt/{search}/gantt-epoch-002.png"' in page
    assert f'href="/sweeps/gantt/{search}/gantt-epoch-001.png"' in page
    assert '<p class="promotion">promoted to champion: no champion yet; promotion=accuracy</p>' in page


def test_the_gate_s_verdict_is_shown_with_its_reason() -> None:
    from mopflow.plugins import sweeps_html

    reason = "test accuracy 0.9510 < champion's 0.9670 on the same test set"
    assert sweeps_html.render_promotion("false", reason) == f"not promoted: {reason}"
    assert sweeps_html.render_promotion("true", None) == "promoted to champion"
    assert sweeps_html.render_promotion(None, None) == ""
    assert sweeps_html.render_params({}) == "-"
    assert sweeps_html.render_params({"sampler": "tpe", "dropout": "0.30000000000000004"}) == (
        '<ul class="params"><li><code>dropout</code> 0.3</li><li><code>sampler</code> tpe</li></ul>'
    )


def test_params_are_escaped(client: Any) -> None:
    page = client.get("/sweeps").text
    assert EVIL not in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page


def test_filter_by_dag_and_limit(client: Any) -> None:
    page = client.get("/sweeps", params={"dag_id": "mopflow_retrain"}).text
    assert "mopflow_retrain" in page and "<h2>mopflow_sweep" not in page
    assert page.count('class="sweep"') == 1
    assert client.get("/sweeps", params={"limit": 1}).text.count('class="sweep"') == 1
    assert client.get("/sweeps", params={"dag_id": "other"}).status_code == 422


def test_gantt_chart_is_served_and_names_are_checked(client: Any, store: dict[str, Any]) -> None:
    search = store["searches"]["bbb222"]
    response = client.get(f"/sweeps/gantt/{search}/gantt-epoch-001.png")
    assert response.status_code == 200
    assert response.headers["content-type"] == "image/png" and response.content == PNG
    bad = client.get(f"/sweeps/gantt/{search}/units-epoch-001.json")
    assert bad.status_code == 400 and "gantt-epoch-N.png" in bad.text
    assert client.get("/sweeps/gantt/not-a-run/gantt-epoch-001.png").status_code == 400
    assert client.get(f"/sweeps/gantt/{search}/gantt-epoch-009.png").status_code == 404


def test_a_student_search_front_is_shown_and_served(client: Any) -> None:
    """The finished sweep's distill run logged a student search: its Pareto front is on the page
    and served; the running sweep has none."""
    import re

    page = client.get("/sweeps").text
    (run_id,) = re.findall(r'src="/sweeps/student-front/([0-9a-f]{32})"', page)
    assert page.count("Student search: the Pareto front") == 1
    response = client.get(f"/sweeps/student-front/{run_id}")
    assert response.status_code == 200 and response.content == PNG
    assert client.get("/sweeps/student-front/../../etc").status_code in (400, 404)
    assert client.get("/sweeps/student-front/not-a-run").status_code == 400
    assert client.get(f"/sweeps/student-front/{'0' * 32}").status_code == 404


def test_page_needs_an_authenticated_user(store: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient

    from mopflow.plugins import mopflow_plugin

    anonymous = TestClient(mopflow_plugin.create_app())
    assert anonymous.get("/sweeps").status_code == 401
    assert (
        anonymous.get(f"/sweeps/gantt/{store['searches']['bbb222']}/gantt-epoch-001.png").status_code == 401
    )


def test_no_sweeps_yet() -> None:
    from mopflow.plugins.sweeps_html import render_page
    from mopflow.plugins.sweeps_page import Links, PageData

    page = render_page(PageData([], Links(), "mopflow"))
    assert "No sweeps yet" in page and "mopflow_sweep" in page


def test_an_experiment_without_sweeps_renders_none(store: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    from mopflow.plugins.sweeps_page import load_sweeps

    client = MlflowClient(tracking_uri=store["settings"].tracking_uri)
    assert load_sweeps(client, "no-such-experiment") == []
    client.create_experiment("empty-experiment")
    assert load_sweeps(client, "empty-experiment") == []


def test_ui_links_from_settings_and_stack() -> None:
    from mopflow.plugins.sweeps_page import ui_links

    assert ui_links({}).mlflow_ui == "http://127.0.0.1:5000"
    assert ui_links({}).optuna_dashboard == "http://127.0.0.1:8081"
    stack = ui_links({"MOPFLOW_TRACKING_URI": "http://127.0.0.1:5123/", "MOPFLOW_OPTUNA_PORT": "8124"})
    assert (stack.mlflow_ui, stack.optuna_dashboard) == ("http://127.0.0.1:5123", "http://127.0.0.1:8124")
    assert ui_links({"MOPFLOW_MLFLOW_UI_URL": "https://mlflow.example"}).mlflow_ui == "https://mlflow.example"
    assert ui_links({"MOPFLOW_TRACKING_URI": "sqlite:///x.db"}).mlflow_ui == "http://127.0.0.1:5000"
    with pytest.raises(ValueError, match="MOPFLOW_MLFLOW_UI_URL"):
        ui_links({"MOPFLOW_MLFLOW_UI_URL": "javascript:alert(1)"})
