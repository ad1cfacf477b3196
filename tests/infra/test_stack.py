"""The whole local stack, marked slow: `mopflow up` on free ports with a sweep triggered through
Airflow's REST API and its model found through MLflow's REST API, the UIs in a browser, then
`mopflow down`. The stack's parts are tested on their own in tests/infra/stack/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mopflow.base.settings import TRAINING_POOL
from mopflow.infra import stack
from mopflow.infra.stack.processes import is_running
from tests.conftest import PORT_RANGE_ENV, skip_unless_required
from tests.rest import request_json

REPO = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)

DAG_ID = "mopflow_sweep"
# The tiny config of tests/dags/test_end_to_end.py, smaller still: 2 trials of 2 epochs.
TINY: dict[str, Any] = {
    "num_samples": 1000,
    "n_shards": 2,
    "n_trials": 2,
    "epochs": 2,
    "min_resource": 1,
    "top_k": 2,
    "distill_epochs": 2,
    "munge_multiplier": 0,
    "model_name": "stack",
    "max_gap_to_ensemble": 100,  # tiny models are far from their ensemble; the gate is tested elsewhere
}


RETRAIN_DAG_ID = "mopflow_retrain"
# The retrain's own Params (MOPFLOW_RETRAIN_CONFIG): as small as TINY; the data and the model name
# come from the sweep's new-shards event. "always" promotes it, so the served champion moves.
RETRAIN_CONFIG = {
    key: TINY[key]
    for key in ("n_trials", "epochs", "min_resource", "top_k", "distill_epochs", "munge_multiplier")
} | {"promotion": "always"}


def _env(home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_")) or k == PORT_RANGE_ENV
    }
    retrain_config = home.parent / "retrain.yaml"
    retrain_config.write_text(json.dumps(RETRAIN_CONFIG))  # JSON is YAML
    env.update(
        MOPFLOW_HOME=str(home),
        MOPFLOW_RETRAIN_SCHEDULE="none",  # only data events start a retrain
        MOPFLOW_RETRAIN_CONFIG=str(retrain_config),
        MOPFLOW_SERVE_MODEL=f"{TINY['model_name']}-student",
        MOPFLOW_RETRY_DELAY_S="1",
        MOPFLOW_STACK_FREE_PORTS="1",
        MOPFLOW_STACK_GRACE_S="15",
        PATH=BIN + os.pathsep + env.get("PATH", ""),
    )
    return env


def _mopflow(home: Path, *args: str, timeout: int = 420) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mopflow.infra.cli", *args],
        cwd=REPO,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Stack:
    """The running stack as the tests see it: its state file, an Airflow token, REST helpers."""

    def __init__(self, home: Path) -> None:
        self.home = home
        state = stack.read_state(stack.state_path(home))
        assert state is not None
        self.state = state
        urls = {s.name: s.url for s in state.services}
        self.airflow = urls["airflow"]
        self.mlflow = urls["mlflow"]
        self.serve = urls["serve"]
        self.password = json.loads(Path(state.airflow_password_file).read_text())["admin"]
        status, answer = request_json(
            "POST", f"{self.airflow}/auth/token", {"username": "admin", "password": self.password}
        )
        assert status == 201, answer
        self.token = answer["access_token"]
        # Set by the sweep test once its run succeeded: what the browser tests look for.
        self.sweep: dict[str, str] = {}

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return request_json(method, f"{self.airflow}/api/v2{path}", body, self.token)

    def dag_runs(self) -> list[dict[str, Any]]:
        status, answer = self.api("GET", f"/dags/{DAG_ID}/dagRuns")
        assert status == 200, answer
        return list(answer["dag_runs"])


def _wait_for_run(s: Stack, run_id: str, timeout_s: float = 420, dag_id: str = DAG_ID) -> dict[str, Any]:
    """Wait until a run of ``dag_id`` succeeds; fail with the failed tasks' logs otherwise."""
    quoted = urllib.parse.quote(run_id, safe="")
    deadline = time.monotonic() + timeout_s
    while True:
        status, run = s.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}")
        assert status == 200, run
        if run["state"] in ("success", "failed"):
            break
        assert time.monotonic() < deadline, f"run {run_id} still {run['state']} after {timeout_s} s"
        time.sleep(3)
    _, tis = s.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}/taskInstances")
    states = {t["task_id"]: t["state"] for t in tis["task_instances"]}
    assert run["state"] == "success", f"{states}\n{_failed_task_logs(s.home, states)}"
    assert set(states.values()) == {"success"}, states
    return dict(run)


def _task_log_records(home: Path, run_id: str, task_id: str) -> list[dict[str, Any]]:
    """The JSON records of one task's log files (Airflow 3 writes one JSON object per line)."""
    records = []
    for path in (home / "airflow" / "logs").rglob("*.log"):
        if f"run_id={run_id}" in str(path) and f"task_id={task_id}/" in str(path):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    return records


