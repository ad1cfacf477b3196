"""Benchmark: MOP's fixed schedule (a seeded plan per epoch) against the greedy one (whichever
worker frees first takes a unit), in the same run, on the same cluster and data.

What is measured
----------------
``MopExecutor`` trains a set of configurations for a few epochs with ``schedule="fixed"`` and with
``schedule="greedy"`` (``mopflow.training.executors.scheduler.SCHEDULES``), one after the other on
one Dask ``LocalCluster`` (``--workers`` worker processes, one thread each, one partition per
worker), ``--repeats`` times, the order of the two alternating from one repeat to the next so that
a machine getting busier or quieter does not favour either. Before the first timed run, one
untimed epoch of one model loads each worker's partition, which both schedules then share.

Two mixes of configurations (``--mixes``):

* ``mixed``: ``CONFIGS``, 1-D CNNs and MLPs of different widths and depths (unit times differ by
  several times: the fixed plan makes a model wait for its next partition where the greedy queue
  sends it to whichever is free);
* ``uniform``: one configuration (``UNIFORM``) under as many seeds (equal unit times: either
  schedule packs the workers).

Figures per run: ``wall_s`` of ``executor.run`` alone; ``rows_per_s`` = models x epochs x training
rows / wall; ``idle`` = mean over the rounds of ``gantt.idle_fraction``; ``orders``, each model's
partitions in the order it visited them, per round; ``val_acc``, each model's last reported
accuracy. Per mix and schedule the median over the repeats; ``fixed/greedy`` = the ratio of the
median throughputs (1.0: no cost). ``reproduced``: whether every repeat of a schedule trained each
model over the same partitions in the same order and ended with the same accuracies;
``follows_plan`` (fixed): whether every model visited the partitions in the order of
``fixed_plan(seed, models, partitions)`` of the round.

``simulated fixed/greedy`` replays both schedules in the pure scheduler (no Dask, no training) with
each model's median measured unit seconds, the same number of epochs and workers: the cost of the
plan alone, free of the noise of a shared machine.

Output: a table on stdout and every figure in ``benchmarks/results/mop_schedule.json`` (or in
``--out``, a folder or a ``.json`` file; a ``--quick`` run writes its JSON only there), with the
CPU count, load averages and the date. Timings are wall-clock: other processes
running at the same time slow both schedules down; the alternation spreads that over both.

Run it from the repository root::

    .venv/bin/python benchmarks/mop_schedule.py            # 40,000 samples, 8 configs x 3 epochs, 3 repeats, both mixes
    .venv/bin/python benchmarks/mop_schedule.py --quick --out /tmp/bench  # smoke test (under a minute): 3000 samples, 4 configs x 2 epochs x 2 repeats
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studies import harness, mop_replay  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "mop_schedule.json"
SCHEDULE_ORDER = ("greedy", "fixed")
MIXES = ("mixed", "uniform")
COST_LIMIT = 0.05  # the fixed plan may cost up to 5% of greedy's throughput before greedy is worth keeping

# (family, width, depth, lr): the "mixed" configurations, seeds 0.. in this order.
CONFIGS: tuple[tuple[str, int, int, float], ...] = (
    ("cnn", 32, 3, 0.005),
    ("mlp", 64, 2, 0.01),
    ("cnn", 16, 2, 0.01),
    ("mlp", 256, 3, 0.005),
    ("cnn", 32, 2, 0.01),
    ("mlp", 128, 2, 0.005),
    ("cnn", 16, 3, 0.01),
    ("mlp", 64, 3, 0.01),
)
UNIFORM = ("cnn", 16, 2, 0.01)  # the "uniform" mix's one configuration


@dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run."""

    num_samples: int
    n_shards: int
    workers: int
    configs: int
    epochs: int
    repeats: int
    batch_size: int
    mixes: tuple[str, ...]
    seed: int
    quick: bool


def model_specs(settings: Settings, mix: str) -> list[Any]:
    """The mix's configurations as model specs."""
    from mopflow.training.executors import ModelSpec

    specs = []
    for i in range(settings.configs):
        family, width, depth, lr = CONFIGS[i] if mix == "mixed" else UNIFORM
        params = {
            "family": family,
            "width": width,
            "depth": depth,
            "lr": lr,
            "weight_decay": 1e-5,
            "batch_size": settings.batch_size,
        }
        specs.append(ModelSpec(f"m{i}-{family}{width}x{depth}", params, seed=i))
    return specs


