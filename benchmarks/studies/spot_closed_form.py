"""The closed form of Zhang et al. (INFOCOM 2020, Theorem 7) for the on-demand plan: a
cross-check of the planner's exact enumeration (``tests/benchmarks/test_spot_closed_form.py``)."""

from __future__ import annotations

import math

from mopflow.training.volatile.spot_plan_model import ConvergenceModel, PlanError


def theorem7_workers_iterations(
    conv: ConvergenceModel, target: float, max_iterations: int | None = None
) -> tuple[int, int]:
    """The paper's closed form (Theorem 7) for the (n, J) minimising n J, i.e. cost at a fixed price.

    J~ solves ``A x (J ln(1/beta) + 1 - x) / (1 + x (J ln(1/beta) - 1)) = target`` with x = beta^J
    (the stationary point of ``J (1 - x) / (target - A x)``); J* is the better of floor/ceil of J~,
    capped at ``max_iterations`` (the deadline); ``n* = ceil(B (1 - x) / ((1 - beta)(target - A x)))``,
    here with x = beta^(J*) rather than beta^(J~) so that (n*, J*) itself meets the target.
    A cross-check of the enumeration in
    :func:`~mopflow.training.volatile.spot_plan.best_on_demand`, which is exact over integers.
    """
    beta, a, b = conv.beta, conv.initial_gap, conv.noise_term
    if target >= a:
        return 1, 1
    l = math.log(1.0 / beta)  # noqa: E741  (the paper's ln(1/beta))

    def lhs(j: float) -> float:
        x = beta**j
        return a * x * (j * l + 1.0 - x) / (1.0 + x * (j * l - 1.0))

    lo, hi = 1e-9, 1.0
    while lhs(hi) > target:  # lhs falls from A towards 0 as J grows
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if lhs(mid) > target else (lo, mid)
    j_tilde = hi

    def workers(j: float) -> float:
        x = beta**j
        return b * (1.0 - x) / ((1.0 - beta) * (target - a * x))

    candidates = [j for j in (math.floor(j_tilde), math.ceil(j_tilde)) if j >= 1 and a * beta**j < target]
    j_star = min(candidates, key=lambda j: j * workers(j))
    if max_iterations is not None:
        j_star = min(j_star, max_iterations)
    if a * beta**j_star >= target:
        raise PlanError(f"{j_star} iterations cannot reach error {target} with any number of workers")
    return math.ceil(workers(j_star) - 1e-12), j_star
