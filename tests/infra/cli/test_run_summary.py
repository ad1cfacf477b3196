"""What ``mopflow run`` prints of a run's summary: the student's serving latency and its search."""

from __future__ import annotations

from typing import Any

from mopflow.infra.cli.run import format_summary


def _summary(latency: dict[str, Any] | None, search: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "trials": {"COMPLETE": 2},
        "best_trial": {"number": 1, "params": {"width": 8}, "val_acc": 0.9, "test_acc": 0.89},
        "ensemble": {"members": [1, 0], "test_acc": 0.93, "num_params": 1000},
        "student": {
            "arch": {"family": "cnn", "params": {"width": 4, "depth": 2}},
            "test_acc": 0.91,
            "num_params": 90,
            "param_ratio": 0.09,
            "latency": latency,
            "search": search,
        },
        "registered": {"name": "m-student", "version": "1", "aliases": ["challenger"], "reason": "why"},
        "mlflow": {"tracking_uri": "sqlite:///x", "experiment": "mopflow", "parent_run_id": "r"},
        "optuna": {"storage": "journal", "study_name": "s"},
    }


def test_the_students_latency_and_search_are_printed() -> None:
    latency = {"p50_ms": 1.234, "p95_ms": 2.345, "rows": 256, "budget_ms": 3.0}
    search = {"chosen": 4, "front": [0, 4], "candidates": [{}] * 6}
    text = format_summary(_summary(latency, search))
    assert "serves 256 rows in p50 1.23 ms, p95 2.35 ms on one CPU thread (student_budget_ms 3)" in text
    assert "chosen by a student search: candidate 4 of 6, on a Pareto front of 2" in text


def test_a_summary_without_them_prints_neither() -> None:
    """Older summaries have no latency; a run without a search has none."""
    text = format_summary(_summary(None, None))
    assert "serves" not in text and "student search" not in text
    unbudgeted = {"p50_ms": 1.0, "p95_ms": 2.0, "rows": 256, "budget_ms": None}
    assert "on one CPU thread\n" in format_summary(_summary(unbudgeted, None)) + "\n"
