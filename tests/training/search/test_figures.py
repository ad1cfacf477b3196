"""The search's figures, drawn from a small in-memory study: what each one shows, and why one
is left out when the study cannot give it yet."""

from __future__ import annotations

from typing import Any

import matplotlib
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from mopflow.training.search.figures import (
    FIGURE_KINDS,
    LEARNING_CURVES,
    OBJECTIVE,
    OPTIMIZATION_HISTORY,
    PARAM_IMPORTANCES,
    TITLES,
    FigureUnavailable,
    draw,
    png,
    unavailable_reason,
    varying_params,
)

SPACE = {
    "lr": FloatDistribution(1e-3, 1e-1, log=True),
    "family": CategoricalDistribution(["mlp", "rescnn"]),
    "batch_size": CategoricalDistribution([64, 128]),
}


def _trial(
    params: dict[str, Any], curve: list[float], state: TrialState = TrialState.COMPLETE
) -> optuna.trial.FrozenTrial:
    return create_trial(
        params=params,
        distributions={k: SPACE[k] for k in params},
        state=state,
        value=curve[-1] if state == TrialState.COMPLETE else None,
        intermediate_values=dict(enumerate(curve)),
    )


def _study(*trials: optuna.trial.FrozenTrial) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.add_trials(trials)
    return study


@pytest.fixture(scope="module")
def study() -> optuna.Study:
    """Trials 0, 1, 3 complete (3 epochs each), trial 2 pruned after its second epoch (step 1);
    batch_size is the same everywhere, lr and family vary."""
    return _study(
        _trial({"lr": 0.01, "family": "mlp", "batch_size": 64}, [0.5, 0.7, 0.8]),
        _trial({"lr": 0.05, "family": "rescnn", "batch_size": 64}, [0.4, 0.5, 0.6]),
        _trial({"lr": 0.002, "family": "mlp", "batch_size": 64}, [0.2, 0.25], TrialState.PRUNED),
        _trial({"lr": 0.02, "family": "rescnn", "batch_size": 64}, [0.6, 0.8, 0.9]),
    )


def test_learning_curves_have_a_line_per_trial_with_the_pruned_one_marked(study: optuna.Study) -> None:
    ax = draw(study, LEARNING_CURVES).axes[0]
    assert ax.get_title(loc="left") == TITLES[LEARNING_CURVES]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("epoch", OBJECTIVE)
    lines = {str(line.get_label()): line for line in ax.get_lines()}
    assert set(lines) == {"Trial0", "Trial1", "Trial2 (pruned)", "Trial3", "_pruned"}
    assert list(lines["Trial3"].get_xdata()) == [1, 2, 3]  # epochs from 1, as the leaderboard counts
    assert list(lines["Trial3"].get_ydata()) == [0.6, 0.8, 0.9]
    assert [lines[f"Trial{n}"].get_linestyle() for n in (0, 1, 3)] == ["-", "-", "-"]
    pruned = lines["Trial2 (pruned)"]
    assert pruned.get_linestyle() == "--" and list(pruned.get_xdata()) == [1, 2]
    cross = lines["_pruned"]  # a cross where trial 2 was stopped, in its colour
    assert cross.get_marker() == "X" and list(cross.get_xdata()) == [2] and list(cross.get_ydata()) == [0.25]
    assert cross.get_color() == pruned.get_color()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["Trial0", "Trial1", "Trial2 (pruned)", "Trial3"]


def test_optimization_history_shows_the_completed_trials_and_the_best_so_far(study: optuna.Study) -> None:
    ax = draw(study, OPTIMIZATION_HISTORY).axes[0]
    assert ax.get_title(loc="left") == TITLES[OPTIMIZATION_HISTORY] and ax.get_title() == ""
    assert ax.get_ylabel() == OBJECTIVE
    points = ax.collections[0].get_offsets()
    assert [tuple(p) for p in points] == [(0, 0.8), (1, 0.6), (3, 0.9)]  # the pruned trial has no value
    (best,) = [line for line in ax.get_lines() if line.get_label() == "Best Value"]
    assert list(best.get_ydata()) == [0.8, 0.8, 0.8, 0.9]


def test_param_importances_rank_the_parameters_that_vary(study: optuna.Study) -> None:
    ax = draw(study, PARAM_IMPORTANCES).axes[0]
    assert ax.get_title(loc="left") == TITLES[PARAM_IMPORTANCES]
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(names) == ["family", "lr"]  # batch_size never varies: nothing to rank
    widths = [bar.get_width() for bar in ax.patches]
    assert len(widths) == 2 and all(w >= 0 for w in widths) and sum(widths) == pytest.approx(1.0)


def test_a_figure_is_png_and_leaves_no_pyplot_state_behind(study: optuna.Study) -> None:
    import matplotlib.pyplot as plt

    style = dict(matplotlib.rcParams)
    for kind in FIGURE_KINDS:
        image = png(draw(study, kind))
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 10_000, kind
    assert plt.get_fignums() == []  # drawn figures are detached: a web server keeps none open
    assert dict(matplotlib.rcParams) == style  # Optuna's ggplot style did not leak


def test_figures_the_study_cannot_give_yet_are_refused_with_their_reason() -> None:
    empty = _study()
    assert unavailable_reason(empty.trials, OPTIMIZATION_HISTORY) == "no completed trial yet"
    assert unavailable_reason(empty.trials, LEARNING_CURVES) == "no trial has reported an epoch yet"
    one = _study(
        _trial({"lr": 0.01, "family": "mlp"}, [0.5, 0.6]),
        _trial({"lr": 0.02, "family": "mlp"}, [0.3], TrialState.PRUNED),
    )
    assert unavailable_reason(one.trials, OPTIMIZATION_HISTORY) is None
    assert unavailable_reason(one.trials, LEARNING_CURVES) is None
    with pytest.raises(FigureUnavailable, match=r"needs 2 completed trials \(1 so far\)") as refused:
        draw(one, PARAM_IMPORTANCES)
    assert refused.value.kind == PARAM_IMPORTANCES
    same = _study(*(_trial({"lr": 0.01, "family": "mlp"}, [v]) for v in (0.5, 0.6)))
    assert varying_params(same.trials) == []
    assert (
        unavailable_reason(same.trials, PARAM_IMPORTANCES) == "no parameter varies over the completed trials"
    )
    with pytest.raises(ValueError, match="not one of"):
        unavailable_reason(same.trials, "contour")
