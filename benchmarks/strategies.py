"""Benchmark of the execution strategies for training many models: sequential, task, mop, ddp,
and the model-averaging baseline.

What is measured
----------------
8 fixed configurations (small 1-D CNNs and MLPs, ``CONFIGS``; seeds 0..7, batch 256, AdamW with
weight decay 1e-5) are trained for 4 epochs each on MNIST-1D by every strategy in
``mopflow.training.executors``:

* ``sequential``: ``SequentialExecutor``, one model after another in one process.
* ``task``: ``TaskExecutor`` on a fresh 2-worker Dask ``LocalCluster``: one model-epoch per
  task over all training shards, at most one model per worker.
* ``mop``: ``MopExecutor`` on a fresh 2-worker ``LocalCluster``: the training shards are split
  into one partition per worker and model states hop between the workers (Cerebro's model
  hopper parallelism).
* ``ddp``: ``DDPExecutor(world_size=2)`` on a fresh 2-worker ``LocalCluster``: each model's 2
  ranks run in the 2 Dask worker processes, over gloo.
* ``averaging``: ``ModelAveragingExecutor`` on a fresh 2-worker ``LocalCluster`` (the Cerebro
  paper's "MA" baseline): the same partitions as MOP; each epoch a copy of the model trains on
  each partition at once, from the same weights, and the copies are averaged. Not a strategy of
  the search: a baseline here.
* ``ddp_trials`` and ``ddp_one_at_a_time``: ``DDPExecutor(world_size=2)`` on a fresh 4-worker
  ``LocalCluster`` (one thread per worker): as many trials at once as gangs of 2 workers fit (2),
  or one (``max_trials=1``). With 8 configurations, trials wait for a gang. Compared by each
  worker's idle fraction (``benchmarks/studies/ddp_gangs.py``).

Data: ``DataConfig(num_samples=142_000, partition_rows=50_000, n_shards=4)`` (>= 100,000
training rows; the row counts are read from the manifest) is sharded once with
``mopflow.training.data.shard_dataset`` into a temporary data root and reused by every strategy.

Each strategy runs in its own subprocess (this script re-invoked with ``--run-strategy``), so
that none inherits another's partition cache, and under a wall-clock limit (``--timeout-s``):
on expiry the subprocess and all its descendants are killed by pid and the strategy is
reported as failed. For the strategies on Dask, the cluster start-up and the workers' first
import of torch/Lightning happen before the clock starts; the clock covers ``executor.run`` only.
``--quick`` runs every strategy in one subprocess on one shared cluster instead (its timings
are not comparable; it checks that everything runs).

Figures per strategy
--------------------
* ``wall_s``: wall time of ``executor.run``; ``per_epoch_s`` = wall / epochs;
  ``rows_per_s`` (throughput) = configs x epochs x training rows / wall.
* ``footprint``: bytes of training data materialised across processes. ``sequential``:
  ``units.cached_bytes()`` of the benchmark subprocess (measured). ``task``/``mop``/``averaging``:
  the sum of ``client.run(units.cached_bytes)`` over the workers after the run (measured).
  ``ddp``: every rank loads the full training split (``ddp_rank``), so world_size x rows x
  (40 float32 + 1 int64) bytes (computed, not measured).
* ``moved``: bytes moved between processes. ``sequential``: 0 (one process).
  ``task``/``mop``/``averaging``: 2 x the sum of ``record["state_bytes"]`` over the executor's
  records (each unit's state goes to the worker and comes back; measured payload sizes, Dask's
  framing not counted; for ``averaging`` the averaged state sent once more per model-epoch to be
  validated is not counted). ``ddp``: the gradient bytes every rank handed to the all-reduce,
  counted in the DDP comm hook (measured; a ring all-reduce puts about 2(W-1)/W of them on the
  wire).
* ``val_acc_mean``: mean over the 8 models of the final state's validation accuracy
  (``units.evaluate_state`` on the returned state, the same function for every strategy).
* ``curves``: each model's validation accuracy after every epoch, from the ``EpochReport`` s in
  its outcome's ``history`` (every executor appends the report it hands the controller there);
  ``curve``: per epoch, their mean, standard deviation, minimum and maximum across the models.
* ``gap_points``: after the last epoch, the mean over the models of (the strategy's accuracy -
  sequential's accuracy of the same configuration), in points (models that did not finish every
  epoch under both are left out; ``gap_models`` counts the rest).
* ``idle`` (mop only): mean over MOP rounds of ``gantt.idle_fraction`` of that round's records.
* ``worker_idle`` (the DDP rows): per worker, 1 - busy / wall, busy being the summed spans of the
  executor's records whose gang includes the worker, clipped to the sweep's wall interval;
  ``worker_idle_max`` and ``worker_idle_mean`` over the workers. A scheduling measure: it keeps
  its meaning on a machine with fewer cores than workers.
* ``cpu`` (every strategy): CPU seconds during the timed run, from psutil: the
  strategy subprocess (the coordinator), its live descendants (Dask nannies and workers), and
  ``other_s`` = machine busy time less both (other jobs on a shared host). Not a target: it
  tells a strategy that did more work (more worker seconds for the same rows) from one that got
  less of the machine (more ``other_s``).

Targets (from the Cerebro paper; printed as PASS/FAIL)
------------------------------------------------------
MOP >= 0.9x the task-parallel throughput, <= 1/2 of its data footprint, >= 1.5x the DDP
throughput, idle fraction <= 10%, accuracy after the last epoch within 0.5 points of sequential.
Model averaging's gap to sequential is reported as measured (MEASURED; the paper finds that MA
lags, and the line says whether it does here: by more than 0.5 points).
DDP concurrent trials: no worker idle for more than 10% of the sweep; one trial at a time's figure
beside it (MEASURED), and the throughput gain the two rows' busy worker fractions imply where every
worker has a core of its own (EXPECTED; with fewer cores than workers it is not measured).

Output: a plain-text table on stdout, the accuracy by epoch, the target lines, and in the
``--out`` folder (default ``benchmarks/results/``) every figure in ``strategies.json`` (with the
CPU count, load averages and the date) and the learning curves in ``strategies_curves.png``
(per strategy, the mean across the configurations and their range); ``--out`` may instead name
the JSON file (``results/strategies_ddp_trials.json``: the PNG goes beside it, named after it), so
that a run of some strategies leaves the recorded ``strategies.json`` as it is. ``--note`` is
stored in the JSON and printed (e.g. that the machine was shared). ``--quick`` never writes over
the committed results: without ``--out`` it writes to a new temporary folder. Timings are
wall-clock on a shared machine: other processes running at the same time slow every strategy down.

On a GPU machine ``--device cuda`` trains every strategy on the GPU (task, mop and averaging
workers each see the GPU and declare the Dask resource ``GPU``; DDP runs over nccl on up to 2
GPUs) and writes ``strategies-cuda.json`` and ``strategies-cuda_curves.png``;
``--trials-per-gpu 1,2,4,8`` then also runs ``task`` with that many worker processes sharing
each GPU and reports trials/s relative to 1.

Run it from the repository root::

    .venv/bin/python benchmarks/strategies.py            # full size (~2-3 minutes on 2 quiet cores)
    .venv/bin/python benchmarks/strategies.py --quick    # smoke test: 3000 samples, 2 configs, 2 epochs
    .venv/bin/python benchmarks/strategies.py --strategies ddp_trials,ddp_one_at_a_time \
        --out benchmarks/results/strategies_ddp_trials.json
    .venv/bin/python benchmarks/strategies.py --strategies mop,averaging --epochs 2 --out /tmp/s
    python benchmarks/strategies.py --device cuda --num-samples 1000000 --trials-per-gpu 1,2,4,8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

from studies import ddp_gangs, harness  # noqa: E402

from mopflow.training.compute.workers import cluster_workers  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
STRATEGY_ORDER = ("sequential", "task", "mop", "ddp", "averaging", *ddp_gangs.ROWS)
N_WORKERS = 2
DDP_WORLD_SIZE = 2
MB = 1024 * 1024
N_FEATURES = 40
BYTES_PER_ROW = N_FEATURES * 4 + 8  # float32 features + int64 label

# The 8 configurations: (family, width, depth, lr). Seeds are 0..7 in this order.
CONFIGS: tuple[tuple[str, int, int, float], ...] = (
    ("cnn", 16, 2, 0.01),
    ("cnn", 32, 2, 0.01),
    ("cnn", 16, 3, 0.01),
    ("cnn", 32, 3, 0.005),
    ("mlp", 64, 2, 0.01),
    ("mlp", 128, 2, 0.005),
    ("mlp", 64, 3, 0.01),
    ("mlp", 128, 3, 0.005),
)

TARGET_TASK_THROUGHPUT = 0.9
TARGET_FOOTPRINT = 0.5
TARGET_DDP_THROUGHPUT = 1.5
TARGET_IDLE = 0.10
TARGET_ACC_POINTS = 0.5  # MOP's gap to sequential after the last epoch; beyond it, averaging "lags"


@dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run."""

    num_samples: int
    n_shards: int
    configs: int
    epochs: int
    batch_size: int
    weight_decay: float
    strategies: tuple[str, ...]
    timeout_s: float
    quick: bool
    device: str = "cpu"  # cpu | cuda
    trials_per_gpu: tuple[int, ...] = ()  # cuda: the task strategy again with k workers per GPU
    name: str = ""  # the output files' name when --out names the JSON file
    note: str = ""  # stored in the JSON and printed (--note)

    @property
    def stem(self) -> str:
        """The name of the output files."""
        return self.name or ("strategies-cuda" if self.device == "cuda" else "strategies")


