"""The Sweeps page's HTML, rendered from the Jinja2 templates in ``templates/`` with autoescape:
every value read from MLflow or Optuna (run names, params, reasons) is escaped by the template
engine, not by hand.

No Airflow here and no I/O but the templates: :func:`render_page` is a pure function of the data
``sweeps_page`` reads. The page follows Airflow's light or dark mode (``templates/theme.js`` and
the colour variables of ``templates/sweeps.css``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from mopflow.plugins import sweep_figures
from mopflow.training.search.figures import FIGURE_KINDS, TITLES

if TYPE_CHECKING:
    from mopflow.plugins.sweeps_page import PageData


def fmt_time(ms: int | None) -> str:
    """A start time in milliseconds since the epoch, as UTC minutes."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


def fmt_acc(value: float | None) -> str:
    """An accuracy to 4 decimals, "-" for none."""
    return f"{value:.4f}" if value is not None else "-"


def fmt_param(value: Any) -> str:
    """A param value as people read it: floats to 4 significant digits, the rest as given."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        try:  # MLflow params come back as text
            number = float(value)
        except ValueError:
            return value
        return f"{number:.4g}" if any(c in value for c in ".eE") else value
    return json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)


def _without(values: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k != key}


def render_promotion(promoted: str | None, reason: str | None) -> str:
    """The promotion gate's verdict with its reason (text: the template escapes it)."""
    if promoted is None:
        return ""
    verdict = "promoted to champion" if promoted == "true" else "not promoted"
    return f"{verdict}: {reason}" if reason else verdict


@functools.cache
def environment() -> Environment:
    """The page's template environment: templates shipped in the package, autoescaped, and an
    undefined name is an error rather than an empty string."""
    env = Environment(
        loader=PackageLoader("mopflow.plugins", "templates"),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=fmt_time, acc=fmt_acc, param=fmt_param, without=_without)
    env.globals.update(
        kinds=FIGURE_KINDS,
        titles=TITLES,
        promotion_text=render_promotion,
        refresh_ms=sweep_figures.REFRESH_S * 1000,
    )
    return env


def render_params(params: Mapping[str, Any]) -> str:
    """A trial's params as a key/value list (escaped); an item never wraps inside a number."""
    macros: Any = environment().get_template("parts.html").module  # a template's macros are its attributes
    return str(macros.params(params))


def render_page(data: PageData, base: str = "") -> str:
    """The whole page (every value escaped). ``base`` is the path the plugin app is mounted at."""
    return environment().get_template("sweeps.html").render(data=data, base=base)
