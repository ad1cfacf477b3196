"""Pictures of a search, drawn from its Optuna study with ``optuna.visualization.matplotlib``: the
optimisation history, the learning curves (one line per trial, pruned trials marked) and the
parameter importances.

Pure: a study in, a matplotlib figure out. The search stage logs the figures to MLflow; the Sweeps
page renders the same figures to PNG from the Optuna storage while a sweep runs. Figures are drawn
on the Agg canvas and detached from pyplot at once, so nothing is left open in a long-lived web
server; pyplot's global state is held by a lock while a figure is drawn (the page draws from
several request threads).
"""

from __future__ import annotations

import io
import re
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the Airflow plugin imports this module's names
    import optuna
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from optuna.trial import FrozenTrial

OPTIMIZATION_HISTORY = "optimization-history"
LEARNING_CURVES = "learning-curves"
PARAM_IMPORTANCES = "param-importances"
FIGURE_KINDS = (OPTIMIZATION_HISTORY, LEARNING_CURVES, PARAM_IMPORTANCES)
TITLES = {
    OPTIMIZATION_HISTORY: "Optimization history",
    LEARNING_CURVES: "Learning curves (pruned trials dashed, × where pruned)",
    PARAM_IMPORTANCES: "Parameter importances",
}
OBJECTIVE = "validation accuracy"
MIN_TRIALS_FOR_IMPORTANCES = 2
FIGSIZE = (8.0, 4.8)
PRUNED_SUFFIX = " (pruned)"

_TRIAL_LABEL = re.compile(r"^Trial(\d+)$")  # how Optuna labels a trial's line
_pyplot = threading.Lock()


class FigureUnavailable(Exception):
    """The study cannot give this figure yet; ``reason`` says why, for logs and the page."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


def _check_kind(kind: str) -> None:
    if kind not in FIGURE_KINDS:
        raise ValueError(f"figure kind {kind!r} is not one of {', '.join(FIGURE_KINDS)}")


def varying_params(trials: Sequence[FrozenTrial]) -> list[str]:
    """The parameters that take more than one value over the COMPLETE trials."""
    from optuna.trial import TrialState

    values: dict[str, set[str]] = {}
    for trial in trials:
        if trial.state == TrialState.COMPLETE:
            for name, value in trial.params.items():
                values.setdefault(name, set()).add(repr(value))
    return sorted(name for name, seen in values.items() if len(seen) > 1)


def unavailable_reason(trials: Sequence[FrozenTrial], kind: str) -> str | None:
    """Why ``kind`` cannot be drawn from these trials (None: it can)."""
    from optuna.trial import TrialState

    _check_kind(kind)
    complete = sum(1 for t in trials if t.state == TrialState.COMPLETE)
    if kind == OPTIMIZATION_HISTORY and complete == 0:
        return "no completed trial yet"
    if kind == LEARNING_CURVES and not any(t.intermediate_values for t in trials):
        return "no trial has reported an epoch yet"
    if kind == PARAM_IMPORTANCES:
        if complete < MIN_TRIALS_FOR_IMPORTANCES:
            return f"needs {MIN_TRIALS_FOR_IMPORTANCES} completed trials ({complete} so far)"
        if not varying_params(trials):
            return "no parameter varies over the completed trials"
    return None


def draw(study: optuna.Study, kind: str) -> Figure:
    """One figure of ``study``, detached from pyplot; :class:`FigureUnavailable` when the study
    cannot give it (too few trials, or the importances cannot be computed from them)."""
    trials = study.get_trials(deepcopy=False)
    reason = unavailable_reason(trials, kind)
    if reason is not None:
        raise FigureUnavailable(kind, reason)
    with _pyplot:
        import matplotlib
        import optuna

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
        from optuna.visualization import matplotlib as optuna_plots

        before = set(plt.get_fignums())
        # Optuna's plots set the ggplot style globally: the rc context puts the defaults back.
        with matplotlib.rc_context(), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if kind == OPTIMIZATION_HISTORY:
                ax = optuna_plots.plot_optimization_history(study, target_name=OBJECTIVE)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            elif kind == LEARNING_CURVES:
                ax = optuna_plots.plot_intermediate_values(study)
                _mark_pruned(ax, {t.number: t for t in trials})
            else:
                try:
                    ax = optuna_plots.plot_param_importances(
                        study, params=varying_params(trials), target_name=OBJECTIVE
                    )
                except Exception as exc:  # the evaluator can refuse a study (e.g. equal values)
                    for number in set(plt.get_fignums()) - before:
                        plt.close(number)
                    raise FigureUnavailable(kind, f"importances not computable: {exc}") from exc
            ax.set_title(TITLES[kind], loc="left")
            ax.set_title("")
            figure = ax.get_figure(root=True)
            assert figure is not None  # Optuna's plots draw on a figure of their own
            figure.set_size_inches(*FIGSIZE)
            figure.set_layout_engine("tight")  # room for long parameter names and outside legends
            plt.close(figure)  # detached: it can still be saved, and pyplot keeps no reference
    return figure


def _mark_pruned(ax: Axes, trials: dict[int, FrozenTrial]) -> None:
    """Epochs from 1 (as the task logs and the leaderboard count them); a pruned trial's line
    dashed and crossed where it was stopped."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator
    from optuna.trial import TrialState

    for line in list(ax.get_lines()):
        match = _TRIAL_LABEL.match(str(line.get_label()))
        if match is None:
            continue
        epochs = np.asarray(line.get_xdata(), dtype=float) + 1
        line.set_xdata(epochs)
        trial = trials.get(int(match.group(1)))
        if trial is not None and trial.state == TrialState.PRUNED and len(epochs):
            line.set_linestyle("--")
            line.set_label(f"Trial{match.group(1)}{PRUNED_SUFFIX}")
            last = float(np.asarray(line.get_ydata(), dtype=float)[-1])
            ax.plot([epochs[-1]], [last], marker="X", markersize=10, color=line.get_color(), label="_pruned")
    ax.relim()
    ax.autoscale_view()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(OBJECTIVE)
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", borderaxespad=0.0, fontsize="small")


def png(figure: Figure) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    with _pyplot:
        figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