def model_specs(settings: Settings) -> list[dict[str, Any]]:
    """The configurations as ``ModelSpec`` fields (plain dicts: they travel as JSON)."""
    specs = []
    for seed, (family, width, depth, lr) in enumerate(CONFIGS[: settings.configs]):
        params = {
            "family": family,
            "width": width,
            "depth": depth,
            "lr": lr,
            "weight_decay": settings.weight_decay,
            "batch_size": settings.batch_size,
        }
        device = {"accelerator": "gpu" if settings.device == "cuda" else "cpu", "precision": "32"}
        specs.append(
            {"model_id": f"m{seed}-{family}{width}x{depth}", "params": params, "seed": seed, "device": device}
        )
    return specs


# ---------------------------------------------------------------------------------------------
# The strategies (each in its own subprocess; with --quick, all in one)


def _warm_imports() -> int:
    """Import torch and Lightning in a worker before the clock starts (every strategy pays it once)."""
    import pytorch_lightning  # noqa: F401
    import torch  # noqa: F401

    import mopflow.training.executors.units  # noqa: F401
    import mopflow.training.trainable.lit  # noqa: F401

    return os.getpid()


def _accuracy(outcomes: dict[str, Any], specs: Sequence[Any], data: Any) -> dict[str, Any]:
    """Validation accuracy of each model's returned state, its last reported accuracy and its
    learning curve (the accuracy reported after every epoch)."""
    from mopflow.training.executors.units import evaluate_state

    acc: dict[str, float | None] = {}
    reported: dict[str, float | None] = {}
    curves: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    epochs_done: dict[str, int] = {}
    for spec in specs:
        outcome = outcomes.get(spec.model_id)
        if outcome is None:
            errors[spec.model_id] = "no outcome"
            acc[spec.model_id] = reported[spec.model_id] = None
            continue
        if outcome.error:
            errors[spec.model_id] = str(outcome.error)[-500:]
        epochs_done[spec.model_id] = outcome.epochs_done
        curves[spec.model_id] = [float(r.val_acc) for r in outcome.history]
        reported[spec.model_id] = outcome.history[-1].val_acc if outcome.history else None
        acc[spec.model_id] = evaluate_state(spec, outcome.state, data) if outcome.state else None
    return {
        "val_acc": acc,
        "reported_val_acc": reported,
        "curves": curves,
        "errors": errors,
        "epochs_done": epochs_done,
    }


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far: the whole machine (busy, i.e. all but idle and iowait), this process
    (the driver/coordinator) and its live descendants (Dask nannies and workers)."""
    import psutil

    machine = psutil.cpu_times()
    me = psutil.Process()
    own = me.cpu_times()
    below = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = child.cpu_times()
            below += t.user + t.system
    busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    return {"machine_busy_s": busy, "coordinator_s": own.user + own.system, "descendants_s": below}


def _cpu_delta(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Where the CPU went during the timed run; ``other_s``: processes outside this benchmark
    (other jobs on a shared machine) that competed with the workers."""
    d = {k: after[k] - before[k] for k in before}
    d["other_s"] = max(0.0, d["machine_busy_s"] - d["coordinator_s"] - d["descendants_s"])
    d["capacity_s"] = wall_s * (os.cpu_count() or 1)
    return d


