"""A spot plan as the operator sees it: the table ``mopflow plan-spot`` prints and its JSON form."""

from __future__ import annotations

from dataclasses import asdict

from mopflow.training.volatile.spot_plan_model import STRATEGIES, Plan, PlanReport, SpotPlanConfig


def format_report(config: SpotPlanConfig, report: PlanReport) -> str:
    """The table that ``mopflow plan-spot`` prints."""
    lines = [
        f"prices: {describe_prices(config)}; on-demand {config.on_demand_price:g}/worker-hour; bid cap {config.bid_cap:g}",
        f"target: error <= {config.error_target:g} within {config.deadline_hours:g} h; n_max {config.n_max};"
        f" {config.iteration_seconds:g} s/iteration; beta {config.convergence.beta:.6g},"
        f" B {config.convergence.noise_term:.4g}, A {config.convergence.initial_gap:g}",
        "",
        f"{'strategy':10} {'workers':>11} {'bids (high/low)':>17} {'iterations':>10} {'E[hours]':>9}"
        f" {'E[idle h]':>9} {'E[cost]':>10} {'E[error]':>9} {'active':>7}",
    ]
    for strategy in STRATEGIES:
        plan = report.options[strategy]
        if plan is None:
            lines.append(f"{strategy:10} infeasible: {report.reasons.get(strategy, '')}")
            continue
        workers = f"{plan.high_bid_workers}" + (f"+{plan.low_bid_workers}" if plan.low_bid_workers else "")
        bids = "-" if plan.high_bid is None else f"{plan.high_bid:.4g}"
        if plan.low_bid is not None:
            bids += f"/{plan.low_bid:.4g}"
        lines.append(
            f"{strategy:10} {workers:>11} {bids:>17} {plan.iterations:>10} {plan.expected_hours:>9.3f}"
            f" {plan.expected_idle_hours:>9.3f} {plan.expected_cost:>10.4f} {plan.expected_error:>9.4f}"
            f" {plan.active_fraction:>7.1%}"
        )
    c = report.chosen
    lines.append("")
    if c.high_bid is None:
        what = f"{c.workers} on-demand workers"
    elif c.low_bid is None:
        what = f"{c.workers} spot workers bidding {c.high_bid:.4g}"
    else:
        what = f"{c.high_bid_workers} spot workers bidding {c.high_bid:.4g} and {c.low_bid_workers} bidding {c.low_bid:.4g}"
    od = report.options["on-demand"]
    saving = f" ({1 - c.expected_cost / od.expected_cost:.0%} below on-demand)" if od and c is not od else ""
    lines.append(
        f"plan: {c.strategy} - {what} for {c.iterations} iterations; expected cost {c.expected_cost:.4f}"
        f"{saving}, expected completion {c.expected_hours:.3f} h"
    )
    return "\n".join(lines)


def describe_prices(config: SpotPlanConfig) -> str:
    """One line naming the price distribution."""
    p = config.prices
    if p.kind == "uniform":
        return f"uniform on [{p.low:g}, {p.high:g}]"
    if p.kind == "gaussian":
        return f"Gaussian mean {p.mean:g}, std {p.std:g} (truncated at 0)"
    return f"empirical, {len(p.prices)} distinct prices in [{p.prices[0]:g}, {p.prices[-1]:g}]"


def report_as_dict(config: SpotPlanConfig, report: PlanReport) -> dict[str, object]:
    """The report as plain data (JSON output of ``mopflow plan-spot --json``)."""

    def plan_dict(plan: Plan | None) -> dict[str, object] | None:
        return None if plan is None else {**asdict(plan), "workers": plan.workers}

    return {
        "config": config.model_dump(mode="json"),
        "chosen": plan_dict(report.chosen),
        "options": {s: plan_dict(p) for s, p in report.options.items()},
        "reasons": dict(report.reasons),
    }
