"""Benchmark: the worker utilisation MOP's schedule allows, replayed in the pure scheduler.

What is measured
----------------
MOP keeps each partition on its worker and moves the models: in every epoch each model visits
every partition once, never on two workers at once, and (under the default ``fixed`` schedule) in
its row's order of the seeded plan. When the models' units differ in length, a worker can run out
of units it may take: the models whose next partition it holds are all busy on the other worker.
This replays the MOP driver's scheduling (``mopflow.training.executors.scheduler.MopScheduler``:
an idle worker takes the schedule's unit, a busy one holds one unit queued ahead of its running
one, a round of ``E`` epochs ends with its last unit) with each unit lasting its model's seconds
and nothing else: no dispatch, no set-up, no coordinator. The utilisation it gives (units'
seconds over workers x wall seconds) is the most a sweep of those unit lengths can reach; what a
measured sweep loses below it goes to the per-unit costs around the passes and between them.

Mixes of unit seconds (one partition per worker, ``--workers`` workers):

* ``uniform``: every model's unit lasts 0.1 s;
* ``one-slow``: one model at 0.30 s a unit and the others at 0.03-0.04 s (the mix of a measured
  `mop` TPE+ASHA search of the search benchmark, seed 0, where one large model trained beside
  three small ones);
* ``search``: each model's unit seconds drawn from :data:`SEARCH_UNIT_S`, the median unit seconds
  of the 20 models of a measured `mop` random search of the search benchmark (seed 0: MLPs and
  1-D CNNs of its space, 0.036 to 0.188 s a unit), ``--draws`` draws per cell, the mean reported.

For each mix, number of models (``--models``) and epochs per round (``--round-epochs``: 1 is a
pruner that may stop a model after any epoch, or ASHA's rungs with models at different epochs; 10
is a round between rare decisions), the replayed utilisation under the ``fixed`` and ``greedy``
schedules. Beside them, for each mix and number of models, the utilisation with no rounds
(:func:`studies.mop_replay.replay_without_rounds`): every model starts its next epoch as soon as
its last ends, whatever the others do, visiting the partitions in a fixed cycle
(``no_rounds_cycle``) or in any order within an epoch (``no_rounds_any_order``). MOP's rule that a
model visits each partition once an epoch, on one worker at a time, holds in both; what they lift
is the round, which keeps the models in step epoch by epoch.

Output: a table on stdout and every figure in ``benchmarks/results/mop_bound.json`` (or ``--out``;
a ``--quick`` run writes its JSON only there). No training and no cluster: it takes seconds.

Run it from the repository root::

    .venv/bin/python benchmarks/mop_bound.py
    .venv/bin/python benchmarks/mop_bound.py --quick --out /tmp/bench
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studies import harness, mop_replay  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "mop_bound.json"
SCHEDULES = ("fixed", "greedy")
# no rounds: a model starts its next epoch as soon as its last ends; column -> any order in an epoch
UNLOCKED = {"no_rounds_cycle": False, "no_rounds_any_order": True}
ROUNDS = 4  # rounds replayed per draw: enough for the plan's cycle to repeat


def _uniform(models: int, rng: random.Random) -> dict[str, float]:
    return {f"m{i}": 0.1 for i in range(models)}


def _one_slow(models: int, rng: random.Random) -> dict[str, float]:
    fast = [0.03, 0.04, 0.035]
    return {"m0": 0.30} | {f"m{i}": fast[(i - 1) % len(fast)] for i in range(1, models)}


# Median seconds of a unit (half an epoch, set-up included) of each model of the search
# benchmark's `mop` random search, seed 0, measured on the 2-CPU machine on 2026-11-28.
SEARCH_UNIT_S = (
    0.036, 0.036, 0.037, 0.039, 0.041, 0.043, 0.043, 0.051, 0.051, 0.054,
    0.056, 0.079, 0.082, 0.093, 0.110, 0.117, 0.131, 0.151, 0.155, 0.188,
)  # fmt: skip


def _search(models: int, rng: random.Random) -> dict[str, float]:
    return {f"m{i}": rng.choice(SEARCH_UNIT_S) for i in range(models)}


# mix -> its unit seconds per model, drawn from an RNG (fixed mixes ignore it)
MIXES: dict[str, Callable[[int, random.Random], dict[str, float]]] = {
    "uniform": _uniform,
    "one-slow": _one_slow,
    "search": _search,
}
DRAWN = ("search",)  # mixes whose cells average several draws


def replay(
    unit_s: Mapping[str, float], workers: int, round_epochs: int, seed: int = 0, schedule: str = "fixed"
) -> float:
    """Utilisation of ``workers`` workers over ``ROUNDS`` rounds of ``round_epochs`` epochs of
    these models, each unit lasting its model's ``unit_s``, scheduled as the MOP driver does
    (:func:`studies.mop_replay.replay`, a unit queued ahead of each running one)."""
    return mop_replay.replay(unit_s, workers, ROUNDS, round_epochs, seed, schedule).utilisation


def _over_draws(
    mix: str, models: int, draws: int, utilisation: Callable[[dict[str, float], int], float]
) -> float:
    """``utilisation`` of the mix's unit seconds (and the draw), the mean over ``draws`` draws for a
    drawn mix."""
    n = draws if mix in DRAWN else 1
    return statistics.mean(utilisation(MIXES[mix](models, random.Random(draw)), draw) for draw in range(n))


def cell(mix: str, models: int, round_epochs: int, workers: int, draws: int, schedule: str) -> float:
    """The mix's replayed utilisation, the mean over ``draws`` draws for a drawn mix."""
    return _over_draws(
        mix, models, draws, lambda unit_s, draw: replay(unit_s, workers, round_epochs, draw, schedule)
    )