def _state_traffic(records: Sequence[dict[str, Any]]) -> int:
    return 2 * sum(int(r.get("state_bytes", 0)) for r in records)


def _records_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Busy time and partition-loading time of the training units."""
    busy = sum(float(r["end"]) - float(r["start"]) for r in records)
    loading = sum(float(r.get("load_end", r["start"])) - float(r["start"]) for r in records)
    return {"units": len(records), "busy_s": busy, "setup_and_load_s": loading}


@contextlib.contextmanager
def _cluster(job: dict[str, Any], shared: Any, n_workers: int = N_WORKERS) -> Iterator[tuple[Any, float]]:
    """A client with warm workers whose partition caches are empty, and the seconds it took: the
    shared one (``--quick``), else a fresh LocalCluster closed on exit."""
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.executors.units import clear_partitions

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        client = shared
        if client is None:
            on_gpu = job.get("device") == "cuda"
            client = stack.enter_context(
                dask_client(
                    "",
                    n_workers,
                    accelerator="gpu" if on_gpu else "cpu",
                    trials_per_gpu=int(job.get("trials_per_gpu", 1)),
                )
            )
            client.run(_warm_imports)
        client.run(clear_partitions)
        yield client, time.perf_counter() - started


def _timed_run(executor: Any, specs: Sequence[Any], epochs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``executor.run`` under the clock and the CPU accounting: its outcomes and figures."""
    cpu_before = _cpu_snapshot()
    started = time.perf_counter()
    outcomes = executor.run(specs, epochs)
    wall_s = time.perf_counter() - started
    return outcomes, {"wall_s": wall_s, "cpu": _cpu_delta(cpu_before, _cpu_snapshot(), wall_s)}


def _run_sequential(name: str, job: dict[str, Any], specs: list[Any], data: Any, shared: Any) -> Any:
    """One model after another in this process."""
    from baselines.sequential import SequentialExecutor

    from mopflow.training.executors.units import cached_bytes, clear_partitions

    _warm_imports()
    clear_partitions()
    executor = SequentialExecutor(data, job["shards"])
    outcomes, result = _timed_run(executor, specs, int(job["epochs"]))
    result |= {
        "footprint_bytes": cached_bytes(),
        "footprint_method": "measured: units.cached_bytes() of the one training process",
        "moved_bytes": 0,
        "moved_method": "none: every model trains in one process",
        "moved_is_estimate": False,
        "records": _records_summary(executor.records),
    }
    return outcomes, result


def _executor_on_workers(name: str, client: Any, data: Any, shards: list[str]) -> Any:
    """The executor of a strategy whose units run on the Dask workers."""
    from baselines.averaging import ModelAveragingExecutor

    from mopflow.training.executors.mop import MopExecutor
    from mopflow.training.executors.task import TaskExecutor

    makers = {
        "task": lambda: TaskExecutor(client, data, shards),
        "mop": lambda: MopExecutor(client, data, shards, seed=0),
        "averaging": lambda: ModelAveragingExecutor(client, data, shards),
    }
    return makers[name]()


def _run_on_workers(name: str, job: dict[str, Any], specs: list[Any], data: Any, shared: Any) -> Any:
    """Task, MOP or model averaging: units on the Dask workers, states to them and back."""
    from mopflow.training.executors.gantt import idle_fraction
    from mopflow.training.executors.units import cached_bytes

    with _cluster(job, shared) as (client, start_s):
        workers = len(cluster_workers(client))
        executor = _executor_on_workers(name, client, data, job["shards"])
        outcomes, result = _timed_run(executor, specs, int(job["epochs"]))
        per_worker = client.run(cached_bytes)
    result |= {
        "workers": workers,
        "cluster_start_s": start_s,
        "footprint_bytes": int(sum(per_worker.values())),
        "footprint_per_worker_bytes": {str(k): int(v) for k, v in per_worker.items()},
        "footprint_method": "measured: sum over the Dask workers of client.run(units.cached_bytes) after the run",
        "moved_bytes": _state_traffic(executor.records),
        "moved_method": (
            "measured payload: 2 x sum of record['state_bytes'] over the executor's records "
            "(model state to the worker and back per unit; Dask framing not counted)"
        ),
        "moved_is_estimate": False,
        "records": _records_summary(executor.records),
    }
    if hasattr(executor, "partitions"):
        result["partitions"] = executor.partitions
    # Share of worker-time idle over the whole run (validation between rounds counts as idle).
    result["run_idle_fraction"] = max(0.0, 1.0 - result["records"]["busy_s"] / (result["wall_s"] * workers))
    if name == "mop":
        rounds = {int(k): idle_fraction(v) for k, v in executor.epoch_records.items() if v}
        result["idle_per_round"] = rounds
        result["idle_fraction"] = sum(rounds.values()) / len(rounds) if rounds else None
        result["round_span_s"] = {
            int(k): max(float(r["end"]) for r in v) - min(float(r["start"]) for r in v)
            for k, v in executor.epoch_records.items()
            if v
        }
    else:
        result["idle_fraction_all_records"] = idle_fraction(executor.records)
    return outcomes, result