def _failed_task_logs(home: Path, states: dict[str, str]) -> str:
    """The last lines of the failed tasks' logs, for the assertion message."""
    failed = [task for task, state in states.items() if state not in ("success", "skipped")]
    logs = sorted((home / "airflow" / "logs").rglob("*.log"))
    tails = [
        f"--- {p}\n{p.read_text(errors='replace')[-2500:]}"
        for p in logs
        if any(f"task_id={t}/" in str(p) for t in failed)
    ]
    return "\n".join(tails[-3:])


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("stack") / "home"
    proc = _mopflow(home, "up")
    try:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert "mopflow stack is up" in proc.stdout
        yield Stack(home)
    finally:
        down = _mopflow(home, "down", timeout=120)
        assert down.returncode == 0, down.stderr[-3000:]


@pytest.mark.slow
def test_up_prints_urls_and_a_second_up_starts_nothing(running_stack: Stack) -> None:
    before = {s.name: s.pid for s in running_stack.state.services}
    assert set(before) == set(stack.SERVICE_ORDER)
    again = _mopflow(running_stack.home, "up")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already runs" in again.stdout and "nothing started" in again.stdout
    state = stack.read_state(stack.state_path(running_stack.home))
    assert state is not None and {s.name: s.pid for s in state.services} == before
    status = _mopflow(running_stack.home, "status", timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    for name in stack.SERVICE_ORDER:
        assert any(line.startswith(name) and " healthy " in line for line in status.stdout.splitlines()), name
    # Everything answers on loopback, and the Airflow API wants a token.
    code, _ = request_json("GET", f"{running_stack.airflow}/api/v2/dags")
    assert code == 401
    assert os.stat(running_stack.state.airflow_password_file).st_mode & 0o777 == 0o600
    status_code, pools = running_stack.api("GET", f"/pools/{TRAINING_POOL}")
    assert status_code == 200 and pools["slots"] == 1


@pytest.mark.slow
def test_sweep_triggered_over_rest_registers_a_champion(running_stack: Stack) -> None:
    s = running_stack
    deadline = time.monotonic() + 120
    while (found := s.api("GET", f"/dags/{DAG_ID}"))[0] != 200:  # the dag-processor parses at start
        assert time.monotonic() < deadline, f"{DAG_ID} never appeared: {found}"
        time.sleep(2)
    assert s.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
    _wait_for_dag(s, RETRAIN_DAG_ID)  # unpaused before the sweep: its new shards will start a retrain
    assert s.api("PATCH", f"/dags/{RETRAIN_DAG_ID}", {"is_paused": False})[0] == 200
    status, run = s.api("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": TINY})
    assert status == 200, run
    run = _wait_for_run(s, run["dag_run_id"])
    # MLflow's INFO messages reach the task log as info, not as stderr lines at level error.
    records = _task_log_records(s.home, run["dag_run_id"], "register")
    created = [r for r in records if "Created version" in str(r.get("event", ""))]
    assert created and {r.get("level") for r in created} == {"info"}, created or records[-20:]

    name = f"{TINY['model_name']}-student"
    # The version this sweep registered, from its own register log: the retrain its new shards
    # start may register the next one, and move the aliases, while this test reads them.
    events = [str(r.get("event", "")) for r in created]
    made = next(
        (m for e in events if (m := re.search(rf"Created version '(\d+)' of model '{name}'", e))), None
    )
    assert made is not None, events
    query = urllib.parse.urlencode({"name": name, "version": made.group(1)})
    status, answer = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/model-versions/get?{query}")
    assert status == 200, answer
    version = answer["model_version"]
    assert version["name"] == name
    # The champion and the challenger are the same version once no registration is half done:
    # this sweep's, or a later one's (the retrain's).
    deadline = time.monotonic() + 120
    while True:
        status, model = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/registered-models/get?name={name}")
        assert status == 200, model
        aliases = {a["alias"]: a["version"] for a in model["registered_model"].get("aliases", [])}
        if aliases.get("champion") is not None and aliases.get("champion") == aliases.get("challenger"):
            break
        assert time.monotonic() < deadline, aliases
        time.sleep(1)
    assert int(aliases["champion"]) >= int(version["version"]), (aliases, version["version"])
    # The tasks logged to the stack's server: the run that produced the version is there too.
    status, mlrun = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/runs/get?run_id={version['run_id']}")
    assert status == 200 and mlrun["run"]["data"], mlrun
    s.sweep = {"airflow_run_id": run["dag_run_id"], "model": name, "version": made.group(1)}


def _serve_version(s: Stack) -> str | None:
    """The version `mopflow serve` in the stack serves (None: no champion yet)."""
    status, health = request_json("GET", f"{s.serve}/health")
    assert status == 200, health
    return health["version"]


@pytest.mark.slow
def test_new_shards_start_a_retrain_that_registers_a_version_the_server_then_serves(
    running_stack: Stack,
) -> None:
    s = running_stack
    sweep = _finished_sweep(s)
    deadline = time.monotonic() + 120
    while not (runs := _run_ids(s, RETRAIN_DAG_ID)):  # the scheduler turns the event into a run
        assert time.monotonic() < deadline, "no mopflow_retrain run followed the sweep's new shards"
        time.sleep(2)
    assert len(runs) == 1, runs  # one event, one run (the retrain publishes none of its own)
    run_id = runs.pop()
    run = _wait_for_run(s, run_id, timeout_s=600, dag_id=RETRAIN_DAG_ID)
    assert run["run_type"] == "asset_triggered", run
    # It trained on the sweep's data and registered the sweep's model, with its own small search.
    model = sweep["model"]
    query = urllib.parse.urlencode({"filter": f"name='{model}'"})
    status, answer = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/model-versions/search?{query}")
    assert status == 200, answer
    versions = sorted(int(v["version"]) for v in answer["model_versions"])
    assert versions == [int(sweep["version"]), int(sweep["version"]) + 1], versions
    query = urllib.parse.urlencode({"name": model, "alias": "champion"})
    status, alias = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/registered-models/alias?{query}")
    assert status == 200 and alias["model_version"]["version"] == str(versions[-1]), alias
    # The stack's champion server follows the alias to the new version and answers with it.
    deadline = time.monotonic() + 120
    while _serve_version(s) != str(versions[-1]):
        assert time.monotonic() < deadline, f"mopflow serve still serves {_serve_version(s)}"
        time.sleep(2)
    with urllib.request.urlopen(f"{s.serve}/ping", timeout=10) as response:
        assert response.status == 200 and response.headers["X-Model-Version"] == str(versions[-1])
    status_out = _mopflow(s.home, "status", timeout=120)
    assert f"{model} v{versions[-1]}" in status_out.stdout, status_out.stdout
    s.sweep["version"] = str(versions[-1])  # the champion the MLflow UI test looks for


# ---------------------------------------------------------------------------- the UIs in a browser (slow)

CHROMIUM = os.environ.get("MOPFLOW_CHROMIUM", "/usr/bin/chromium")  # Debian's; never a downloaded one
UI_TIMEOUT_MS = 90_000  # a busy 2-core machine renders the React UIs slowly; locators wait, no sleeps


def _artifacts_dir() -> Path:
    """Where the screenshots go: $MOPFLOW_TEST_ARTIFACTS, else tests/artifacts (git-ignored)."""
    folder = Path(os.environ.get("MOPFLOW_TEST_ARTIFACTS") or REPO / "tests" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _require_browser() -> None:
    """Skip without Chromium or Playwright, or fail under MOPFLOW_REQUIRE_SERVICES=1 (CI)."""
    import importlib.util

    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"chromium at {CHROMIUM} (apt-get install chromium; `make test` does it)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package (the dev extra)")
    if not missing:
        return
    skip_unless_required("browser test needs " + " and ".join(missing))


@pytest.fixture(scope="module")
def airflow_page(running_stack: Stack) -> Iterator[Any]:
    """A headless Chromium page logged in to the stack's Airflow UI (the simple auth manager's form)."""
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.set_default_timeout(UI_TIMEOUT_MS)
            page = context.new_page()
            page.goto(f"{running_stack.airflow}/dags")
            try:
                page.get_by_label("Username").fill("admin")
                page.get_by_label("Password").fill(running_stack.password)
                page.get_by_role("button", name="Sign in").click()
                page.wait_for_url("**/dags")
            except Exception:
                _screenshot(page, "airflow-login")
                raise
            yield page
        finally:
            browser.close()


def _screenshot(page: Any, name: str) -> Path:
    path = _artifacts_dir() / f"stack-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")  # shown with -rA or on failure
    return path


def _finished_sweep(s: Stack) -> dict[str, str]:
    if not s.sweep:
        pytest.skip(
            "needs the sweep of test_sweep_triggered_over_rest_registers_a_champion (it failed or was deselected)"
        )
    return s.sweep


def _open_trigger_form(page: Any, airflow: str) -> Any:
    from playwright.sync_api import expect

    page.goto(f"{airflow}/dags/{DAG_ID}")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_text(f"Trigger Dag - {DAG_ID}")).to_be_visible()
    expect(dialog.get_by_text("Run Parameters")).to_be_visible()
    # The DAG is paused: the form offers to unpause it on trigger (checked). Unchecked, the run
    # it creates waits, and only its conf is checked.
    unpause = dialog.get_by_text(f"Unpause {DAG_ID} on trigger")
    expect(unpause).to_be_visible()
    unpause.click()
    return dialog


