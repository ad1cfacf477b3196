"""The student-budget benchmark's verdicts and table, on made-up runs (its runs are whole demo
runs: ``benchmarks/student_budget.py``)."""

from __future__ import annotations

from typing import Any

from student_budget import table, targets


def _row(arm: str, test_acc: float, p95: float, budget: float | None, search: Any = None) -> dict[str, Any]:
    return {
        "arm": arm,
        "family": "rescnn",
        "params": {"width": 8, "depth": 4},
        "num_params": 1000,
        "test_acc": test_acc,
        "p50_ms": p95 / 2,
        "p95_ms": p95,
        "budget_ms": budget,
        "kept": "distilled",
        "wall_s": 100.0,
        "search": search,
    }


def test_a_budgeted_student_passes_within_its_budget_and_one_point_of_the_default() -> None:
    rows = [
        _row("default", 0.95, 4.0, None),
        _row("budget", 0.935, 1.9, 2.0),  # 1.5 points lost
        _row("search", 0.945, 2.1, 2.0),  # over the budget
    ]
    assert targets(rows) == {
        "budget": {"meets the budget": "PASS", "within 1 point of the default": "FAIL"},
        "search": {"meets the budget": "FAIL", "within 1 point of the default": "PASS"},
    }


def test_a_run_that_failed_on_its_budget_fails_both_targets_and_is_named() -> None:
    failed = {
        "arm": "budget",
        "overrides": [],
        "error": "StudentBudgetError: student_budget_ms=2",
        "wall_s": 90.0,
    }
    rows = [_row("default", 0.95, 4.0, None), failed]
    assert targets(rows) == {"budget": {"meets the budget": "FAIL", "within 1 point of the default": "FAIL"}}
    assert "budget: the run failed after 90 s: StudentBudgetError: student_budget_ms=2" in table(rows)


def test_the_table_lists_the_search_front() -> None:
    search = {
        "chosen": 1,
        "front": [0, 1],
        "candidates": [
            {
                "number": 0,
                "family": "mlp",
                "params": {"width": 4},
                "val_acc": 0.5,
                "latency_p95_ms": 0.5,
                "num_params": 9,
            },
            {
                "number": 1,
                "family": "cnn",
                "params": {"width": 6},
                "val_acc": 0.9,
                "latency_p95_ms": 1.5,
                "num_params": 99,
            },
        ],
    }
    lines = table([_row("default", 0.95, 4.0, None), _row("search", 0.94, 1.5, 2.0, search)])
    assert any("search: the Pareto front (chosen: candidate 1)" in line for line in lines)
    assert any("#1 cnn width 6: val_acc 0.9000, p95 1.50 ms, 99 params" in line for line in lines)