def _run_ddp(name: str, job: dict[str, Any], specs: list[Any], data: Any, shared: Any) -> Any:
    """Each model's W ranks in W Dask workers: ``ddp`` on W workers, one model after another;
    the gang rows (``ddp_gangs.ROWS``) on ``ddp_gangs.WORKERS`` workers, as many models at once
    as the row allows."""
    from mopflow.training.executors.ddp import DDPExecutor

    world = DDP_WORLD_SIZE
    if job.get("device") == "cuda":  # nccl: one rank per GPU
        import torch

        world = max(1, min(DDP_WORLD_SIZE, torch.cuda.device_count()))
    gangs = name in ddp_gangs.ROWS and job.get("device") != "cuda"
    n_workers = ddp_gangs.WORKERS if gangs else world
    with _cluster(job | {"trials_per_gpu": 1}, shared, n_workers) as (client, _):
        client.wait_for_workers(n_workers, timeout=120)
        executor = DDPExecutor(
            client,
            data,
            world_size=world,
            epoch_timeout_s=float(job["ddp_epoch_timeout_s"]),
            max_trials=ddp_gangs.ROWS.get(name),
        )
        workers = list(cluster_workers(client))
        sweep_start = time.time()
        outcomes, result = _timed_run(executor, specs, int(job["epochs"]))
        result |= ddp_gangs.idle_figures(executor.records, workers, sweep_start, time.time())
    train_rows = int(job["train_rows"])
    at_once = ddp_gangs.trials_at_once(name, len(workers), world) if name in ddp_gangs.ROWS else 1
    result |= {
        "world_size": world,
        "workers": len(workers),
        "trials_at_once": at_once,
        "footprint_bytes": at_once * world * train_rows * BYTES_PER_ROW,
        "footprint_method": (
            f"computed: every rank of the {at_once} trial(s) at once loads the full training split "
            f"({at_once * world} x {train_rows} rows x {BYTES_PER_ROW} bytes)"
        ),
        "moved_bytes": int(sum(executor.allreduce_bytes.values())),
        "moved_method": (
            "measured: gradient bytes every rank handed to the all-reduce, counted in the DDP comm "
            "hook (a ring all-reduce puts about 2(W-1)/W of them on the wire); parameter broadcast "
            "and the per-epoch loss and stop collectives not counted"
        ),
        "moved_is_estimate": False,
        "launches_s": [float(r["end"]) - float(r["start"]) for r in executor.records],
        "attempts": ddp_gangs.attempts(executor.records, sweep_start),
        "interruptions": executor.interruptions,
    }
    return outcomes, result | _ddp_steps(specs, outcomes, executor.allreduce_bytes, train_rows)