def _submit_trigger_form(s: Stack, page: Any, dialog: Any, shot: str) -> str:
    """Click the form's Trigger button (it must be enabled) and return the new run's id."""
    from playwright.sync_api import expect

    before = _run_ids(s, DAG_ID)
    button = dialog.get_by_role("button", name="Trigger", exact=True)
    try:
        expect(button).to_be_enabled()
        button.click()
        expect(page.get_by_text("Dag Run Triggered").first).to_be_visible()  # maybe an earlier one too
    finally:
        _screenshot(page, shot)
    deadline = time.monotonic() + 60
    while not (new := _run_ids(s, DAG_ID) - before):
        assert time.monotonic() < deadline, "the trigger form created no run"
        time.sleep(1)
    assert len(new) == 1, new
    return new.pop()


# What each form sends: the tiny sweep under other model names.
FORM_TINY = {**TINY, "model_name": "form"}
JSON_TINY = {**TINY, "model_name": "json"}


@pytest.mark.slow
def test_browser_trigger_form_sends_the_conf_of_its_inputs_and_its_json(
    running_stack: Stack, airflow_page: Any
) -> None:
    """The trigger form, filled in field by field and as JSON, creates a run whose conf is what
    was typed. The DAG stays paused: the runs wait and are deleted, nothing trains."""
    import re

    from playwright.sync_api import expect

    s, page = running_stack, airflow_page
    _wait_for_dag(s, DAG_ID)
    assert s.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": True})[0] == 200
    page.set_viewport_size({"width": 1400, "height": 2400})  # the modal's params on one screenshot
    runs: list[str] = []
    try:
        dialog = _open_trigger_form(page, s.airflow)
        # Each Param shows its key as the label and the config field's description under it.
        for key, description in (
            ("strategy", "task: a trial per worker; ddp: each trial on W DDP processes"),
            ("n_trials", "Number of trials to finish"),
            ("sampler", "Optuna sampler, seeded: tpe, random, grid"),
            ("promotion", "champion if test accuracy"),
        ):
            label = page.locator("label").filter(has_text=re.compile(rf"^{key}\s*\*?$"))  # * = required
            expect(dialog.locator(label)).to_be_visible()
            expect(dialog.get_by_role("group").filter(has=label)).to_contain_text(description)
        expect(dialog.get_by_role("combobox", name="strategy", exact=True)).to_be_visible()
        expect(dialog.get_by_role("spinbutton", name="n_trials", exact=True)).to_have_value("20")  # default
        # With the defaults as they are the form can be submitted (no empty required field).
        expect(dialog.get_by_role("button", name="Trigger", exact=True)).to_be_enabled()
        _screenshot(page, "trigger-form")

        # 1. The form's own inputs: the first section, then the "Advanced" section.
        for key in ("n_trials", "epochs", "top_k"):
            dialog.get_by_role("spinbutton", name=key, exact=True).fill(str(FORM_TINY[key]))
        dialog.get_by_role("button", name="Advanced", exact=True).click()
        for key in ("num_samples", "n_shards", "distill_epochs", "munge_multiplier"):
            dialog.get_by_role("spinbutton", name=key, exact=True).fill(str(FORM_TINY[key]))
        # min_resource may be empty (its default): a text field whose JSON value must be an integer
        min_resource = page.locator("label").filter(has_text=re.compile(r"^min_resource\s*\*?$"))
        dialog.get_by_role("group").filter(has=min_resource).locator("input, textarea").first.fill(
            str(FORM_TINY["min_resource"])
        )
        dialog.get_by_role("spinbutton", name="max_gap_to_ensemble", exact=True).fill("100")
        model_name = page.locator("label").filter(has_text=re.compile(r"^model_name\s*\*?$"))
        dialog.get_by_role("group").filter(has=model_name).locator("input").fill(FORM_TINY["model_name"])
        runs.append(_submit_trigger_form(s, page, dialog, "trigger-form-inputs"))

        # 2. Airflow's "Advanced Options": the run's conf typed as JSON.
        dialog = _open_trigger_form(page, s.airflow)
        dialog.get_by_role("button", name="Advanced Options").click()
        editor = dialog.locator(".monaco-editor").first
        editor.click()
        page.keyboard.press("ControlOrMeta+a")
        page.keyboard.insert_text(json.dumps(JSON_TINY))
        # The editor may add closing quotes or brackets after the cursor: drop whatever follows.
        page.keyboard.press("Shift+ControlOrMeta+End")
        page.keyboard.press("Delete")
        expect(dialog.get_by_text("Invalid JSON format")).to_have_count(0)
        runs.append(_submit_trigger_form(s, page, dialog, "trigger-form-json"))

        status, dag = s.api("GET", f"/dags/{DAG_ID}")
        assert status == 200 and dag["is_paused"] is True, "the form unpaused the DAG"
        for run_id, conf in zip(runs, (FORM_TINY, JSON_TINY), strict=True):
            status, run = s.api("GET", f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}")
            assert status == 200 and run["state"] == "queued", run
            assert {k: run["conf"][k] for k in conf} == conf, run["conf"]
            assert run["conf"].get("worker_schedule") in (None, "")
            assert run["conf"].get("spot_trace") in (None, "")
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})
        for run_id in runs:  # nothing of them is left to start later
            s.api("DELETE", f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}")


