"""The plan-spot table and its JSON form."""

from __future__ import annotations

import json

from mopflow.training.volatile.prices import EmpiricalPrices, GaussianPrices
from mopflow.training.volatile.spot_plan import plan_spot
from mopflow.training.volatile.spot_plan_model import STRATEGIES
from mopflow.training.volatile.spot_plan_report import describe_prices, format_report, report_as_dict
from tests.training.volatile.helpers import plan_config


def test_the_table_lists_every_strategy_and_the_chosen_plan() -> None:
    c = plan_config()
    report = plan_spot(c)
    lines = format_report(c, report).splitlines()
    assert lines[0] == "prices: uniform on [0.1, 1.2]; on-demand 1/worker-hour; bid cap 1"
    for strategy in STRATEGIES:
        assert any(line.startswith(f"{strategy:10} ") for line in lines[4:7])
    chosen = report.chosen
    assert lines[-1].startswith(f"plan: {chosen.strategy} - ")
    assert f"expected cost {chosen.expected_cost:.4f} (" in lines[-1] and "below on-demand" in lines[-1]


def test_an_infeasible_strategy_says_why() -> None:
    c = plan_config(deadline_hours=0.9)
    report = plan_spot(c)
    text = format_report(c, report)
    assert f"infeasible: {report.reasons['one-bid']}" in text
    assert f"plan: on-demand - {report.chosen.workers} on-demand workers for" in text
    assert "below on-demand" not in text


def test_prices_are_described_in_one_line() -> None:
    gaussian = plan_config(prices=GaussianPrices(mean=0.5, std=0.2))
    assert describe_prices(gaussian) == "Gaussian mean 0.5, std 0.2 (truncated at 0)"
    empirical = plan_config(prices=EmpiricalPrices(prices=(0.1, 0.3, 0.7), weights=(1.0, 2.0, 1.0)))
    assert describe_prices(empirical) == "empirical, 3 distinct prices in [0.1, 0.7]"


def test_the_report_as_plain_data() -> None:
    c = plan_config()
    report = plan_spot(c)
    data = json.loads(json.dumps(report_as_dict(c, report)))
    assert data["config"]["prices"] == {"kind": "uniform", "low": 0.1, "high": 1.2}
    assert data["chosen"]["workers"] == report.chosen.workers
    assert data["chosen"]["expected_cost"] == report.chosen.expected_cost
    assert set(data["options"]) == set(STRATEGIES) and data["reasons"] == {}