def _ddp_steps(
    specs: Sequence[Any], outcomes: dict[str, Any], allreduce: dict[str, int], train_rows: int
) -> dict[str, Any]:
    """Optimizer steps and all-reduced bytes of each DDP model."""
    from mopflow.training.models.builtin import ArchSpec, count_params
    from mopflow.training.models.families import DataSpec

    steps_total = 0
    per_model: dict[str, Any] = {}
    for spec in specs:
        per_rank_batch = max(1, int(spec.params["batch_size"]) // DDP_WORLD_SIZE)
        rank_rows = math.ceil(train_rows / DDP_WORLD_SIZE)  # ranks take equal (padded) shares
        outcome = outcomes.get(spec.model_id)
        steps = math.ceil(rank_rows / per_rank_batch) * (outcome.epochs_done if outcome is not None else 0)
        steps_total += steps
        per_model[spec.model_id] = {
            "params": count_params(ArchSpec.from_params(spec.params, DataSpec(N_FEATURES, 10))),
            "steps": steps,
            "per_rank_batch": per_rank_batch,
            "allreduce_bytes": allreduce.get(spec.model_id, 0),
        }
    return {"ddp_steps_total": steps_total, "ddp_models": per_model}


# name -> runner(name, job, specs, data, shared client or None) -> (outcomes, figures)
RUNNERS: dict[str, Callable[[str, dict[str, Any], list[Any], Any, Any], Any]] = {
    "sequential": _run_sequential,
    "task": _run_on_workers,
    "mop": _run_on_workers,
    "ddp": _run_ddp,
    "averaging": _run_on_workers,
    **dict.fromkeys(ddp_gangs.ROWS, _run_ddp),
}


def run_strategy(name: str, job: dict[str, Any], shared: Any = None) -> dict[str, Any]:
    """Train the job's models with one strategy; return its figures (see the module docstring).
    ``shared``: a Dask client to run on instead of a fresh cluster (``--quick``)."""
    from mopflow.training.executors.units import DataRef, ModelSpec

    data = DataRef.open(manifest_uri=job["manifest_uri"])
    specs = [ModelSpec.from_dict(m) for m in job["models"]]
    epochs = int(job["epochs"])
    result: dict[str, Any] = {"strategy": name, "loadavg_before": list(os.getloadavg())}
    outcomes, figures = RUNNERS[name](name, job, specs, data, shared)
    result |= figures | _accuracy(outcomes, specs, data)
    accs = [a for a in result["val_acc"].values() if a is not None]
    result["val_acc_mean"] = sum(accs) / len(accs) if len(accs) == len(specs) else None
    result["per_epoch_s"] = result["wall_s"] / epochs
    result["rows_per_s"] = len(specs) * epochs * int(job["train_rows"]) / result["wall_s"]
    result["loadavg_after"] = list(os.getloadavg())
    return result


def run_guarded(name: str, job: dict[str, Any], shared: Any) -> dict[str, Any]:
    """``run_strategy`` on the shared cluster of a quick run: a failure is recorded, and the
    other strategies still run."""
    import traceback

    try:
        return run_strategy(name, job, shared)
    except Exception as exc:
        tail = traceback.format_exc()[-3000:]
        return {"strategy": name, "error": f"{type(exc).__name__}: {exc}", "log_tail": tail}


def _child_main(name: str, job_path: Path, result_path: Path) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _one_thread_quietly()
    job = json.loads(job_path.read_text())
    result = run_strategy(name, job)
    result_path.write_text(json.dumps(result, indent=2))
    return 0


def _one_thread_quietly() -> None:
    """One torch thread in the training process (as in the workers), without Dask's warning
    that a cluster of 2 workers is small."""
    import torch

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# The driver


def _kill_tree(pid: int) -> None:
    """Kill a process and every descendant (the Dask nannies and workers), by pid."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


def launch(name: str, job_path: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    """Run one strategy in a subprocess under a wall-clock limit; return its figures or its failure."""
    result_path = work / f"result-{name}.json"
    log_path = work / f"log-{name}.txt"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-strategy",
        name,
        "--job",
        str(job_path),
        "--result",
        str(result_path),
    ]
    started = time.perf_counter()
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            rc = None
    elapsed = time.perf_counter() - started
    tail = log_path.read_text(errors="replace")[-3000:]
    if rc is None:
        return {"strategy": name, "error": f"timed out after {timeout_s:.0f}s", "log_tail": tail}
    if rc != 0 or not result_path.exists():
        return {"strategy": name, "error": f"exit code {rc}", "log_tail": tail}
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["subprocess_s"] = elapsed
    if result.get("interruptions"):  # what the coordinator logged about them (warnings)
        result["log_tail"] = tail
    return result


def shard(settings: Settings, data_root: str, shared: Any = None) -> tuple[str, dict[str, Any], float]:
    """Shard MNIST-1D once (on the ``shared`` cluster, else a fresh one); return the manifest URI,
    the manifest and the time it took."""
    from mopflow.training.compute.cluster import dask_client
    from mopflow.training.data import load_manifest, shard_dataset
    from mopflow.training.data.config import DataConfig

    cfg = DataConfig(num_samples=settings.num_samples, partition_rows=50_000, n_shards=settings.n_shards)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        client = shared or stack.enter_context(dask_client("", N_WORKERS))
        shard_result = shard_dataset(cfg, data_root, client)
    return shard_result.manifest_uri, load_manifest(shard_result.manifest_uri), time.perf_counter() - started


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------------------------------------
# Learning curves: validation accuracy after every epoch, and the gap to sequential


def curve_summary(curves: Mapping[str, Sequence[float]]) -> dict[str, list[Any]]:
    """Per epoch (from 1), across the models that reached it: the mean accuracy, its standard
    deviation, the lowest and the highest, and how many models."""
    summary: dict[str, list[Any]] = {"epoch": [], "mean": [], "std": [], "min": [], "max": [], "models": []}
    for index in range(max((len(c) for c in curves.values()), default=0)):
        values = [float(c[index]) for c in curves.values() if len(c) > index]
        summary["epoch"].append(index + 1)
        summary["mean"].append(statistics.fmean(values))
        summary["std"].append(statistics.pstdev(values))
        summary["min"].append(min(values))
        summary["max"].append(max(values))
        summary["models"].append(len(values))
    return summary


def last_epoch_gap(
    curves: Mapping[str, Sequence[float]], baseline: Mapping[str, Sequence[float]], epochs: int
) -> tuple[float | None, int]:
    """The mean over the configurations of (accuracy - the baseline's accuracy) after the last
    epoch, in points, and how many configurations finished every epoch under both."""
    pairs = [
        (curve[-1], baseline[mid][-1])
        for mid, curve in curves.items()
        if len(curve) == epochs and len(baseline.get(mid, ())) == epochs
    ]
    if not pairs:
        return None, 0
    return 100 * statistics.fmean(a - b for a, b in pairs), len(pairs)


def learning_curves(results: Mapping[str, Mapping[str, Any]], epochs: int) -> dict[str, dict[str, Any]]:
    """Each finished strategy's curve summary and its last-epoch gap to sequential."""
    baseline = results.get("sequential", {}).get("curves", {})
    out: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        if "error" in r:
            continue
        gap, n = last_epoch_gap(r["curves"], baseline, epochs)
        out[name] = {"curve": curve_summary(r["curves"]), "gap_points": gap, "gap_models": n}
    return out


def format_curves(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Accuracy by epoch per strategy: the mean across the configurations [lowest, highest]."""
    lines = ["validation accuracy by epoch (mean over configurations [min, max]):"]
    w = max([11, *(len(name) + 1 for name in results)])
    for name, r in results.items():
        c = r.get("curve")
        if "error" in r or not c:
            continue
        cells = [
            f"{m:.4f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in zip(c["mean"], c["min"], c["max"], strict=True)
        ]
        lines.append(f"  {name:<{w}}" + "  ".join(cells))
    return lines


def plot_curves(results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path:
    """The learning curves, one panel per strategy: the mean across the configurations, their
    range as a band, and sequential's mean (dashed) to compare with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(n, r) for n, r in results.items() if "error" not in r and r.get("curve", {}).get("epoch")]
    fig, axes = plt.subplots(
        1, max(1, len(shown)), figsize=(0.6 + 2.7 * max(1, len(shown)), 3.6), sharey=True, squeeze=False
    )
    base = results.get("sequential", {}).get("curve")
    for ax, (name, r) in zip(axes[0], shown, strict=False):
        c, gap = r["curve"], r.get("gap_points")
        ax.fill_between(c["epoch"], c["min"], c["max"], color="C0", alpha=0.25, linewidth=0, label="min-max")
        ax.plot(c["epoch"], c["mean"], color="C0", marker="o", markersize=3, label="mean")
        if base and name != "sequential":
            ax.plot(base["epoch"], base["mean"], color="0.35", linestyle="--", label="sequential mean")
        gap_s = "" if gap is None or name == "sequential" else f"\n{gap:+.2f} points vs sequential"
        ax.set_title(name + gap_s, fontsize=9)
        ax.set_xlabel("epoch")
        ax.set_xticks(c["epoch"])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Tables and targets


TABLE_COLUMNS = (
    "strategy", "wall_s", "per_epoch_s", "rows_per_s", "footprint_mb", "moved_mb", "val_acc_mean", "gap_pts", "idle",
)  # fmt: skip


def format_table(results: dict[str, dict[str, Any]]) -> str:
    cells: list[list[Any]] = []
    for name, r in results.items():
        if "error" in r:
            cells.append([name, f"FAILED: {r['error']}", *[""] * (len(TABLE_COLUMNS) - 2)])
            continue
        moved = r["moved_bytes"] / MB
        cells.append(
            [
                name,
                f"{r['wall_s']:.1f}",
                f"{r['per_epoch_s']:.1f}",
                f"{r['rows_per_s']:.0f}",
                f"{r['footprint_bytes'] / MB:.1f}",
                f"~{moved:.1f}" if r.get("moved_is_estimate") else f"{moved:.1f}",
                _fmt(r["val_acc_mean"], ".4f"),
                _fmt(r.get("gap_points"), "+.2f"),
                _fmt(r.get("idle_fraction"), ".1%"),
            ]
        )
    return "\n".join(harness.table_lines(TABLE_COLUMNS, cells))


def format_cpu(results: dict[str, dict[str, Any]]) -> list[str]:
    """Where the CPU went during each timed run (not a target: it tells a slower strategy that
    did more work from one that got less of the machine, e.g. other jobs on a shared host)."""
    lines = []
    for name, r in results.items():
        c = r.get("cpu")
        if "error" in r or not c:
            continue
        lines.append(
            f"CPU {name}: coordinator {c['coordinator_s']:.1f}s, workers {c['descendants_s']:.1f}s, "
            f"other processes {c['other_s']:.1f}s of {c['capacity_s']:.1f}s "
            f"({c['other_s'] / c['capacity_s']:.0%} of the machine)"
        )
    mop, task = results.get("mop", {}).get("cpu"), results.get("task", {}).get("cpu")
    if mop and task and task["descendants_s"]:
        lines.append(
            f"CPU mop/task worker seconds (same rows): {mop['descendants_s'] / task['descendants_s']:.3f}"
        )
    return lines


def evaluate_targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The Cerebro targets for MOP, model averaging's measured gap and the DDP rows' worker idle
    (``ddp_gangs.targets``); a target whose inputs are missing is UNDEFINED. The accuracy lines
    need ``learning_curves``' ``gap_points`` in ``results``."""

    def ok(name: str) -> dict[str, Any] | None:
        r = results.get(name)
        return r if r is not None and "error" not in r else None

    mop, task, ddp, seq = ok("mop"), ok("task"), ok("ddp"), ok("sequential")
    targets: list[dict[str, Any]] = []

    def add(label: str, value: float | None, passed: bool | None, unit: str, bound: str) -> None:
        status = "UNDEFINED" if passed is None else ("PASS" if passed else "FAIL")
        targets.append({"target": label, "value": value, "bound": bound, "unit": unit, "status": status})

    if mop and task:
        ratio = mop["rows_per_s"] / task["rows_per_s"]
        add(
            "MOP throughput vs task",
            ratio,
            ratio >= TARGET_TASK_THROUGHPUT,
            "x",
            f">= {TARGET_TASK_THROUGHPUT}x",
        )
        fp = mop["footprint_bytes"] / task["footprint_bytes"] if task["footprint_bytes"] else None
        add("MOP data footprint vs task", fp, None if fp is None else fp <= TARGET_FOOTPRINT, "x", "<= 0.5x")
    else:
        add("MOP throughput vs task", None, None, "x", f">= {TARGET_TASK_THROUGHPUT}x")
        add("MOP data footprint vs task", None, None, "x", "<= 0.5x")
    if mop and ddp:
        ratio = mop["rows_per_s"] / ddp["rows_per_s"]
        add(
            "MOP throughput vs DDP",
            ratio,
            ratio >= TARGET_DDP_THROUGHPUT,
            "x",
            f">= {TARGET_DDP_THROUGHPUT}x",
        )
    else:
        add("MOP throughput vs DDP", None, None, "x", f">= {TARGET_DDP_THROUGHPUT}x")
    idle = mop.get("idle_fraction") if mop else None
    add("MOP idle fraction", idle, None if idle is None else idle <= TARGET_IDLE, "", f"<= {TARGET_IDLE:.0%}")
    gap = mop.get("gap_points") if mop and seq else None
    within = f"within {TARGET_ACC_POINTS} points"
    add(
        "MOP accuracy gap to sequential (last epoch)",
        gap,
        None if gap is None else abs(gap) <= TARGET_ACC_POINTS,
        "points",
        within,
    )
    targets.append(averaging_gap(ok("averaging") if seq else None))
    return targets + ddp_gangs.targets(ok("ddp_trials"), ok("ddp_one_at_a_time"))


def averaging_gap(averaging: Mapping[str, Any] | None) -> dict[str, Any]:
    """Model averaging's gap to sequential, reported as measured, with whether it lags (by more
    than ``TARGET_ACC_POINTS``) as the paper finds."""
    gap = averaging.get("gap_points") if averaging else None
    line: dict[str, Any] = {
        "target": "Model averaging gap to sequential (last epoch)",
        "value": gap,
        "bound": "reported; the paper finds that MA lags",
        "unit": "points",
        "status": "UNDEFINED" if gap is None else "MEASURED",
    }
    if gap is not None:
        line["lags"] = gap < -TARGET_ACC_POINTS
        line["note"] = (
            "it lags sequential, as in the paper"
            if line["lags"]
            else f"it does NOT lag sequential here (within {TARGET_ACC_POINTS} points or ahead), unlike the paper"
        )
    return line


def format_target(t: dict[str, Any]) -> str:
    value = t["value"]
    if value is None:
        shown = "n/a"
    elif t["unit"] == "x":
        shown = f"{value:.3f}x"
    elif t["unit"] == "points":
        shown = f"{value:+.2f} points"
    else:
        shown = f"{value:.1%}"
    note = f"; {t['note']}" if t.get("note") else ""
    return f"{t['status']:<9} {t['target']}: {shown} (target {t['bound']}){note}"


def cluster_size(name: str) -> int:
    """The workers a strategy runs on (``--quick``: the size of the shared cluster it takes)."""
    return ddp_gangs.WORKERS if name in ddp_gangs.ROWS else N_WORKERS


def run_all(
    settings: Settings, job_path: Path, work: Path, shared: Mapping[int, Any]
) -> dict[str, dict[str, Any]]:
    """Every strategy of the run, each in its own subprocess (``--quick``: one after another on
    the ``shared`` cluster of its size, in this process), with their progress printed."""
    results: dict[str, dict[str, Any]] = {}
    job = json.loads(job_path.read_text())
    for name in settings.strategies:
        print(f"running {name} ({settings.configs} configs x {settings.epochs} epochs) ...", flush=True)
        if shared:
            results[name] = run_guarded(name, job, shared[cluster_size(name)])
        else:
            results[name] = launch(name, job_path, work, settings.timeout_s)
        _print_progress(name, results[name])
    return results


def _print_progress(name: str, r: Mapping[str, Any]) -> None:
    if "error" in r:
        print(f"  {name} FAILED: {r['error']}\n{r.get('log_tail', '')[-1500:]}", flush=True)
        return
    print(f"  {name}: {r['wall_s']:.1f}s, val_acc_mean {_fmt(r['val_acc_mean'], '.4f')}", flush=True)
    if "cpu" in r:
        c = r["cpu"]
        busy = r.get("records", {}).get("busy_s")
        print(
            f"  {name} CPU during the run: coordinator {c['coordinator_s']:.1f}s, "
            f"workers {c['descendants_s']:.1f}s, other processes {c['other_s']:.1f}s "
            f"of {c['capacity_s']:.1f}s; unit busy (wall) {_fmt(busy, '.1f')}s",
            flush=True,
        )
    if r.get("errors"):
        print(f"  {name}: model errors: {r['errors']}", flush=True)


DEFINITIONS = {
    "rows_per_s": "configs x epochs x train rows / wall_s (wall of executor.run only)",
    "per_epoch_s": "wall_s / epochs",
    "idle_fraction": "mop: mean over rounds of training.executors.gantt.idle_fraction(round records)",
    "worker_idle": "ddp rows: per worker, 1 - busy / sweep wall; busy = sum over the executor's records "
    "whose gang includes the worker of (end - start) clipped to the sweep's wall interval",
    "val_acc_mean": "mean over models of units.evaluate_state(final state) on the validation split",
    "curves": "per model: the val_acc of the EpochReport after each epoch (outcome.history)",
    "curve": "per epoch: mean, population std, min, max of the curves across models, and how many",
    "gap_points": "100 x mean over models of (last-epoch val_acc - sequential's of the same model); "
    "models that did not finish every epoch under both are left out (gap_models counts the rest)",
}


def run(settings: Settings, out_dir: Path) -> int:
    wall_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-strategies-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        shared: dict[int, Any] = {}
        if settings.quick:  # one process, a cluster per size: it checks that everything runs, fast
            _one_thread_quietly()
            for size in sorted({cluster_size(name) for name in settings.strategies}):
                shared[size], _ = stack.enter_context(_cluster({"device": settings.device}, None, size))
        return _run(settings, out_dir, work, shared, wall_start)


def _run(settings: Settings, out_dir: Path, work: Path, shared: dict[int, Any], wall_start: float) -> int:
    """Shard the data, run the strategies, print and write the results."""
    from importlib.metadata import version

    manifest_uri, manifest, shard_s = shard(settings, str(work / "data"), next(iter(shared.values()), None))
    splits = manifest["splits"]
    train_rows = sum(int(e["rows"]) for e in splits["train"])
    val_rows = sum(int(e["rows"]) for e in splits["validation"])
    shards = [str(e["name"]) for e in splits["train"]]
    print(
        f"sharded {settings.num_samples} MNIST-1D samples in {shard_s:.1f}s: {train_rows} train rows "
        f"in {len(shards)} shards, {val_rows} validation rows"
    )
    if not settings.quick and train_rows < 100_000:
        print(f"WARNING: only {train_rows} training rows (the benchmark asks for >= 100,000)")
    models = model_specs(settings)
    job = {
        "manifest_uri": manifest_uri,
        "models": models,
        "shards": shards,
        "epochs": settings.epochs,
        "train_rows": train_rows,
        "ddp_epoch_timeout_s": min(settings.timeout_s, 600.0),
        "device": settings.device,
    }
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job))
    results = run_all(settings, job_path, work, shared)
    for name, curves in learning_curves(results, settings.epochs).items():
        results[name] |= curves
    per_gpu = _trials_per_gpu_sweep(settings, job, work)
    table = format_table(results)
    targets = evaluate_targets(results)
    gang_rows = [name for name in settings.strategies if name in ddp_gangs.ROWS]
    header = (
        f"strategies: {len(models)} configs x {settings.epochs} epochs, {train_rows} train rows, "
        f"batch {settings.batch_size}, {N_WORKERS} workers / DDP world {DDP_WORLD_SIZE}, "
        f"{os.cpu_count()} CPUs"
        + (" (--quick: one process, shared clusters; timings not comparable)" if settings.quick else "")
        + (f"; {ddp_gangs.WORKERS} workers for {', '.join(gang_rows)}" if gang_rows else "")
        + (f"\nnote: {settings.note}" if settings.note else "")
    )
    curve_lines = format_curves(results)
    target_lines = [format_target(t) for t in targets]
    cpu_lines = format_cpu(results) + ddp_gangs.format_idle(results)
    per_gpu_lines = format_trials_per_gpu(per_gpu)
    print(f"\n{header}\n{table}\n")
    print("\n".join([*curve_lines, "", *target_lines, *cpu_lines, *per_gpu_lines]))
    title = (
        f"Validation accuracy after each epoch: {len(models)} configurations, {train_rows} training rows, "
        f"{settings.device}{' (--quick)' if settings.quick else ''}"
    )
    png = plot_curves(results, out_dir / f"{settings.stem}_curves.png", title)
    report = {
        "benchmark": "strategies",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "note": settings.note,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": version("torch"),
            "torch_threads_per_process": 1,
        },
        "settings": asdict(settings)
        | {
            "parallel_trials": N_WORKERS,
            "ddp_world_size": DDP_WORLD_SIZE,
            "ddp_gang_workers": ddp_gangs.WORKERS,
            "models": models,
            "data_config": manifest["config"],
        },
        "data": {
            "train_rows": train_rows,
            "validation_rows": val_rows,
            "train_shards": shards,
            "manifest_hash": manifest["manifest_hash"],
            "train_bytes_in_memory": train_rows * BYTES_PER_ROW,
            "shard_s": shard_s,
        },
        "definitions": DEFINITIONS,
        "results": results,
        "trials_per_gpu": per_gpu,
        "targets": targets,
        "curves_png": png.name,
        "total_s": time.perf_counter() - wall_start,
        "printed": [header, table, *curve_lines, *target_lines, *cpu_lines, *per_gpu_lines],
    }
    out = out_dir / f"{settings.stem}.json"
    harness.write_report(out, report, lead="\n", config=settings)
    print(f"wrote {png}")
    return 0