FIGURE_KINDS = ("optimization-history", "learning-curves", "param-importances")
# Resolves with the image's width once it has loaded and decoded; rejects when it cannot be shown.
LOADED_WIDTH = "img => img.decode().then(() => img.naturalWidth)"


def _figures_loaded(section: Any) -> dict[str, int]:
    """Each figure image of a sweep's section: its loaded width (0 or an error: not shown)."""
    from playwright.sync_api import expect

    widths = {}
    for kind in FIGURE_KINDS:
        img = section.locator(f'img.search-figure[data-kind="{kind}"]')
        expect(img).to_have_count(1)
        widths[kind] = img.evaluate(LOADED_WIDTH)
    return widths


@pytest.mark.slow
def test_browser_sweeps_page_shows_the_leaderboard(running_stack: Stack, airflow_page: Any) -> None:
    import re

    from playwright.sync_api import expect

    s, page = running_stack, airflow_page
    sweep = _finished_sweep(s)
    try:
        page.goto(f"{s.airflow}/plugin/mopflow-sweeps")  # the nav item: the plugin page in an iframe
        frame = page.frame_locator("iframe")
        expect(frame.get_by_role("heading", name="Sweeps", exact=True)).to_be_visible()
        section = frame.locator("section.sweep").filter(has_text=f"{DAG_ID} · {sweep['airflow_run_id']}")
        expect(section).to_have_count(1)
        expect(section.locator("p.meta")).to_contain_text("status FINISHED")
        expect(section.locator("p.meta")).to_contain_text("strategy task")
        rows = section.locator("table.leaderboard tr:has(td)")
        expect(rows.first).to_be_visible()
        assert rows.count() >= int(TINY["n_trials"])
        accuracies = [float(a) for a in rows.locator("td:nth-child(3)").all_inner_texts() if a != "-"]
        assert accuracies and all(0.0 <= a <= 1.0 for a in accuracies), accuracies
        assert accuracies[0] == max(accuracies)  # best first
        assert "COMPLETE" in rows.locator("td:nth-child(2)").all_inner_texts()
        mlflow_href = section.get_by_role("link", name="MLflow run").get_attribute("href") or ""
        optuna_href = section.get_by_role("link", name="optuna-dashboard").get_attribute("href") or ""
        # The search's three figures beside the leaderboard, drawn from the Optuna storage.
        widths = _figures_loaded(section)
        assert all(w > 0 for w in widths.values()), widths
        expect(section.locator("p.figure-skipped")).to_have_count(0)
        section.locator("div.figures").scroll_into_view_if_needed()
        section.screenshot(path=str(_artifacts_dir() / "stack-sweeps-figures.png"))
        # A running sweep's section is fetched again: marked live, this one is swapped for a fresh
        # copy (no longer live: the run has finished) whose figures load anew through the session.
        section_id = section.get_attribute("id")
        swapped = section.evaluate(
            "el => { el.setAttribute('data-live', ''); return window.mopflowRefresh(); }"
        )
        assert swapped >= 1
        expect(section.locator("img.search-figure[src*='?at=']")).to_have_count(len(FIGURE_KINDS))
        expect(frame.locator(f"section#{section_id}[data-live]")).to_have_count(0)
        widths = _figures_loaded(section)
        assert all(w > 0 for w in widths.values()), widths
    finally:
        _screenshot(page, "sweeps-page")
    link = re.fullmatch(re.escape(s.mlflow) + r"/#/experiments/(\d+)/runs/([0-9a-f]{32})", mlflow_href)
    assert link, mlflow_href
    # The link leads to this sweep's pipeline run in the stack's MLflow.
    status, mlrun = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/runs/get?run_id={link.group(2)}")
    assert status == 200, mlrun
    tags = {t["key"]: t["value"] for t in mlrun["run"]["data"]["tags"]}
    assert tags["mopflow.airflow_run_id"] == sweep["airflow_run_id"], tags
    optuna = next(r.url for r in s.state.services if r.name == "optuna-dashboard")
    assert re.fullmatch(re.escape(optuna) + r"/dashboard/studies/\d+", optuna_href), optuna_href
    # The search stage logged the same figures to its MLflow run.
    where = f"tags.`mopflow.stage` = 'search' and tags.`mopflow.airflow_run_id` = '{sweep['airflow_run_id']}'"
    body = {"experiment_ids": [link.group(1)], "filter": where}
    status, found = request_json("POST", f"{s.mlflow}/api/2.0/mlflow/runs/search", body)
    assert status == 200 and len(found.get("runs", [])) == 1, found
    query = urllib.parse.urlencode({"run_id": found["runs"][0]["info"]["run_id"], "path": "figures"})
    status, listed = request_json("GET", f"{s.mlflow}/api/2.0/mlflow/artifacts/list?{query}")
    assert status == 200, listed
    sizes = {f["path"]: int(f.get("file_size", 0)) for f in listed.get("files", [])}
    assert {f"figures/{kind}.png" for kind in FIGURE_KINDS} <= set(sizes), sizes
    assert all(sizes[f"figures/{kind}.png"] > 10_000 for kind in FIGURE_KINDS), sizes
    # The page follows Airflow's theme: light and dark, each with its screenshot.
    backgrounds = _sweeps_page_in_light_and_dark(page, f"{s.airflow}/plugin/mopflow-sweeps")
    assert backgrounds["light"] != backgrounds["dark"], backgrounds