def _warm_imports() -> int:
    """Import torch and Lightning in a worker before the clock starts."""
    import pytorch_lightning  # noqa: F401
    import torch  # noqa: F401

    import mopflow.training.executors.units  # noqa: F401
    import mopflow.training.trainable.lit  # noqa: F401

    return os.getpid()


def _orders(epoch_records: dict[int, list[dict[str, Any]]]) -> dict[str, list[list[str]]]:
    """Each model's partitions in the order it visited them, round by round."""
    orders: dict[str, list[list[str]]] = {}
    for index in sorted(epoch_records):
        round_orders: dict[str, list[str]] = {}
        for r in sorted(epoch_records[index], key=lambda r: float(r["start"])):
            round_orders.setdefault(str(r["model"]), []).append(str(r["partition"]))
        for model, order in round_orders.items():
            orders.setdefault(model, []).append(order)
    return orders


def _planned(executor: Any, models: list[str]) -> dict[str, list[list[str]]]:
    """Each model's partitions in the order the fixed plan of each of the executor's rounds gives."""
    from mopflow.training.executors.scheduler import fixed_plan

    plan = fixed_plan(executor.seed, models, executor.partitions)  # every round's (the models stay)
    return {
        model: [[u.partition for units in plan for u in units if u.model == model]]
        * len(executor.epoch_records)
        for model in models
    }


def timed_run(
    client: Any, data: Any, shards: list[str], specs: list[Any], schedule: str, s: Settings
) -> dict[str, Any]:
    """One ``MopExecutor.run`` under ``schedule``; its figures (see the module docstring)."""
    from mopflow.training.executors.gantt import idle_fraction
    from mopflow.training.executors.mop import MopExecutor

    executor = MopExecutor(client, data, shards, seed=s.seed, schedule=schedule)
    train_rows = sum(executor.partition_rows.values())
    started = time.perf_counter()
    outcomes = executor.run(specs, s.epochs)
    wall = time.perf_counter() - started
    rounds = [idle_fraction(v) for v in executor.epoch_records.values() if v]
    unit_s: dict[str, list[float]] = {}
    for r in executor.records:
        unit_s.setdefault(str(r["model"]), []).append(float(r["end"]) - float(r["start"]))
    orders = _orders(executor.epoch_records)
    return {
        "schedule": schedule,
        "follows_plan": orders == _planned(executor, [spec.model_id for spec in specs])
        if schedule == "fixed"
        else None,
        "wall_s": wall,
        "rows_per_s": len(specs) * s.epochs * train_rows / wall,
        "idle": sum(rounds) / len(rounds) if rounds else None,
        "unit_s_median": {m: statistics.median(v) for m, v in sorted(unit_s.items())},
        "orders": orders,
        "val_acc": {m: (o.history[-1].val_acc if o.history else None) for m, o in sorted(outcomes.items())},
        "errors": {m: o.error for m, o in outcomes.items() if o.error},
        "loadavg_after": list(os.getloadavg()),
    }


def simulate(schedule: str, unit_s: dict[str, float], workers: int, epochs: int, seed: int) -> float:
    """Seconds the pure scheduler takes for ``epochs`` epochs of these models over one partition
    per worker, each unit lasting its model's ``unit_s`` (the plan's cost without the noise): rounds
    of one epoch, no unit queued ahead (:func:`studies.mop_replay.replay`)."""
    return mop_replay.replay(unit_s, workers, epochs, 1, seed, schedule, ahead=False).wall_s