def _trials_per_gpu_sweep(settings: Settings, job: dict[str, Any], work: Path) -> dict[str, Any]:
    """``task`` on the GPU with k worker processes per GPU, for each k: trials/s relative to k=1."""
    out: dict[str, Any] = {}
    for k in settings.trials_per_gpu:
        path = work / f"job-tpg{k}.json"
        path.write_text(json.dumps(job | {"trials_per_gpu": k}))
        print(f"running task with {k} worker(s) per GPU ...", flush=True)
        r = launch("task", path, work, settings.timeout_s)
        if "error" in r:
            out[str(k)] = {"error": r["error"]}
            continue
        out[str(k)] = {
            "wall_s": r["wall_s"],
            "trials_per_s": settings.configs / r["wall_s"],
            "val_acc_mean": r["val_acc_mean"],
            "workers": r.get("workers"),
        }
    base = out.get("1", {}).get("trials_per_s")
    for entry in out.values():
        if base and "trials_per_s" in entry:
            entry["relative_to_1"] = entry["trials_per_s"] / base
    return out


def format_trials_per_gpu(per_gpu: dict[str, Any]) -> list[str]:
    """One line per k of the trials-per-GPU sweep."""
    lines = []
    for k, r in per_gpu.items():
        if "error" in r:
            lines.append(f"trials_per_gpu={k}: FAILED {r['error']}")
        else:
            lines.append(
                f"trials_per_gpu={k}: {r['trials_per_s']:.3f} trials/s "
                f"({_fmt(r.get('relative_to_1'), '.2f')}x of 1), val_acc_mean {_fmt(r['val_acc_mean'], '.4f')}"
            )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__, "3000 samples, 2 configs, 2 epochs, one process")
    parser.add_argument(
        "--num-samples", type=int, default=None, help="MNIST-1D samples generated (default 142000)"
    )
    parser.add_argument("--n-shards", type=int, default=4, help="training shards")
    parser.add_argument("--configs", type=int, default=None, help=f"configurations (1..{len(CONFIGS)})")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per model (default 4)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch size of every configuration")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGY_ORDER), help="comma-separated subset of the strategies"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="wall-clock limit per strategy")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where every strategy trains"
    )
    parser.add_argument(
        "--trials-per-gpu",
        default="",
        help="cuda: comma-separated worker counts per GPU for an extra task sweep (e.g. 1,2,4,8)",
    )
    parser.add_argument(
        "--note", default="", help="a remark stored in the JSON and printed (e.g. a shared machine)"
    )
    parser.add_argument("--run-strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_strategy:
        return _child_main(args.run_strategy, args.job, args.result)
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in STRATEGY_ORDER]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; expected some of {list(STRATEGY_ORDER)}")
    configs = args.configs if args.configs is not None else (2 if args.quick else len(CONFIGS))
    if not 1 <= configs <= len(CONFIGS):
        raise SystemExit(f"--configs must be between 1 and {len(CONFIGS)}")
    per_gpu = tuple(int(k) for k in args.trials_per_gpu.split(",") if k.strip())
    named = args.out is not None and args.out.suffix == ".json"  # --out names the JSON file
    if per_gpu and args.device != "cuda":
        raise SystemExit("--trials-per-gpu needs --device cuda")
    if args.device == "cuda" and not args.run_strategy:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU)")
    settings = Settings(
        device=args.device,
        trials_per_gpu=per_gpu,
        num_samples=args.num_samples or (3000 if args.quick else 142_000),
        n_shards=args.n_shards,
        configs=configs,
        epochs=args.epochs or (2 if args.quick else 4),
        batch_size=args.batch_size,
        weight_decay=1e-5,
        strategies=strategies,
        timeout_s=args.timeout_s,
        quick=args.quick,
        name=args.out.stem if named else "",
        note=args.note,
    )
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import distributed  # noqa: F401 - importing it sets its loggers from Dask's config

    logging.getLogger("distributed").setLevel(logging.WARNING)  # its INFO chatter hides the table
    return run(settings, output_dir(args.out.parent if named else args.out, args.quick))


def output_dir(out: Path | None, quick: bool) -> Path:
    """Where the results go: ``out`` (a folder for the JSON and the curves PNG, default
    ``benchmarks/results/``; ``--out NAME.json`` puts the PNG beside it as ``NAME_curves.png``);
    a quick run never writes over the committed results, so without another folder it takes a
    new temporary one."""
    chosen = out or RESULTS_DIR
    if quick and chosen.resolve() == RESULTS_DIR.resolve():
        chosen = Path(tempfile.mkdtemp(prefix="strategies-quick-"))
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


if __name__ == "__main__":
    sys.exit(main())