# The colour mode of Airflow's UI: the class next-themes puts on its <html> (none: the system's).
UI_MODE = "el => ['dark', 'light'].find(m => el.classList.contains(m)) || null"


def _sweeps_page_in_light_and_dark(page: Any, url: str) -> dict[str, str]:
    """The Sweeps page's background colour in each mode, screenshots ``stack-sweeps-<mode>.png``.
    The browser's preference sets the mode of Airflow's UI (it follows the system's until a user
    picks one), and the page inside it must take the UI's mode."""
    from playwright.sync_api import expect

    seen = {}
    try:
        for scheme in ("light", "dark"):
            page.emulate_media(color_scheme=scheme)
            page.goto(url)
            frame = page.frame_locator("iframe")
            expect(frame.get_by_role("heading", name="Sweeps", exact=True)).to_be_visible()
            ui_mode = page.locator("html").evaluate(UI_MODE)
            if ui_mode:  # the page reads it from its parent (same origin)
                expect(frame.locator("html")).to_have_attribute("data-theme", ui_mode)
            seen[scheme] = frame.locator("body").evaluate("el => getComputedStyle(el).backgroundColor")
            _screenshot(page, f"sweeps-{scheme}")
    finally:
        page.emulate_media(color_scheme="null")  # the later tests see the browser's own preference
    return seen


@pytest.mark.slow
def test_browser_mlflow_shows_the_champion_version(running_stack: Stack, airflow_page: Any) -> None:
    from playwright.sync_api import expect

    s = running_stack
    sweep = _finished_sweep(s)
    page = airflow_page.context.new_page()  # MLflow has no login here (mopflow up without --auth)
    page.set_viewport_size(
        {"width": 1800, "height": 1000}
    )  # room for the versions table beside the assistant
    try:
        page.goto(f"{s.mlflow}/#/models/{sweep['model']}")
        expect(page.get_by_role("heading", name=sweep["model"])).to_be_visible()
        version = page.get_by_role("link", name=f"Version {sweep['version']}")
        expect(version).to_be_visible()
        row = page.get_by_role("row").filter(has=version)
        expect(row).to_contain_text("champion")
        expect(row).to_contain_text("challenger")
    finally:
        _screenshot(page, "mlflow-model")
        page.close()


def _wait_for_dag(s: Stack, dag_id: str) -> None:
    deadline = time.monotonic() + 120
    while s.api("GET", f"/dags/{dag_id}")[0] != 200:  # the dag-processor parses at start
        assert time.monotonic() < deadline, f"{dag_id} never appeared"
        time.sleep(2)


def _run_ids(s: Stack, dag_id: str) -> set[str]:
    status, answer = s.api("GET", f"/dags/{dag_id}/dagRuns")
    assert status == 200, answer
    return {r["dag_run_id"] for r in answer["dag_runs"]}


