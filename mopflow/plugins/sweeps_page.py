"""The Sweeps page's data: recent pipeline runs with their leaderboard, search figures
(``sweep_figures``) and MOP Gantt charts.

No Airflow here (the plugin in ``mopflow_plugin.py`` mounts it): :func:`load_sweeps` reads the
runs the pipeline tagged in MLflow through an injected ``MlflowClient``, :func:`ui_links` reads
the UI addresses from the environment. ``sweeps_html`` renders the data from templates.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopflow.base import tag_names as tag
from mopflow.plugins import sweep_figures

DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"
DEFAULT_OPTUNA_DASHBOARD = "http://127.0.0.1:8081"
GANTT_RE = re.compile(r"^gantt-epoch-\d{1,6}\.png$")
RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class TrialRow:
    """One leaderboard line."""

    trial: int
    state: str
    val_acc: float | None
    pruned_epoch: int | None  # 0-based, as Optuna's steps; shown from 1, as the task logs count
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Sweep:
    """One pipeline run (a search) as the page shows it."""

    run_id: str
    experiment_id: str
    dag_id: str
    airflow_run_id: str
    status: str
    start_time_ms: int | None
    strategy: str
    study: str | None
    study_id: int | None
    search_run_id: str | None
    leaderboard: Sequence[TrialRow] = ()
    leaderboard_source: str = "none"  # "leaderboard.json", "trial runs" (still running) or "none"
    gantt: Sequence[str] = ()  # artifact file names under the search run's mop/ folder
    promoted: str | None = None
    promotion_reason: str | None = None  # the gate's reason, either way
    figures: Mapping[str, str | None] = field(default_factory=dict)  # kind -> why not drawn (None: drawn)
    student_front_run_id: str | None = None  # the distill run, when it has a student search's front


@dataclass(frozen=True)
class Links:
    """Where the MLflow UI and optuna-dashboard are (http(s) URLs without a trailing slash)."""

    mlflow_ui: str = DEFAULT_MLFLOW_UI
    optuna_dashboard: str = DEFAULT_OPTUNA_DASHBOARD

    def mlflow_run(self, experiment_id: str, run_id: str) -> str:
        return f"{self.mlflow_ui}/#/experiments/{experiment_id}/runs/{run_id}"

    def optuna_study(self, study_id: int | None) -> str:
        base = f"{self.optuna_dashboard}/dashboard"
        return f"{base}/studies/{study_id}" if study_id is not None else base


@dataclass(frozen=True)
class PageData:
    """Everything the page shows."""

    sweeps: Sequence[Sweep]
    links: Links
    experiment: str
    errors: Sequence[str] = field(default_factory=tuple)


def _http_url(value: str, what: str) -> str:
    value = value.strip().rstrip("/")
    if not re.match(r"^https?://[^\s\"'<>]+$", value):
        raise ValueError(f"{what}={value!r} must be an http(s) URL, e.g. http://127.0.0.1:5000")
    return value


def ui_links(environ: Mapping[str, str] | None = None) -> Links:
    """UI addresses: ``MOPFLOW_MLFLOW_UI_URL`` / ``MOPFLOW_OPTUNA_DASHBOARD_URL``, else derived from the
    stack (an http tracking URI is the MLflow server, which serves the UI; ``MOPFLOW_MLFLOW_PORT`` /
    ``MOPFLOW_OPTUNA_PORT``), else 127.0.0.1:5000 and :8081."""
    env = os.environ if environ is None else environ
    mlflow = env.get("MOPFLOW_MLFLOW_UI_URL", "")
    if not mlflow:
        tracking = env.get("MOPFLOW_TRACKING_URI", "")
        if tracking.startswith(("http://", "https://")):
            mlflow = tracking
        elif env.get("MOPFLOW_MLFLOW_PORT"):
            mlflow = f"http://127.0.0.1:{int(env['MOPFLOW_MLFLOW_PORT'])}"
    optuna = env.get("MOPFLOW_OPTUNA_DASHBOARD_URL", "")
    if not optuna and env.get("MOPFLOW_OPTUNA_PORT"):
        optuna = f"http://127.0.0.1:{int(env['MOPFLOW_OPTUNA_PORT'])}"
    return Links(
        _http_url(mlflow or DEFAULT_MLFLOW_UI, "MOPFLOW_MLFLOW_UI_URL"),
        _http_url(optuna or DEFAULT_OPTUNA_DASHBOARD, "MOPFLOW_OPTUNA_DASHBOARD_URL"),
    )


# --- reading MLflow (the edge) ------------------------------------------------------------------


def _leaderboard_from_json(rows: Sequence[Mapping[str, Any]]) -> list[TrialRow]:
    out = []
    for row in rows:
        pruned = row.get("pruned_epoch")
        value = row.get("val_acc")
        out.append(
            TrialRow(
                trial=int(row["trial"]),
                state=str(row.get("state", "")),
                val_acc=float(value) if value is not None else None,
                pruned_epoch=int(pruned) if pruned is not None else None,
                params=dict(row.get("params") or {}),
            )
        )
    return out


def _leaderboard_from_trial_runs(runs: Sequence[Any]) -> list[TrialRow]:
    """While the search runs there is no leaderboard.json yet: build it from the trial runs."""
    rows = []
    for run in runs:
        metrics, tags = run.data.metrics, run.data.tags
        pruned = metrics.get("pruned_epoch")
        rows.append(
            TrialRow(
                trial=int(tags.get(tag.TRIAL, -1)),
                state=str(tags.get(tag.TRIAL_STATE, run.info.status)),
                val_acc=metrics.get("val_acc"),
                pruned_epoch=int(pruned) if pruned is not None else None,
                params=dict(run.data.params),
            )
        )
    return sorted(rows, key=lambda r: (-(r.val_acc if r.val_acc is not None else -1.0), r.trial))


def _quote(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("'", "\\'")


def _find(client: Any, experiment_id: str, tags: Mapping[str, str], max_results: int = 1000) -> list[Any]:
    clauses = " and ".join(f"tags.`{k}` = '{_quote(v)}'" for k, v in tags.items())
    return list(client.search_runs([experiment_id], filter_string=clauses, max_results=max_results))


def load_sweeps(
    client: Any,
    experiment_name: str,
    limit: int = 10,
    dag_id: str | None = None,
    study_ids: Mapping[str, int] | None = None,
) -> list[Sweep]:
    """The ``limit`` most recent pipeline runs (of ``dag_id``, or of every DAG), newest first."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return []
    exp_id = str(experiment.experiment_id)
    # Every pipeline run is a search; MLflow filters have no OR, so one DAG or all of them.
    where = f"tags.`{tag.STAGE}` = 'pipeline'"
    if dag_id:
        where += f" and tags.`{tag.DAG_ID}` = '{_quote(dag_id)}'"
    parents = client.search_runs(
        [exp_id],
        filter_string=where,
        order_by=["attributes.start_time DESC"],
        max_results=limit,
    )
    sweeps = []
    for parent in parents:
        tags = parent.data.tags
        key = tags.get(tag.RUN_KEY, "")
        search_runs = _find(client, exp_id, {tag.RUN_KEY: key, tag.STAGE: "search"}, 1)
        search = search_runs[0] if search_runs else None
        study = search.data.tags.get(tag.STUDY) if search else None
        leaderboard: list[TrialRow] = []
        source = "none"
        gantt: list[str] = []
        if search is not None:
            artifacts = {a.path for a in client.list_artifacts(search.info.run_id)}
            if "leaderboard.json" in artifacts:
                with tempfile.TemporaryDirectory() as tmp:
                    local = client.download_artifacts(search.info.run_id, "leaderboard.json", tmp)
                    leaderboard = _leaderboard_from_json(json.loads(Path(local).read_text()))
                source = "leaderboard.json"
            else:
                trials = _find(client, exp_id, {tag.RUN_KEY: key, tag.STAGE: "trial"})
                leaderboard = _leaderboard_from_trial_runs(trials)
                source = "trial runs" if trials else "none"
            if "mop" in artifacts:
                gantt = sorted(
                    Path(a.path).name
                    for a in client.list_artifacts(search.info.run_id, "mop")
                    if GANTT_RE.match(Path(a.path).name)
                )
        register = _find(client, exp_id, {tag.RUN_KEY: key, tag.STAGE: "register"}, 1)
        distill = _find(client, exp_id, {tag.RUN_KEY: key, tag.STAGE: "distill"}, 1)
        sweeps.append(
            Sweep(
                run_id=parent.info.run_id,
                experiment_id=exp_id,
                dag_id=tags.get(tag.DAG_ID, ""),
                airflow_run_id=tags.get(tag.AIRFLOW_RUN_ID, ""),
                status=str(parent.info.status),
                start_time_ms=parent.info.start_time,
                strategy=parent.data.params.get("strategy", ""),
                study=study,
                study_id=(study_ids or {}).get(study) if study else None,
                search_run_id=search.info.run_id if search else None,
                leaderboard=leaderboard,
                leaderboard_source=source,
                gantt=gantt,
                promoted=register[0].data.tags.get(tag.PROMOTED) if register else None,
                promotion_reason=register[0].data.tags.get(tag.PROMOTION_REASON) if register else None,
                student_front_run_id=_with_student_front(client, distill[0]) if distill else None,
            )
        )
    return sweeps