def summarize(runs: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Medians per schedule, the throughput ratio, whether each schedule reproduced itself, and
    the simulated ratio from the measured unit times."""
    out: dict[str, Any] = {}
    for schedule in SCHEDULE_ORDER:
        mine = [r for r in runs if r["schedule"] == schedule]
        idle = [r["idle"] for r in mine if r["idle"] is not None]
        out[schedule] = {
            "wall_s": statistics.median(r["wall_s"] for r in mine),
            "rows_per_s": statistics.median(r["rows_per_s"] for r in mine),
            "idle": statistics.median(idle) if idle else None,
            "reproduced": all(
                r["orders"] == mine[0]["orders"] and r["val_acc"] == mine[0]["val_acc"] for r in mine
            )
            if len(mine) > 1
            else None,
            "follows_plan": all(r["follows_plan"] for r in mine) if schedule == "fixed" else None,
        }
    out["fixed_over_greedy"] = out["fixed"]["rows_per_s"] / out["greedy"]["rows_per_s"]
    unit_s: dict[str, float] = {}
    for model in runs[0]["unit_s_median"]:
        unit_s[model] = statistics.median(r["unit_s_median"][model] for r in runs)
    sim = {sch: simulate(sch, unit_s, s.workers, s.epochs, s.seed) for sch in SCHEDULE_ORDER}
    out["simulated_s"] = sim
    out["simulated_fixed_over_greedy"] = sim["greedy"] / sim["fixed"]
    out["unit_s"] = unit_s
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    columns = ["mix", "schedule", "wall_s", "rows_per_s", "idle", "reproduced", "fixed/greedy", "simulated"]
    cells = []
    for mix, m in summary.items():
        for schedule in SCHEDULE_ORDER:
            r = m[schedule]
            ratio = (
                (_fmt(m["fixed_over_greedy"], ".3f"), _fmt(m["simulated_fixed_over_greedy"], ".3f"))
                if schedule == "fixed"
                else ("", "")
            )
            reproduced = "-" if r["reproduced"] is None else ("yes" if r["reproduced"] else "no")
            cells.append(
                [
                    mix,
                    schedule,
                    f"{r['wall_s']:.1f}",
                    f"{r['rows_per_s']:.0f}",
                    _fmt(r["idle"], ".1%"),
                    reproduced,
                    *ratio,
                ]
            )
    return "\n".join(harness.table_lines(columns, cells))


def verdict(summary: dict[str, dict[str, Any]]) -> str:
    """Whether the fixed plan costs more than ``COST_LIMIT`` of greedy's throughput in some mix."""
    mix = min(summary, key=lambda m: summary[m]["fixed_over_greedy"])
    worst = summary[mix]["fixed_over_greedy"]
    if worst < 1.0 - COST_LIMIT:
        outcome = f"the fixed plan costs more than {COST_LIMIT:.0%}: keep mop_schedule=greedy available"
    else:
        outcome = f"the fixed plan costs at most {COST_LIMIT:.0%}"
    simulated = summary[mix]["simulated_fixed_over_greedy"]
    return f"fixed/greedy throughput {worst:.3f} at worst ({mix}; {simulated:.3f} simulated): {outcome}"


def results_file(out: Path | None, quick: bool) -> Path:
    """Where the JSON goes (:func:`studies.harness.results_file`)."""
    return harness.results_file(out, quick, RESULTS_PATH)


def run(s: Settings, out: Path | None) -> int:
    import torch

    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.data import load_manifest, shard_dataset
    from mopflow.training.data.config import DataConfig
    from mopflow.training.executors import DataRef
    from mopflow.training.executors.mop import MopExecutor
    from mopflow.training.executors.units import clear_partitions

    wall_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-mop-schedule-"))
    try:
        with dask_client("", s.workers) as client:
            client.wait_for_workers(s.workers, timeout=120)
            cfg = DataConfig(num_samples=s.num_samples, n_shards=s.n_shards)
            manifest_uri = shard_dataset(cfg, str(work / "data"), client).manifest_uri
            manifest = load_manifest(manifest_uri)
            shards = [str(e["name"]) for e in manifest["splits"]["train"]]
            train_rows = sum(int(e["rows"]) for e in manifest["splits"]["train"])
            data = DataRef.open(manifest_uri)
            client.run(_warm_imports)
            client.run(clear_partitions)
            MopExecutor(client, data, shards, seed=s.seed).run(
                model_specs(s, "uniform")[:1], 1
            )  # load partitions
            print(f"{train_rows} train rows in {len(shards)} shards, {s.workers} workers", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {}
            for mix in s.mixes:
                specs = model_specs(s, mix)
                runs[mix] = []
                for repeat in range(s.repeats):
                    order = SCHEDULE_ORDER if repeat % 2 == 0 else SCHEDULE_ORDER[::-1]
                    for schedule in order:
                        r = timed_run(client, data, shards, specs, schedule, s) | {"repeat": repeat}
                        runs[mix].append(r)
                        print(
                            f"  {mix} #{repeat} {schedule}: {r['wall_s']:.1f}s, {r['rows_per_s']:.0f} rows/s, "
                            f"idle {_fmt(r['idle'], '.1%')}"
                            + (f", errors {r['errors']}" if r["errors"] else ""),
                            flush=True,
                        )
        summary = {mix: summarize(mix_runs, s) for mix, mix_runs in runs.items()}
        header = (
            f"mop_schedule: {s.configs} configs x {s.epochs} epochs, {train_rows} train rows, batch {s.batch_size}, "
            f"{s.workers} workers, {s.repeats} repeat(s), {os.cpu_count()} CPUs"
        )
        table, conclusion = format_table(summary), verdict(summary)
        print(f"\n{header}\n{table}\n\n{conclusion}")
        report = {
            "benchmark": "mop_schedule",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "cpu_count": os.cpu_count(),
                "loadavg_end": list(os.getloadavg()),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
            "settings": asdict(s)
            | {"configs_used": {m: [asdict(sp) for sp in model_specs(s, m)] for m in s.mixes}},
            "data": {
                "train_rows": train_rows,
                "train_shards": shards,
                "manifest_hash": manifest["manifest_hash"],
            },
            "definitions": {
                "rows_per_s": "models x epochs x train rows / wall_s of executor.run (median over repeats)",
                "fixed_over_greedy": "fixed rows_per_s / greedy rows_per_s (medians)",
                "simulated_fixed_over_greedy": "the same ratio from the pure scheduler, each unit lasting its model's median measured unit seconds",
                "idle": "mean over rounds of training.executors.gantt.idle_fraction (median over repeats)",
                "reproduced": "every repeat of the schedule gave each model the same partition orders and final val_acc",
                "follows_plan": "fixed: every model visited the partitions in the order of scheduler.fixed_plan(seed, models, partitions)",
            },
            "summary": summary,
            "runs": runs,
            "verdict": conclusion,
            "total_s": time.perf_counter() - wall_start,
            "printed": [header, table, conclusion],
        }
        harness.write_report(out, report, lead="\n", config=s, seeds=[s.seed])
        print(f"{report['total_s']:.0f}s in all")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__, "3000 samples, 4 configs x 2 epochs x 2 repeats, mixed")
    parser.add_argument("--num-samples", type=int, default=None, help="MNIST-1D samples (default 40000)")
    parser.add_argument("--n-shards", type=int, default=4, help="training shards")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (one partition each)")
    parser.add_argument("--configs", type=int, default=None, help=f"configurations (1..{len(CONFIGS)})")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per model (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each schedule per mix (default 3)")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size of every configuration")
    parser.add_argument("--mixes", default=None, help=f"comma-separated subset of {','.join(MIXES)}")
    parser.add_argument("--seed", type=int, default=0, help="the MOP seed (the fixed plan's)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mixes = tuple(m.strip() for m in (args.mixes or ("mixed" if args.quick else ",".join(MIXES))).split(","))
    if unknown := [m for m in mixes if m not in MIXES]:
        raise SystemExit(f"unknown mixes {unknown}; expected some of {list(MIXES)}")
    configs = args.configs if args.configs is not None else (4 if args.quick else len(CONFIGS))
    if not 1 <= configs <= len(CONFIGS):
        raise SystemExit(f"--configs must be between 1 and {len(CONFIGS)}")
    settings = Settings(
        num_samples=args.num_samples or (3000 if args.quick else 40_000),
        n_shards=args.n_shards,
        workers=args.workers,
        configs=configs,
        epochs=args.epochs or (2 if args.quick else 3),
        repeats=args.repeats or (2 if args.quick else 3),
        batch_size=args.batch_size,
        mixes=mixes,
        seed=args.seed,
        quick=args.quick,
    )
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    return run(settings, results_file(args.out, args.quick))


if __name__ == "__main__":
    sys.exit(main())