# Each bad conf is refused at trigger time by the api-server (Airflow's Param schemas, and the mopflow
# plugin's trigger guard for unknown keys, size and the whole pipeline config), and no run exists.
BAD_CONFS = [
    pytest.param({"epochs": -3}, 400, ["epochs", "-3"], id="out-of-range"),
    pytest.param({"strategy": "bogus"}, 400, ["strategy", "bogus"], id="not-in-enum"),
    pytest.param({"n_trials": "many"}, 400, ["n_trials", "many"], id="wrong-type"),
    pytest.param(
        {"n_trails": 5},
        400,
        ["unknown conf key(s) ['n_trails']", "the accepted keys are", "'n_trials'", "'top_k'"],
        id="unknown-key",
    ),
    pytest.param({"n_trials": 2, "top_k": 4}, 400, ["top_k=4 is larger than n_trials=2"], id="cross-key"),
    pytest.param(
        {"dataset": "../../../../etc/passwd"},
        400,
        ["dataset='../../../../etc/passwd' outside the data roots", "MOPFLOW_DATA_ROOTS"],
        id="dataset-outside-the-data-roots",
    ),
    pytest.param(
        {"dataset": "file:///etc/shadow"},
        400,
        ["dataset='file:///etc/shadow' outside the data roots"],
        id="file-url",
    ),
    pytest.param(
        {"search_space": "x" * 140_000},
        413,
        ["bytes; the limit is 131072 bytes", "[mopflow] max_conf_bytes", "AIRFLOW__MOPFLOW__MAX_CONF_BYTES"],
        id="oversized",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("conf", "status", "needles"), BAD_CONFS)
def test_bad_conf_is_refused_at_trigger_time_and_creates_no_run(
    running_stack: Stack, conf: dict[str, Any], status: int, needles: list[str]
) -> None:
    s = running_stack
    _wait_for_dag(s, DAG_ID)
    before = _run_ids(s, DAG_ID)
    code, answer = s.api("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": {**TINY, **conf}})
    assert code == status, (code, str(answer)[:2000])
    for needle in needles:
        assert needle in json.dumps(answer) or needle in str(answer), (needle, str(answer)[:2000])
    assert _run_ids(s, DAG_ID) == before


