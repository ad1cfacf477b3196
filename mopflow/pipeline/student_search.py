"""The distill stage's student search at its edges: the Optuna study it runs in, a nested MLflow
run per candidate, and the Pareto front logged as JSON and as a figure
(:mod:`mopflow.compression.distill.student_search` holds the search itself)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from mopflow.base.tag_names import RUN_KEY, STAGE
from mopflow.compression.distill.student_search import (
    OBJECTIVES,
    Candidate,
    StudentSearchResult,
    StudentSearchSetup,
)
from mopflow.pipeline.context import Stage, study_name_for

log = logging.getLogger(__name__)

SEARCH_ARTIFACT = "student_search/candidates.json"
FRONT_FIGURE = "student_search/pareto_front.png"
CANDIDATE_STAGE = "student_candidate"


def student_search_setup(st: Stage, dcfg: Any) -> StudentSearchSetup:
    """The study of this run's student search (``<run's study>-students`` in the pipeline's Optuna
    storage: a rerun goes on with it) and what records each candidate as a nested MLflow run."""
    import optuna

    from mopflow.base.optuna_storage import make_storage

    # a few candidates: TPE models the front after a third of them, not after its default ten
    sampler = optuna.samplers.TPESampler(seed=st.cfg.search.seed, n_startup_trials=max(1, dcfg.trials // 3))
    study = optuna.create_study(
        study_name=f"{study_name_for(st.cfg, st.run)}-students",
        storage=make_storage(st.settings.optuna_storage),
        directions=["maximize", "minimize"],
        sampler=sampler,
        load_if_exists=True,
    )
    with warnings.catch_warnings():  # names for optuna-dashboard: experimental, and stable since 3.2
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(
            [OBJECTIVES[0], "latency_p95_ms" if dcfg.budget_ms is not None else "num_params"]
        )

    def record(candidate: Candidate, state: str) -> None:
        tags = {RUN_KEY: st.run.run_key, STAGE: CANDIDATE_STAGE, "mopflow.candidate": str(candidate.number)}
        run_id = st.tracker.get_or_start_run(f"student-candidate-{candidate.number:04d}", tags, st.run_id)
        st.tracker.log_params(
            run_id, {"family": candidate.arch.family, **candidate.arch.params, "state": state}
        )
        figures = {"num_params": float(candidate.num_params)}
        if candidate.latency_p95_ms is not None:
            figures["latency_p95_ms"] = candidate.latency_p95_ms
        if candidate.val_acc is not None:
            figures["val_acc"] = candidate.val_acc
        st.tracker.log_metrics(run_id, figures)
        st.tracker.end_run(run_id, "FINISHED" if state == "COMPLETE" else "KILLED")

    return StudentSearchSetup(study, record)


def log_student_search(st: Stage, result: StudentSearchResult) -> None:
    """The candidates, the front and the choice on the distill run: JSON, a figure, the chosen
    candidate's number and the front's size."""
    st.tracker.log_dict(st.run_id, result.to_dict(), SEARCH_ARTIFACT)
    st.tracker.log_metrics(
        st.run_id,
        {
            "student_candidates": float(len(result.candidates)),
            "student_front_size": float(len(result.front)),
            "student_chosen_candidate": float(result.chosen.number),
        },
    )
    try:
        figure = front_figure(result)
        try:
            st.tracker.log_figure(st.run_id, figure, FRONT_FIGURE)
        finally:
            from matplotlib import pyplot as plt

            plt.close(figure)
    except Exception as exc:  # a picture never fails the stage
        log.warning("distill: no Pareto front figure: %s: %s", type(exc).__name__, exc)


def front_figure(result: StudentSearchResult) -> Any:
    """Accuracy against serving cost: every candidate distilled, the front as a line, the budget
    as a vertical line, the chosen student marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    timed = result.budget_ms is not None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    done = [c for c in result.candidates if c.val_acc is not None]
    ax.scatter(
        [c.cost for c in done], [float(c.val_acc or 0.0) for c in done], color="0.6", label="candidates"
    )
    ax.plot(
        [c.cost for c in result.front],
        [float(c.val_acc or 0.0) for c in result.front],
        "o-",
        color="C0",
        label="Pareto front",
    )
    if timed:
        ax.axvline(float(result.budget_ms or 0.0), color="C3", linestyle="--", label="budget")
    chosen = result.chosen
    ax.scatter(
        [chosen.cost],
        [float(chosen.val_acc or 0.0)],
        s=160,
        facecolors="none",
        edgecolors="C2",
        linewidths=2,
        label="chosen",
    )
    ax.set_xlabel("p95 latency, ms per request (one CPU thread)" if timed else "parameters")
    ax.set_ylabel("validation accuracy after distillation")
    ax.set_title("Student search")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig
