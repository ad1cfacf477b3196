"""The Sweeps page's search figures: drawn from a real Optuna journal storage on request, names
from the URL checked, the HTML for them and the live refresh of a running sweep's section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from mopflow.plugins import sweep_figures
from mopflow.plugins.sweeps_html import render_page
from mopflow.plugins.sweeps_page import Links, PageData, Sweep
from mopflow.training.search.figures import LEARNING_CURVES, OPTIMIZATION_HISTORY, PARAM_IMPORTANCES

STUDY = "stack-0123456789ab"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _add(study: optuna.Study, lr: float, curve: list[float], state: TrialState = TrialState.COMPLETE) -> None:
    study.add_trial(
        create_trial(
            params={"lr": lr},
            distributions={"lr": FloatDistribution(1e-3, 1e-1, log=True)},
            state=state,
            value=curve[-1] if state == TrialState.COMPLETE else None,
            intermediate_values=dict(enumerate(curve)),
        )
    )


def _study(storage_url: str) -> optuna.Study:
    """One completed trial and one pruned: importances cannot be drawn yet."""
    from mopflow.base.optuna_storage import make_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=STUDY, storage=make_storage(storage_url), direction="maximize")
    _add(study, 0.01, [0.5, 0.7])
    _add(study, 0.05, [0.2], TrialState.PRUNED)
    return study


def test_figures_come_from_the_storage_and_follow_the_study(tmp_path: Path) -> None:
    url = str(tmp_path / "journal.log")
    study = _study(url)
    storage = sweep_figures.storage(url)
    status = sweep_figures.figure_status(storage, STUDY)
    assert status == {
        OPTIMIZATION_HISTORY: None,
        LEARNING_CURVES: None,
        PARAM_IMPORTANCES: "needs 2 completed trials (1 so far)",
    }
    history = sweep_figures.figure_png(storage, STUDY, OPTIMIZATION_HISTORY)
    assert history.startswith(PNG_MAGIC)
    assert sweep_figures.figure_png(storage, STUDY, OPTIMIZATION_HISTORY) is history  # unchanged: kept
    from mopflow.training.search.figures import FigureUnavailable

    with pytest.raises(FigureUnavailable, match="1 so far"):
        sweep_figures.figure_png(storage, STUDY, PARAM_IMPORTANCES)
    _add(study, 0.02, [0.6, 0.9])  # the sweep goes on: its figures are drawn again
    assert sweep_figures.figure_status(storage, STUDY)[PARAM_IMPORTANCES] is None
    again = sweep_figures.figure_png(storage, STUDY, OPTIMIZATION_HISTORY)
    assert again.startswith(PNG_MAGIC) and again != history
    assert sweep_figures.figure_png(storage, STUDY, PARAM_IMPORTANCES).startswith(PNG_MAGIC)
    assert sweep_figures.statuses(storage, [STUDY, "other-study", "../" + STUDY]).keys() == {STUDY}


@pytest.mark.parametrize("name", ["../journal", "a/b", "<script>", "x" * 200, "", "1abc"])
def test_a_study_name_from_the_url_is_checked_before_the_storage_is_read(name: str) -> None:
    with pytest.raises(ValueError, match="is not a study name"):
        sweep_figures.figure_png(object(), name, OPTIMIZATION_HISTORY)  # never reached: no storage


def _sweep(status: str, figures: dict[str, str | None]) -> Sweep:
    return Sweep(
        run_id="a" * 32,
        experiment_id="1",
        dag_id="mopflow_sweep",
        airflow_run_id="manual__1",
        status=status,
        start_time_ms=None,
        strategy="task",
        study=STUDY,
        study_id=0,
        search_run_id="b" * 32,
        figures=figures,
    )


def test_the_page_shows_the_figures_beside_the_leaderboard_and_refreshes_a_running_sweep() -> None:
    evil = "<b>bad</b>"
    figures = {OPTIMIZATION_HISTORY: None, LEARNING_CURVES: None, PARAM_IMPORTANCES: evil}
    running = render_page(PageData([_sweep("RUNNING", figures)], Links(), "mopflow"), base="/mopflow")
    assert f'<section class="sweep" id="run-{"a" * 32}" data-live>' in running
    for kind in (OPTIMIZATION_HISTORY, LEARNING_CURVES):
        assert f'data-kind="{kind}" src="/mopflow/sweeps/figures/{STUDY}/{kind}.png"' in running
    assert f'<p class="figure-skipped" data-kind="{PARAM_IMPORTANCES}">' in running
    assert evil not in running and "&lt;b&gt;bad&lt;/b&gt;" in running
    assert '<div class="search-view"><p>No trials yet.</p><div class="figures">' in running
    assert (
        "window.mopflowRefresh = refresh" in running and f"}}, {sweep_figures.REFRESH_S * 1000});" in running
    )
    finished = render_page(PageData([_sweep("FINISHED", figures)], Links(), "mopflow"))
    assert "data-live" not in finished.split("<script>")[0]
    assert 'class="figures"' not in render_page(PageData([_sweep("FINISHED", {})], Links(), "mopflow"))


@pytest.fixture()
def client(mopflow_home: Path) -> Any:
    from fastapi.testclient import TestClient

    from mopflow.base.settings import Settings
    from mopflow.plugins import mopflow_plugin

    _study(Settings.from_env().optuna_storage)
    app = mopflow_plugin.create_app()
    app.dependency_overrides[mopflow_plugin.require_user] = lambda: None  # auth: the last test
    return TestClient(app)


def test_the_figure_route_serves_png_and_refuses_bad_names(client: Any) -> None:
    response = client.get(f"/sweeps/figures/{STUDY}/{LEARNING_CURVES}.png")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png" and response.content.startswith(PNG_MAGIC)
    assert response.headers["cache-control"] == "no-cache"  # a running sweep's figure changes
    skipped = client.get(f"/sweeps/figures/{STUDY}/{PARAM_IMPORTANCES}.png")
    assert skipped.status_code == 404 and "needs 2 completed trials" in skipped.text
    assert client.get(f"/sweeps/figures/{STUDY}/contour.png").status_code == 400
    assert client.get(f"/sweeps/figures/{STUDY}/{LEARNING_CURVES}.svg").status_code == 400
    assert client.get(f"/sweeps/figures/bad%3Cname%3E/{LEARNING_CURVES}.png").status_code == 400
    assert client.get(f"/sweeps/figures/no-such-study/{LEARNING_CURVES}.png").status_code == 404


def test_the_figure_route_needs_an_authenticated_user(mopflow_home: Path) -> None:
    from fastapi.testclient import TestClient

    from mopflow.plugins import mopflow_plugin

    anonymous = TestClient(mopflow_plugin.create_app())
    assert anonymous.get(f"/sweeps/figures/{STUDY}/{LEARNING_CURVES}.png").status_code == 401
