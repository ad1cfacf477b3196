"""The paper's closed form for the on-demand plan against the planner's exact enumeration."""

from __future__ import annotations

import pytest
from studies.spot_closed_form import theorem7_workers_iterations

from mopflow.training.volatile.spot_plan import best_on_demand
from mopflow.training.volatile.spot_plan_model import ConvergenceModel, Plan
from tests.training.volatile.helpers import plan_config


@pytest.mark.parametrize("target", [0.05, 0.03, 0.02, 0.01, 0.005])
def test_on_demand_enumeration_agrees_with_theorem_7(target: float) -> None:
    # At a fixed price cost is n J: the paper's closed form and the exact integer enumeration must pick
    # the same number of workers, the enumeration never needing more worker-iterations.
    conv = ConvergenceModel()
    n, j = theorem7_workers_iterations(conv, target)
    assert conv.error(j, 1 / n) <= target
    plan = best_on_demand_plan(target)
    assert plan.workers == n
    assert plan.workers * plan.iterations <= n * j <= 1.2 * plan.workers * plan.iterations


def best_on_demand_plan(target: float) -> Plan:
    plan = best_on_demand(plan_config(error_target=target, deadline_hours=1000.0, n_max=256))
    assert plan is not None
    return plan
