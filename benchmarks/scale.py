"""Benchmark: the whole pipeline at N and 10N rows, peak memory of the task process and of the Dask
workers, and wall time.

What is measured
----------------
For each size (``--rows`` N, default 100,000, and ``--factor`` x N) the whole pipeline (shard,
search, ensemble, distill, register) runs as ``mopflow run`` in a fresh subprocess with its own
``MOPFLOW_HOME``, on generated MNIST-1D (``num_samples``), with a small search (``--trials``
trials of ``--epochs`` epochs) and ``--distill-epochs`` student epochs. The training shards grow
with the data (``--rows-per-shard`` rows each), so a shard is the same size at both scales.

- **Task process:** ``mopflow run`` runs every stage in one process; its peak resident memory per
  stage is read from the stage's log line (``<stage>: peak resident memory of the task process``),
  and over the whole run from psutil samples every 0.2 s.
- **Dask workers:** the LocalCluster's worker processes are children of that process; every
  descendant's resident memory is sampled every 0.2 s and the table shows the largest.
- **Wall time** of the whole ``mopflow run``.

Targets (ratios in one run, 10N against N): peak memory of the task process and of each worker
<= 1.5x; wall time <= 11x.

``--big ROWS`` also shards ROWS rows (e.g. 10,000,000) and trains one MOP epoch of one model on
them, reporting the peak memory of the driver and of the workers. ``--big-only`` runs just that and
adds it to the recorded results (the N and 10N runs already in ``scale.json`` stay as they are).

Output: a table on stdout and every figure in ``benchmarks/results/scale.json`` (``--out`` names
another folder or file, and a ``--quick`` run writes there or into a temporary folder).

Run it from the repository root::

    .venv/bin/python benchmarks/scale.py                          # N = 100,000 and 1,000,000
    .venv/bin/python benchmarks/scale.py --quick --out /tmp/bench  # smoke test: 1,000 and 2,000 rows
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studies import harness

REPO_ROOT = Path(__file__).resolve().parents[1]

RESULTS = REPO_ROOT / "benchmarks" / "results" / "scale.json"
MEMORY_GOAL, WALL_GOAL = 1.5, 11.0
STAGE_PEAK = re.compile(r"(\w+): peak resident memory of the task process (\d+) MB")
MB = 2**20


class TreeMemory:
    """Peak resident memory of a process and, separately, of its largest descendant, sampled."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.main_peak = 0
        self.child_peaks: dict[int, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        import psutil

        while not self._done.wait(self.interval_s):
            try:
                main = psutil.Process(self.pid)
                self.main_peak = max(self.main_peak, main.memory_info().rss)
                children = main.children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                try:
                    rss = child.memory_info().rss
                except psutil.Error:
                    continue
                self.child_peaks[child.pid] = max(self.child_peaks.get(child.pid, 0), rss)

    @property
    def worker_peak(self) -> int:
        return max(self.child_peaks.values(), default=0)


def stage_peaks(log_text: str) -> dict[str, int]:
    """Each stage's peak resident memory of the task process (MB), from its log line."""
    return {stage: int(mb) for stage, mb in STAGE_PEAK.findall(log_text)}


def conf_for(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline conf at ``rows`` rows: the shards grow with the data."""
    return {
        "num_samples": rows,
        "n_shards": max(2, rows // args.rows_per_shard),
        "n_trials": args.trials,
        "epochs": args.epochs,
        "min_resource": 1,
        "top_k": min(2, args.trials),
        "distill_epochs": args.distill_epochs,
        "munge_multiplier": 1,
    }


def run_pipeline(rows: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One ``mopflow run`` at ``rows`` rows in its own home; its figures."""
    home = work / f"home-{rows}"
    command = [str(REPO_ROOT / ".venv" / "bin" / "mopflow"), "run", "--verbose"]
    for key, value in conf_for(rows, args).items():
        command += ["--set", f"{key}={value}"]
    # the embedded defaults: no MOPFLOW_*, Airflow or MLflow setting of this shell reaches the run
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_"))}
    env["MOPFLOW_HOME"] = str(home)
    log_path = work / f"run-{rows}.log"
    started = time.monotonic()
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        with TreeMemory(process.pid) as memory:
            returncode = process.wait()
    wall = time.monotonic() - started
    text = log_path.read_text(errors="replace")
    if returncode != 0:
        raise SystemExit(
            f"mopflow run at {rows} rows failed (exit {returncode}); log: {log_path}\n{text[-3000:]}"
        )
    return {
        "rows": rows,
        "conf": conf_for(rows, args),
        "wall_s": round(wall, 1),
        "task_peak_mb": round(memory.main_peak / MB),
        "worker_peak_mb": round(memory.worker_peak / MB),
        "stage_peak_mb": stage_peaks(text),
    }


def ratios(small: Mapping[str, Any], large: Mapping[str, Any]) -> dict[str, float]:
    """Large over small for the task process's and the workers' peaks and the wall time."""
    return {
        "task_memory": round(large["task_peak_mb"] / small["task_peak_mb"], 2),
        "worker_memory": round(large["worker_peak_mb"] / max(small["worker_peak_mb"], 1), 2),
        "wall": round(large["wall_s"] / small["wall_s"], 2),
    }


def verdict(found: Mapping[str, float]) -> dict[str, str]:
    """PASS/FAIL per target."""
    return {
        "task_memory": "PASS" if found["task_memory"] <= MEMORY_GOAL else "FAIL",
        "worker_memory": "PASS" if found["worker_memory"] <= MEMORY_GOAL else "FAIL",
        "wall": "PASS" if found["wall"] <= WALL_GOAL else "FAIL",
    }


def big_run(rows: int, work: Path) -> dict[str, Any]:
    """Shard ``rows`` rows and train one MOP epoch of one model on them; driver and worker peaks."""
    code = f"""
import json, resource, sys
from mopflow.training.compute.cluster import dask_client
from mopflow.training.data.config import DataConfig
from mopflow.training.search.config import SearchConfig
from mopflow.training.data import shard_dataset
from mopflow.training.search.sweep import run_strategy_search
if __name__ == "__main__":
    with dask_client("", 2) as client:
        manifest = shard_dataset(DataConfig(num_samples={rows}, n_shards=max(2, {rows} // 250_000)),
                                 {str(work / "big-data")!r}, client).manifest_uri
        cfg = SearchConfig(n_trials=1, epochs=1, strategy="mop", parallel_trials=1, model_slots=1,
                           pruner="none", sampler="random")
        run_strategy_search(cfg, manifest, "big", {str(work / "big-optuna.log")!r},
                            {str(work / "big-artifacts")!r}, client, min_complete=0)
"""
    script = work / "big_run.py"
    script.write_text(code)
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT)
    with TreeMemory(process.pid) as memory:
        returncode = process.wait()
    if returncode != 0:
        raise SystemExit(f"the {rows}-row sharding and MOP epoch failed (exit {returncode})")
    return {
        "rows": rows,
        "wall_s": round(time.monotonic() - started, 1),
        "driver_peak_mb": round(memory.main_peak / MB),
        "worker_peak_mb": round(memory.worker_peak / MB),
    }


def with_big(result: Mapping[str, Any], big: Mapping[str, Any]) -> dict[str, Any]:
    """``result`` with its big run replaced by ``big`` (dated: it ran apart from the others)."""
    return {**result, "big": {**big, "date": datetime.now(UTC).isoformat(timespec="seconds")}}


def print_table(result: Mapping[str, Any]) -> None:
    columns = ["rows", "wall s", "task peak MB", "worker peak MB", "stage peaks (MB)"]
    cells = [
        [
            run["rows"],
            f"{run['wall_s']:.1f}",
            run["task_peak_mb"],
            run["worker_peak_mb"],
            ", ".join(f"{k} {v}" for k, v in run["stage_peak_mb"].items()),
        ]
        for run in result["runs"]
    ]
    print()
    harness.print_table(columns, cells)
    found, verdicts = result["ratios"], result["verdict"]
    factor = result.get("settings", {}).get("factor", 10)
    print(
        f"\n{factor}N / N: task memory {found['task_memory']:.2f}x ({verdicts['task_memory']}, goal <= {MEMORY_GOAL}), "
        f"worker memory {found['worker_memory']:.2f}x ({verdicts['worker_memory']}, goal <= {MEMORY_GOAL}), "
        f"wall {found['wall']:.2f}x ({verdicts['wall']}, goal <= {WALL_GOAL})"
    )
    if result.get("big"):
        big = result["big"]
        print(
            f"{big['rows']:,} rows sharded + one MOP epoch: {big['wall_s']:.0f} s, "
            f"driver peak {big['driver_peak_mb']} MB, largest worker {big['worker_peak_mb']} MB"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = harness.parser(__doc__, "N = 1,000 and 2N rows, shards of 500 rows")
    parser.add_argument("--rows", type=int, default=None, help="N (default 100,000)")
    parser.add_argument("--factor", type=int, default=None, help="the larger run's rows / N (default 10)")
    parser.add_argument(
        "--rows-per-shard", type=int, default=None, help="training rows per shard (default 25,000)"
    )
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--distill-epochs", type=int, default=1)
    parser.add_argument(
        "--big", type=int, default=0, help="also shard this many rows and train one MOP epoch"
    )
    parser.add_argument(
        "--big-only",
        action="store_true",
        help="run only the --big part and add it to the results already recorded in --out",
    )
    args = parser.parse_args(argv)
    quick = {"rows": 1_000, "factor": 2, "rows_per_shard": 500}
    full = {"rows": 100_000, "factor": 10, "rows_per_shard": 25_000}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = results_file(args.out, args.quick)
    if args.big_only and (args.big <= 0 or args.out is None or not args.out.exists()):
        parser.error(f"--big-only needs --big ROWS > 0 and recorded results in {args.out}")
    return args


def results_file(out: Path | None, quick: bool) -> Path:
    """Where the JSON goes (:func:`studies.harness.results_file`)."""
    return harness.results_file(out, quick, RESULTS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.big_only:
        with tempfile.TemporaryDirectory(prefix="mopflow-bench-scale-") as tmp:
            result = with_big(json.loads(args.out.read_text()), big_run(args.big, Path(tmp)))
        print_table(result)
        harness.write_report(args.out, result, config=result.get("settings"))
        return 0
    with tempfile.TemporaryDirectory(prefix="mopflow-bench-scale-") as tmp:
        work = Path(tmp)
        runs = [run_pipeline(rows, args, work) for rows in (args.rows, args.rows * args.factor)]
        found = ratios(runs[0], runs[1])
        result = {
            "benchmark": "scale",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "goal": f"10N/N: peak memory of the task process and of each worker <= {MEMORY_GOAL}x, wall <= {WALL_GOAL}x",
            "runs": runs,
            "ratios": found,
            "verdict": verdict(found),
            "big": None,
        }
        if args.big:
            result = with_big(result, big_run(args.big, work))
        elif args.out is not None and args.out.exists():  # not rerun: the recorded big run stays
            result["big"] = json.loads(args.out.read_text()).get("big")
    print_table(result)
    harness.write_report(args.out, result, config=result["settings"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