def unlocked_cell(mix: str, models: int, workers: int, draws: int, any_order: bool) -> float:
    """The mix's utilisation with no rounds (:func:`studies.mop_replay.replay_without_rounds`), the
    mean over ``draws`` draws for a drawn mix."""
    return _over_draws(
        mix,
        models,
        draws,
        lambda unit_s, _: mop_replay.replay_without_rounds(unit_s, workers, any_order=any_order).utilisation,
    )


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (mix, models, epochs per round) cell under each schedule, and each (mix, models)
    with no rounds (models in their partitions' cycle, or in any order)."""
    unlocked = {
        (mix, models): {
            name: round(unlocked_cell(mix, models, args.workers, args.draws, any_order), 3)
            for name, any_order in UNLOCKED.items()
        }
        for mix in args.mixes
        for models in args.models
    }
    return [
        {"mix": mix, "models": models, "round_epochs": epochs}
        | {
            schedule: round(cell(mix, models, epochs, args.workers, args.draws, schedule), 3)
            for schedule in SCHEDULES
        }
        | unlocked[(mix, models)]
        for mix in args.mixes
        for models in args.models
        for epochs in args.round_epochs
    ]


def table_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    columns = (*SCHEDULES, *UNLOCKED)
    cells = [[r["mix"], r["models"], r["round_epochs"], *(f"{r[c]:.3f}" for c in columns)] for r in rows]
    return harness.table_lines(["mix", "models", "epochs/round", *columns], cells)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__, "4 and 6 models, 10 draws")
    parser.add_argument("--workers", type=int, default=2, help="workers (one partition each)")
    parser.add_argument(
        "--models", type=_ints, default=None, help="comma-separated model counts (default 2,3,4,6,8)"
    )
    parser.add_argument(
        "--round-epochs", type=_ints, default=[1, 3, 10], help="comma-separated epochs per round"
    )
    parser.add_argument("--draws", type=int, default=None, help="draws per cell of a drawn mix (default 200)")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, from {', '.join(MIXES)}")
    args = parser.parse_args(argv)
    args.models = args.models or ([4, 6] if args.quick else [2, 3, 4, 6, 8])
    args.draws = args.draws or (10 if args.quick else 200)
    args.mixes = [m for m in args.mixes.split(",") if m]
    unknown = sorted(set(args.mixes) - set(MIXES))
    if unknown:
        parser.error(f"unknown mix(es) {', '.join(unknown)}; expected some of {', '.join(MIXES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    lines = table_lines(rows)
    print("\n".join(lines))
    report = {
        "benchmark": "mop_bound",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"rounds": ROUNDS},
        "definitions": {
            "fixed, greedy": "units' seconds / (workers x wall seconds) of the replayed schedule, no per-unit cost",
            "no_rounds_cycle, no_rounds_any_order": "the same with no rounds: each model starts its next "
            "epoch as soon as its last ends, visiting the partitions in a fixed cycle or in any order "
            "within an epoch (independent of epochs/round)",
        },
        "rows": rows,
        "printed": lines,
    }
    out = harness.results_file(args.out, args.quick, RESULTS_PATH)
    harness.write_report(out, report, lead="\n", config=report["settings"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
