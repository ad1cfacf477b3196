"""A growing-workers run after the fact: its cost over time, the cost of a prefix, its tracking.

:func:`~mopflow.training.volatile.growing.train_growing` returns a :class:`~mopflow.training.volatile.growing.GrowingResult`;
:func:`cost_curve` and :func:`account_prefix` say what it cost up to any point (e.g. a target accuracy),
and :func:`log_growing_run` logs the config, the per-slot histories and the cost account through the
:class:`~mopflow.base.tracking.Tracker` protocol.
"""

from __future__ import annotations

from mopflow.base.tracking import Tracker
from mopflow.training.volatile.cost import account_run
from mopflow.training.volatile.prices import SECONDS_PER_HOUR
from mopflow.training.volatile.run_account import RunAccount, log_run_account
from studies.growing import GrowingConfig, GrowingResult, Volatility


def account_prefix(
    result: GrowingResult, volatility: Volatility, config: GrowingConfig, iterations: int
) -> RunAccount:
    """The cost account of the run's first ``iterations`` iterations (e.g. up to a target accuracy)."""
    updates = result.updates
    if not 1 <= iterations <= len(updates):
        raise ValueError(f"iterations={iterations}: expected 1..{len(updates)} (the run's iterations)")
    bids = tuple(volatility.bids[: config.schedule.n_max])
    return account_run(
        volatility.trace,
        bids,
        [config.iteration_seconds] * iterations,
        provisioned=[u.provisioned for u in updates[:iterations]],
        start=volatility.start,
    )


def cost_curve(result: GrowingResult, volatility: Volatility, config: GrowingConfig) -> tuple[float, ...]:
    """The run's cumulative cost after each record (slot): the cost over time.

    Each active worker of a slot pays that slot's price for ``iteration_seconds`` (idle slots cost
    nothing), the billing of :func:`mopflow.training.volatile.cost.account_run` on slot-aligned prices: the value after
    iteration j's record equals ``account_prefix(result, volatility, config, j).cost``.
    """
    trace, r = volatility.trace, config.iteration_seconds
    start = volatility.run_start
    total, curve = 0.0, []
    for rec in result.records:
        if rec.active:
            total += trace.prices[trace.index_at(start + rec.slot * r)] * rec.active * r / SECONDS_PER_HOUR
        curve.append(total)
    return tuple(curve)


def config_params(config: GrowingConfig) -> dict[str, object]:
    """The config as flat ``growing_*`` params for tracking."""
    flat: dict[str, object] = {}
    for key, value in config.model_dump().items():
        if isinstance(value, dict):
            flat.update({f"growing_schedule_{k}": v for k, v in value.items()})
        else:
            flat[f"growing_{key}"] = value
    return flat


def log_growing_run(
    tracker: Tracker, run_id: str, config: GrowingConfig, result: GrowingResult
) -> dict[str, float]:
    """Log the config, per-slot histories (n_j, y_j, lr, loss, eval) and the cost account to a tracker."""
    tracker.log_params(run_id, config_params(config))
    records = result.records
    tracker.log_metric_history(run_id, "growing_workers", [(r.slot, float(r.provisioned)) for r in records])
    tracker.log_metric_history(run_id, "growing_active_workers", [(r.slot, float(r.active)) for r in records])
    tracker.log_metric_history(run_id, "growing_lr", [(r.slot, r.lr) for r in records])
    tracker.log_metric_history(
        run_id, "train_loss", [(r.slot, r.loss) for r in records if r.loss is not None]
    )
    tracker.log_metric_history(
        run_id, "eval_accuracy", [(r.slot, r.eval_accuracy) for r in records if r.eval_accuracy is not None]
    )
    summary = {
        "growing_iterations": float(len(result.updates)),
        "growing_idle_slots": float(sum(1 for r in records if r.active == 0)),
        "growing_worker_iterations": float(records[-1].worker_iterations if records else 0),
    }
    if result.final_accuracy is not None:
        summary["eval_accuracy_final"] = result.final_accuracy
    tracker.log_metrics(run_id, summary)
    if result.account is not None:
        summary.update(log_run_account(tracker, run_id, result.account, bids=result.bids))
    return summary
