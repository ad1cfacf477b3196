"""The Sweeps page's templates: autoescaped, shipped in the package, and following the colour mode
of Airflow's UI (or of the browser when the page is on its own)."""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mopflow.plugins import sweeps_html
from mopflow.plugins.sweeps_page import Links, PageData, Sweep, TrialRow
from mopflow.training.search.figures import LEARNING_CURVES, OPTIMIZATION_HISTORY

CHROMIUM = os.environ.get("MOPFLOW_CHROMIUM", "/usr/bin/chromium")  # Debian's; never a downloaded one
EVIL = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def _evil_sweep(**changes: Any) -> Sweep:
    """A sweep whose every value MLflow or Optuna hands back is the attacker's."""
    fields: dict[str, Any] = {
        "run_id": "a" * 32,
        "experiment_id": "1",
        "dag_id": f"dag{EVIL}",
        "airflow_run_id": f"manual__{EVIL}",
        "status": "FINISHED",
        "start_time_ms": 0,
        "strategy": EVIL,
        "study": f"study{EVIL}",
        "study_id": 7,
        "search_run_id": "b" * 32,
        "leaderboard": [TrialRow(0, EVIL, 0.5, None, {"family": EVIL, EVIL: EVIL})],
        "leaderboard_source": "leaderboard.json",
        "gantt": ["gantt-epoch-001.png"],
        "promoted": "false",
        "promotion_reason": EVIL,
        "figures": {OPTIMIZATION_HISTORY: None, LEARNING_CURVES: EVIL},
    }
    return Sweep(**{**fields, **changes})


def test_every_value_from_mlflow_and_optuna_is_escaped() -> None:
    page = sweeps_html.render_page(PageData([_evil_sweep()], Links(), f"exp{EVIL}", [EVIL]), base="/mopflow")
    assert EVIL not in page
    # dag, run, strategy, study (meta and figure alt), state, family, param key and value, reason,
    # skipped figure's reason, experiment, error: each one escaped where it is shown.
    assert page.count(ESCAPED) >= 12, page.count(ESCAPED)
    assert f"<h2>dag{ESCAPED} · manual__{ESCAPED}</h2>" in page
    assert f'<p class="promotion">not promoted: {ESCAPED}</p>' in page
    assert f'<p class="error">{ESCAPED}</p>' in page
    # In an attribute a quote cannot end it early.
    quoted = sweeps_html.render_page(PageData([_evil_sweep(study='s" onerror="x')], Links(), "e"))
    assert 'onerror="x"' not in quoted and "s&#34; onerror=&#34;x" in quoted
    # The page's only scripts are its own two.
    assert len(re.findall(r"<script>", page)) == 2


def test_the_templates_are_autoescaped_and_strict() -> None:
    env = sweeps_html.environment()
    for name in ("sweeps.html", "parts.html"):
        assert env.get_template(name).environment.autoescape is not False
        assert callable(env.autoescape) and env.autoescape(name)
    assert (
        sweeps_html.render_params({"x": EVIL}) == f'<ul class="params"><li><code>x</code> {ESCAPED}</li></ul>'
    )


def test_the_page_follows_the_colour_mode() -> None:
    page = sweeps_html.render_page(PageData([], Links(), "mopflow"))
    style = page.split("<style>")[1].split("</style>")[0]
    head = page.split("</head>")[0]
    # Colours are variables: light by default; dark when the browser prefers it (unless Airflow's
    # UI says light) and when Airflow's UI is dark.
    assert "color-scheme:light dark" in style
    assert "body{font-family:system-ui,sans-serif;margin:1rem;color:var(--fg);background:var(--bg)}" in style
    light = re.search(r":root\{color-scheme:light dark;([^}]*)\}", style)
    by_browser = re.search(
        r"@media \(prefers-color-scheme: dark\)\{:root:not\(\[data-theme=light\]\)\{([^}]*)\}\}", style
    )
    by_airflow = re.search(r":root\[data-theme=dark\]\{([^}]*)\}", style)
    assert light and by_browser and by_airflow, style
    assert by_browser.group(1) == by_airflow.group(1) and "color-scheme:dark" in by_airflow.group(1)
    bg = re.compile(r"--bg:(#[0-9a-f]{6})")
    assert bg.findall(light.group(1)) != bg.findall(by_airflow.group(1))
    # No colour is written outside the variables but the charts' white card (matplotlib's paper).
    rules = style.split("img.search-figure,img.gantt")[0].split(":root[data-theme=light]")[1]
    assert not re.search(r"#[0-9a-f]{3,6}", rules), rules
    # Inside Airflow's UI the mode is the UI's: the class next-themes puts on its <html>, read
    # before the body is painted, and followed when the user switches it.
    script = head.split("<script>")[1]
    assert "window.parent.document.documentElement" in script
    assert 'outer.classList.contains("dark")' in script and "MutationObserver" in script


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[str]:
    """The page, and a stand-in for Airflow's UI that shows it in an iframe, on one loopback origin
    (as the api-server serves both): the UI's mode is the class next-themes puts on its <html>."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        from tests.conftest import skip_unless_required

        skip_unless_required(f"needs chromium at {CHROMIUM} (apt-get install chromium)")
    pytest.importorskip("playwright")
    www = tmp_path / "www"
    www.mkdir()
    (www / "sweeps.html").write_text(
        sweeps_html.render_page(PageData([_evil_sweep()], Links(), "e", ["error"]))
    )
    (www / "ui.html").write_text(
        '<!DOCTYPE html><html class="light"><body><iframe src="sweeps.html"></iframe>'
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(www)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


@pytest.mark.slow
def test_browser_the_page_takes_the_mode_of_airflow_s_ui_else_the_browser_s(
    served: str, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    background = "el => getComputedStyle(el.ownerDocument.body).backgroundColor"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page()
            # On its own: the browser's preference.
            seen = {}
            for scheme in ("light", "dark"):
                page.emulate_media(color_scheme=scheme)
                page.goto(f"{served}/sweeps.html")
                seen[scheme] = page.locator("body").evaluate(background)
                page.screenshot(path=str(tmp_path / f"sweeps-{scheme}.png"), full_page=True)
            assert seen == {"light": "rgb(255, 255, 255)", "dark": "rgb(24, 24, 27)"}, seen
            # Inside the UI: the UI's mode wins over the browser's (dark here), and a toggle is followed.
            page.goto(f"{served}/ui.html")
            body = page.frame_locator("iframe").locator("body")
            expect(body).to_have_css("background-color", seen["light"])
            page.evaluate("document.documentElement.className = 'dark'")
            expect(body).to_have_css("background-color", seen["dark"])
            page.emulate_media(color_scheme="light")
            expect(body).to_have_css("background-color", seen["dark"])
            # The charts keep their white card in the dark.
            expect(body.locator("img.gantt")).to_have_css("background-color", "rgb(255, 255, 255)")
            page.screenshot(path=str(tmp_path / "ui-dark.png"), full_page=True)
        finally:
            browser.close()
