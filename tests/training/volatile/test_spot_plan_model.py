"""The terms of a spot plan: the paper's error bound and a plan's expected cost, time and error."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mopflow.training.volatile.prices import UniformPrices
from mopflow.training.volatile.spot_plan_model import ConvergenceModel, evaluate
from tests.training.volatile.helpers import plan_config


def test_min_iterations_is_the_fewest_that_reach_the_target() -> None:
    conv = ConvergenceModel()
    assert conv.beta == pytest.approx(0.999) and conv.noise_term == pytest.approx(1e-4)
    for n in (2, 3, 8, 16):
        j = conv.min_iterations(1 / n, 0.05)
        assert j is not None
        assert conv.error(j, 1 / n) <= 0.05 < conv.error(j - 1, 1 / n)
        assert conv.max_inv_workers(j, 0.05) >= 1 / n > conv.max_inv_workers(j - 1, 0.05)
    assert conv.min_iterations(1.0, 0.05) is None  # one worker's error floor is 0.1
    assert conv.min_iterations(1 / 4, 2.0) == 1  # A = 1 is already below the target


def test_config_refuses_bad_inputs() -> None:
    with pytest.raises(ValidationError, match="alpha\\*c\\*mu"):
        ConvergenceModel(step_size=10.0, mu=1.0)
    with pytest.raises(ValidationError, match="deadline_hours"):
        plan_config(deadline_hours=0)
    with pytest.raises(ValidationError, match="n_max"):
        plan_config(n_max=0)
    with pytest.raises(ValidationError, match="extra"):
        plan_config(budget=3)
    with pytest.raises(ValidationError):
        plan_config(prices={"kind": "lognormal", "mean": 1})
    c = plan_config()
    with pytest.raises(ValidationError):
        c.deadline_hours = 5  # type: ignore[misc]  # frozen


def test_evaluate_one_and_two_bids_by_hand() -> None:
    c = plan_config(prices=UniformPrices(low=0.0, high=1.0), iteration_seconds=1.0)
    one = evaluate(c, 2, 3600, 0.5)
    # active half the time: 1 h of work takes 2 h; 2 workers x 1 h x E[p | p <= 0.5] = 0.25
    assert one.expected_hours == pytest.approx(2.0) and one.expected_idle_hours == pytest.approx(1.0)
    assert one.expected_cost == pytest.approx(0.5)
    assert one.active_fraction == pytest.approx(0.5)
    two = evaluate(c, 1, 3600, 0.5, low_bid_workers=1, low_bid=0.25)
    # gamma = 0.5: E[1/y] = 0.5/2 + 0.5/1; cost = 1 h x (S(0.5) + S(0.25)) / F(0.5)
    assert two.full_fraction == pytest.approx(0.5)
    assert two.expected_cost == pytest.approx((0.125 + 0.03125) / 0.5)
    conv = c.convergence
    assert two.expected_error == pytest.approx(conv.error(3600, 0.75))
    od = evaluate(c, 4, 3600, None)
    assert od.expected_cost == pytest.approx(4.0) and od.expected_hours == pytest.approx(1.0)