def _airflow_cli(s: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``airflow`` command on the stack's host, with the stack's Airflow settings: it reaches
    the metadata DB directly, not through the api-server and its trigger guard."""
    from mopflow.base.settings import Settings
    from mopflow.infra.stack.environment import airflow_env, mopflow_env

    env = _env(s.home)
    settings = Settings.from_env(env)
    env |= mopflow_env(settings, s.state.ports) | airflow_env(settings.airflow_home, env, BIN, s.state.ports)
    return subprocess.run(
        [str(Path(BIN) / "airflow"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_run_triggered_past_the_api_server_is_refused_its_data_outside_the_roots(
    running_stack: Stack, tmp_path: Path
) -> None:
    """`airflow dags trigger` on the scheduler's host skips the api-server's trigger guard; the
    shard task still refuses a dataset outside the data roots, at once (no retry), before reading
    it, and nothing is sharded."""
    s = running_stack
    _wait_for_dag(s, DAG_ID)
    outside = tmp_path / "elsewhere" / "table.csv"  # not under the stack's data root
    outside.parent.mkdir()
    outside.write_text("x0,label\n0.5,0\n0.7,1\n")
    datasets = s.home / "data" / "datasets"
    before = sorted(datasets.iterdir()) if datasets.exists() else []
    run_id = f"cli__outside_{time.monotonic_ns()}"
    conf = {**TINY, "dataset": str(outside), "label_column": "label"}
    paused = s.api("GET", f"/dags/{DAG_ID}")[1]["is_paused"]  # as other tests of the stack left it
    assert s.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
    try:
        triggered = _airflow_cli(s, "dags", "trigger", DAG_ID, "--run-id", run_id, "--conf", json.dumps(conf))
        assert triggered.returncode == 0, triggered.stdout[-2000:] + triggered.stderr[-3000:]
        quoted = urllib.parse.quote(run_id, safe="")
        deadline = time.monotonic() + 300
        while True:
            status, run = s.api("GET", f"/dags/{DAG_ID}/dagRuns/{quoted}")
            assert status == 200, run
            if run["state"] in ("success", "failed"):
                break
            assert time.monotonic() < deadline, f"run {run_id} still {run['state']}"
            time.sleep(3)
    finally:
        assert s.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": paused})[0] == 200
    _, tis = s.api("GET", f"/dags/{DAG_ID}/dagRuns/{quoted}/taskInstances")
    shard = next(t for t in tis["task_instances"] if t["task_id"] == "shard")
    assert run["state"] == "failed" and shard["state"] == "failed" and shard["try_number"] == 1, shard
    logged = json.dumps(_task_log_records(s.home, run_id, "shard"))
    assert "outside the data roots" in logged and str(outside) in logged, logged[-3000:]
    assert (sorted(datasets.iterdir()) if datasets.exists() else []) == before  # nothing sharded


def _post_raw(url: str, body: bytes, token: str | None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1_000, 10_000, 1_000_000])
def test_a_deeply_nested_conf_gets_a_4xx_and_the_api_server_still_answers(
    running_stack: Stack, depth: int
) -> None:
    s = running_stack
    _wait_for_dag(s, DAG_ID)
    before = _run_ids(s, DAG_ID)
    body = b'{"logical_date": null, "conf": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    url = f"{s.airflow}/api/v2/dags/{DAG_ID}/dagRuns"
    code, answer = _post_raw(url, body, None)
    assert code == 401, (code, answer)  # the caller is checked before the body is read
    code, answer = _post_raw(url, body, s.token)
    if len(body) > 4 * 131072:  # the guard reads at most 4 x [mopflow] max_conf_bytes
        assert code == 413 and "the request body is" in answer["detail"], (code, answer)
    else:
        assert code == 400 and f"{depth + 1} levels deep; the limit is 32 levels" in answer["detail"], (
            code,
            answer,
        )
    assert _run_ids(s, DAG_ID) == before
    assert s.api("GET", f"/dags/{DAG_ID}")[0] == 200  # the api-server still answers


@pytest.mark.slow
def test_trigger_guard_covers_the_ui_call_other_dags_and_backfills(running_stack: Stack) -> None:
    s = running_stack
    _wait_for_dag(s, DAG_ID)
    before = _run_ids(s, DAG_ID)
    body = {"logical_date": None, "conf": {**TINY, "bogus": 1}}
    # The UI's trigger form: the same endpoint, with the session cookie and a Referer.
    ui_headers = {"Cookie": f"_token={s.token}", "Referer": f"{s.airflow}/dags/{DAG_ID}"}
    code, answer = request_json("POST", f"{s.airflow}/api/v2/dags/{DAG_ID}/dagRuns", body, headers=ui_headers)
    assert code == 400 and "['bogus']" in answer["detail"], (code, answer)
    # No credentials: Airflow's own 401, nothing about the DAG's keys.
    code, answer = request_json("POST", f"{s.airflow}/api/v2/dags/{DAG_ID}/dagRuns", body)
    assert code == 401 and "bogus" not in json.dumps(answer), (code, answer)
    assert _run_ids(s, DAG_ID) == before
    # mopflow_promote: its own Params are the accepted keys.
    _wait_for_dag(s, "mopflow_promote")
    before_promote = _run_ids(s, "mopflow_promote")
    code, answer = s.api(
        "POST",
        "/dags/mopflow_promote/dagRuns",
        {"logical_date": None, "conf": {"action": "rollback", "model": "x"}},
    )
    assert code == 400, (code, answer)
    assert "['model']; the accepted keys are ['action', 'name', 'version']" in answer["detail"]
    assert _run_ids(s, "mopflow_promote") == before_promote
    # A valid conf still triggers (the DAG stays paused: the run waits, nothing is promoted).
    code, run = s.api(
        "POST",
        "/dags/mopflow_promote/dagRuns",
        {"logical_date": None, "conf": {"action": "rollback", "name": "x"}},
    )
    assert code == 200 and run["conf"] == {"action": "rollback", "name": "x"}, (code, run)
    assert _run_ids(s, "mopflow_promote") == before_promote | {run["dag_run_id"]}
    # A backfill's dag_run_conf of the scheduled DAG.
    _wait_for_dag(s, "mopflow_retrain")
    before_retrain = _run_ids(s, "mopflow_retrain")  # the data-triggered retrain of the sweep test
    backfill = {
        "dag_id": "mopflow_retrain",
        "from_date": "2026-01-01T00:00:00Z",
        "to_date": "2026-01-20T00:00:00Z",
        "dag_run_conf": {"n_trials": 2, "bogus": 1},
    }
    code, answer = s.api("POST", "/backfills", backfill)
    assert code == 400 and "mopflow_retrain: unknown conf key(s) ['bogus']" in answer["detail"], (
        code,
        answer,
    )
    code, listed = s.api("GET", "/backfills?dag_id=mopflow_retrain")
    assert code == 200 and listed["total_entries"] == 0, listed
    assert _run_ids(s, "mopflow_retrain") == before_retrain


@pytest.mark.slow
def test_down_stops_every_service_and_frees_the_ports(running_stack: Stack) -> None:
    state = running_stack.state
    ports = [p for rec in state.services for p in rec.ports]
    assert ports and all(stack.port_answers(p) for p in (state.ports.airflow, state.ports.mlflow))
    proc = _mopflow(running_stack.home, "down", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped:" in proc.stdout and "still answer" not in proc.stdout
    assert not any(stack.port_answers(p) for p in ports)
    assert not any(is_running(rec) for rec in state.services)
    assert not stack.state_path(running_stack.home).exists()
    status = _mopflow(running_stack.home, "status", timeout=120)
    assert status.returncode == 1 and "no mopflow stack" in status.stdout
