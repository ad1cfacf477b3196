"""``mopflow plan-spot``: plan a run on spot workers from a price distribution or a price trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from mopflow.infra.cli.errors import CliError


def _spot_prices(args: argparse.Namespace) -> Any:
    """The price distribution named by the plan-spot flags (a trace gives its empirical distribution)."""
    from mopflow.training.volatile.price_trace import empirical_prices, load_price_trace
    from mopflow.training.volatile.prices import GaussianPrices, UniformPrices

    if args.trace:
        return empirical_prices(load_price_trace(args.trace))
    if args.distribution == "uniform":
        if args.low is None or args.high is None:
            raise CliError("--distribution uniform needs --low and --high (prices per worker-hour)")
        return UniformPrices(low=args.low, high=args.high)
    if args.mean is None or args.std is None:
        raise CliError("--distribution gaussian needs --mean and --std (prices per worker-hour)")
    return GaussianPrices(mean=args.mean, std=args.std)


def cmd_plan_spot(args: argparse.Namespace) -> int:
    """Print the cheapest plan that meets the deadline and error target (and write it as JSON)."""
    from pydantic import ValidationError

    from mopflow.training.volatile.prices import PriceError
    from mopflow.training.volatile.spot_plan import plan_spot
    from mopflow.training.volatile.spot_plan_model import PlanError, SpotPlanConfig
    from mopflow.training.volatile.spot_plan_report import format_report, report_as_dict

    constants: dict[str, Any] = {}
    for item in args.convergence or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--convergence expects KEY=VALUE, got {item!r}")
        constants[key.strip()] = yaml.safe_load(value)
    try:
        config = SpotPlanConfig(
            prices=_spot_prices(args),
            deadline_hours=args.deadline_hours,
            error_target=args.error_target,
            n_max=args.n_max,
            on_demand_price=args.on_demand_price,
            iteration_seconds=args.iteration_seconds,
            max_bid=args.max_bid,
            convergence=constants,
        )
        report = plan_spot(config)
    except ValidationError as exc:
        raise CliError("invalid plan-spot input: " + flag_errors(exc, args)) from exc
    except (PriceError, PlanError) as exc:
        raise CliError(str(exc)) from exc
    print(format_report(config, report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report_as_dict(config, report), indent=2, sort_keys=True))
    return 0


def flag_errors(exc: Any, args: argparse.Namespace) -> str:
    """A plan's validation errors named by the flags that gave the values (``--deadline-hours``,
    ``--low``, ``--convergence step_size``), not by the plan's fields."""
    problems = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        if not loc:  # the price distribution as a whole
            flag = "--low/--high" if args.distribution == "uniform" else "--mean/--std"
        elif loc[:1] == ["convergence"]:
            flag = "--convergence " + (loc[1] if len(loc) > 1 else "")
        else:
            field = loc[1] if loc[:1] == ["prices"] and len(loc) > 1 else (loc[0] if loc else "input")
            flag = "--" + field.replace("_", "-")
        message = str(err["msg"]).removeprefix("Value error, ")
        shown = f" (got {err['input']!r})" if not isinstance(err.get("input"), dict | list) else ""
        problems.append(f"{flag.strip()}: {message}{shown}")
    return "; ".join(problems)