def optuna_study_ids(storage_url: str) -> dict[str, int]:
    """Study name -> id in the Optuna storage (the ids optuna-dashboard puts in its URLs)."""
    storage = sweep_figures.storage(storage_url)
    return {s.study_name: storage.get_study_id_from_name(s.study_name) for s in storage.get_all_studies()}


STUDENT_FRONT = "student_search/pareto_front.png"  # the distill stage's figure of a student search


def _with_student_front(client: Any, distill: Any) -> str | None:
    """The distill run's id when it logged a student search's Pareto front."""
    run_id = str(distill.info.run_id)
    names = {a.path for a in client.list_artifacts(run_id, STUDENT_FRONT.split("/")[0])}
    return run_id if STUDENT_FRONT in names else None


def download_student_front(client: Any, run_id: str) -> bytes:
    """The Pareto front PNG of a distill run's student search; refuses anything but a run id."""
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} is not an MLflow run id (32 hex digits)")
    with tempfile.TemporaryDirectory() as tmp:
        return Path(client.download_artifacts(run_id, STUDENT_FRONT, tmp)).read_bytes()


def download_gantt(client: Any, run_id: str, name: str) -> bytes:
    """One Gantt PNG of a search run; refuses anything but a run id and a ``gantt-epoch-N.png`` name."""
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} is not an MLflow run id (32 hex digits)")
    if not GANTT_RE.match(name):
        raise ValueError(f"artifact {name!r} is not a Gantt chart (gantt-epoch-N.png)")
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, f"mop/{name}", tmp)
        return Path(local).read_bytes()
